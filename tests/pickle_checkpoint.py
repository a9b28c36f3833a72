"""A pickle-only copy of a model directory, for the tests of the pickle refusal and ``--allow-pickle-weights``."""

from __future__ import annotations

import shutil
from pathlib import Path


def pickle_copy(src: str | Path, dst: str | Path) -> Path:
    """``src`` with its ``model.safetensors`` re-saved as ``pytorch_model.bin`` (``torch.save`` of the state
    dict: what ``save_pretrained(safe_serialization=False)`` wrote before transformers 5 dropped it); the
    ``SHA256SUMS`` manifest is left out. ``dst`` must not exist."""
    import torch
    from safetensors.torch import load_file

    src, dst = Path(src), Path(dst)
    dst.mkdir()
    for file in src.iterdir():
        if file.suffix != ".safetensors" and file.name != "SHA256SUMS":
            shutil.copy(file, dst / file.name)
    torch.save(load_file(src / "model.safetensors"), dst / "pytorch_model.bin")
    return dst
