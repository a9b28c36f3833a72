"""What a prefill and a decode worker must agree on before KV moves between them.

Built from a running engine; compared field by field so that a mismatch (a rolling upgrade that changed
the weights, the dtype, the quantization, the block size or the tokenizer; an older protocol) fails with every
difference named instead of decoding garbage.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.engine.engine import LLMEngine

PROTOCOL_VERSION = 1  # the prefill/decode protocol and the KV wire format (common/kv_transfer/wire.py)
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "chat_template.jinja",
)  # fmt: skip


@dataclass(frozen=True)
class ModelIdentity:
    model_fingerprint: str
    dtype: str
    block_size: int
    tokenizer_fingerprint: str
    protocol_version: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    quantization: str  # a QUANTIZATION_METHODS name: the weights' form changes the KV values they compute

    @classmethod
    def of_engine(cls, engine: LLMEngine) -> ModelIdentity:
        spec = engine.handoff_spec  # every KV head: what the hand-off carries, whatever the TP layout
        return cls(
            model_fingerprint=engine.loaded.fingerprint,
            dtype=str(spec.dtype).removeprefix("torch."),
            block_size=spec.block_size,
            tokenizer_fingerprint=tokenizer_fingerprint(engine.loaded.model_dir),
            protocol_version=PROTOCOL_VERSION,
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            quantization=engine.loaded.quantization,
        )

    def mismatches(self, other: ModelIdentity) -> list[str]:
        """``field: ours != theirs`` for every field that differs (empty when compatible)."""
        ours, theirs = _comparable(asdict(self)), _comparable(asdict(other))
        return [f"{k}: {ours[k]!r} != {theirs[k]!r}" for k in ours if ours[k] != theirs[k]]


def _comparable(fields: dict) -> dict:
    # A peer older than the quantization field sends none, read as "": it could only run unquantized, so ""
    # counts as "none" (mixed versions are not refused for that alone).
    if fields["quantization"] == "":
        fields["quantization"] = "none"
    return fields


def tokenizer_fingerprint(model_dir: str | Path) -> str:
    """sha256 over the tokenizer files present in ``model_dir`` (names and contents)."""
    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()
