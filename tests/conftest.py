"""Shared fixtures: tiny models built once per session, stock-transformers references, engines."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip, with the reason, on a machine without a CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """``tiny_model_dir(arch, **overrides)`` → path of a tiny model, built once per session per arguments."""
    from common.models.tiny import build_tiny

    built: dict[tuple, str] = {}

    def get(arch: str = "llama", seed: int = 0, **overrides) -> str:
        key = (arch, seed, json.dumps(overrides, sort_keys=True))
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[key] = str(build_tiny(arch, out, seed=seed, overrides=overrides or None))
        return built[key]

    return get


@pytest.fixture(scope="session")
def hf_reference():
    """``hf_reference(model_dir)`` → a stock transformers model (default attention) in fp32, cached."""
    import torch
    from transformers import AutoModelForCausalLM

    models = {}

    def get(model_dir: str):
        if model_dir not in models:
            models[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        return models[model_dir]

    return get


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """Stock ``generate(do_sample=False)`` for one prompt; new token ids (ends at EOS like generate)."""
    import torch

    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=model.generation_config.pad_token_id,
    )
    return out[0, len(prompt_ids) :].tolist()
