"""benchmarks/train_tiny.py: a few steps lower both losses, the trained weights replace the random ones under a
manifest the loader verifies, and the agreement prompts come from text the training never saw."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import train_tiny  # noqa: E402


@pytest.mark.slow
def test_a_short_run_learns_and_saves_a_model_the_engine_loads(tmp_path):
    from transformers import AutoTokenizer

    from common.engine.loader import load_model, sha256_file
    from common.models.tiny import build_tiny

    out = tmp_path / "trained"
    figures = train_tiny.train(out, steps=12, batch=4, seq_len=64)

    assert figures["train_loss_last10"] < figures["train_loss_first"] - 1.0
    assert figures["held_out_loss_after"] < figures["held_out_loss_before"] - 1.0
    assert json.loads((out / "training.json").read_text()) == figures
    manifest = (out / "SHA256SUMS").read_text()
    random_start = build_tiny("llama", tmp_path / "random", overrides=train_tiny.SHAPE)  # the same seed's weights
    assert sha256_file(out / "model.safetensors") in manifest  # the trained file, not the random one
    assert sha256_file(random_start / "model.safetensors") not in manifest
    loaded = load_model(out)  # checks the manifest
    assert loaded.model.config.hidden_size == train_tiny.SHAPE["hidden_size"]

    tokenizer = AutoTokenizer.from_pretrained(out)
    prompts = train_tiny.held_out_prompts(tokenizer, 5, 32)
    train_text, held_text = train_tiny.corpus()
    assert [len(p) for p in prompts] == [32] * 5 and len({tuple(p) for p in prompts}) == 5
    assert held_text and held_text not in train_text
    for p in prompts:
        assert tokenizer.decode(p[4:-4]) in held_text
