"""Tiny random checkpoints: stock transformers loads them, ids match the trained tokenizer, builds are exact."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from common.models.tiny import build_tiny, train_tokenizer
from pdserve.commands import model as model_cmd

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
MODEL_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "mistral": "MistralForCausalLM"}
# What AutoTokenizer returns for each directory in transformers 5.24 (Qwen2 ignores tokenizer_config.json).
TOKENIZER_CLASS = {"llama": "TokenizersBackend", "qwen2": "Qwen2Tokenizer", "qwen3": "TokenizersBackend",
                   "mistral": "TokenizersBackend"}
BUILD_FILES = {"SHA256SUMS", "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
               "tokenizer.json", "tokenizer_config.json"}
# Not the strings build_tiny checks itself: whitespace runs, CRLF, NBSP, digits, unicode beyond the BMP, code.
TRICKY = (
    "    indented\n\n\n  code()  \n",
    "naïve café 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ☃ 👩‍💻",
    "１２３ numbers 0x1F 10_000 -3.5e-7",
    "a\u00a0b\r\nc\t\t\td   ",
    "for (int i = 0; i < n; ++i) { x[i] += y[i]; }",
    "You'RE we've they'd \"quoted\" 'single'",
    "</s> inside <s> text<pad>",
)


@pytest.fixture(scope="module", params=ARCHS)
def built(request, tmp_path_factory) -> tuple[str, Path]:
    arch = request.param
    return arch, build_tiny(arch, tmp_path_factory.mktemp(arch) / "model")


def test_directory_layout_and_config(built):
    arch, path = built
    assert {p.name for p in path.iterdir()} == BUILD_FILES
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [MODEL_CLASS[arch]]
    assert config["model_type"] == arch
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"]) == (128, 4, 4, 2, 256)
    assert (config["vocab_size"], config["max_position_embeddings"]) == (4096, 2048)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 3)
    assert config["dtype"] == "float32"
    assert config["tie_word_embeddings"] is False
    assert config["initializer_range"] == pytest.approx(1.5 / 128**0.5, abs=1e-6)
    if arch == "mistral":
        assert config["sliding_window"] == 64
    if arch in ("qwen2", "qwen3"):
        assert config["use_sliding_window"] is False
        assert config["layer_types"] == ["full_attention"] * 4
    if arch == "qwen3":
        assert config["head_dim"] == 32


def test_stock_transformers_reload_and_greedy_default(built):
    arch, path = built
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == MODEL_CLASS[arch]
    assert next(model.parameters()).dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(tokenizer).__name__ == TOKENIZER_CLASS[arch]
    assert len(tokenizer) == 4096
    inputs = tokenizer("The class statement", return_tensors="pt")
    with torch.no_grad():
        first = model.generate(**inputs, max_new_tokens=12)  # generation_config.json only: greedy
        again = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert first.shape == (1, inputs["input_ids"].shape[1] + 12)
    assert torch.equal(first, again)


def test_generation_config_is_ids_only(built):
    _, path = built
    saved = json.loads((path / "generation_config.json").read_text())
    assert {k: v for k, v in saved.items() if k != "transformers_version"} == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    generation_config = GenerationConfig.from_pretrained(path)
    assert generation_config.eos_token_id == 2
    assert not generation_config.do_sample  # unset (None in transformers 5): greedy


def test_autotokenizer_ids_equal_trained_ids(built):
    arch, path = built
    trained = train_tokenizer(arch, 4096)
    tokenizer = AutoTokenizer.from_pretrained(path)
    for text in TRICKY:
        assert tokenizer.encode(text) == trained.encode(text).ids, text
        assert tokenizer(text)["input_ids"] == trained.encode(text).ids, text
    # no BOS/EOS added: "hello" is exactly its BPE pieces
    assert tokenizer.encode("hello") == trained.encode("hello").ids
    assert 1 not in tokenizer.encode("hello") and 2 not in tokenizer.encode("hello")
    assert tokenizer.encode("</s> inside <s> text<pad>")[0] == 2


@pytest.mark.parametrize("text", ["The quick brown fox\n\tjumps  over 42 lazy dogs.", "Grüße, 世界! ∮ E⋅da = Q 🎉"])
def test_decode_round_trip(built, text):
    _, path = built
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_template(built):
    _, path = built
    tokenizer = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s>system\nBe brief.</s>\n<s>user\nhi there</s>\n<s>assistant\n"
    ids = tokenizer.encode(text)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2


def test_manifest_lists_weights(built):
    _, path = built
    digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    assert (path / "SHA256SUMS").read_text() == f"{digest}  model.safetensors\n"


def test_same_seed_identical_files_other_seed_other_weights(tmp_path):
    first = build_tiny("llama", tmp_path / "a", seed=7)
    second = build_tiny("llama", tmp_path / "b", seed=7)
    other = build_tiny("llama", tmp_path / "c", seed=8)
    for name in BUILD_FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_rebuild_replaces_files_and_keeps_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    path = build_tiny("llama", tmp_path / "m", seed=1, overrides={"num_hidden_layers": 1})
    assert torch.equal(torch.rand(3), expected)
    build_tiny("llama", path, seed=2, overrides={"num_hidden_layers": 1})
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 1
    assert {p.name for p in path.iterdir()} == BUILD_FILES


def test_greedy_steps_are_not_near_ties(built):
    """INIT_GAIN keeps top-1/top-2 logit gaps far above float32 noise, so greedy output is robust."""
    _, path = built
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs = tokenizer("def main(argv):\n    return", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=64, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, eos_token_id=None)
    gaps = torch.stack([s[0].topk(2).values for s in out.scores])  # [steps, 2]
    assert (gaps[:, 0] - gaps[:, 1]).min().item() > 1e-4
    assert len(set(out.sequences[0, inputs["input_ids"].shape[1]:].tolist())) > 32  # not a short loop


def test_vocab_larger_than_tokenizer_zeroes_unused_lm_head_rows(tmp_path):
    path = build_tiny("llama", tmp_path / "m", overrides={"vocab_size": 8000, "num_hidden_layers": 1})
    num_tokens = len(AutoTokenizer.from_pretrained(path))
    assert 4096 < num_tokens < 8000  # the corpus runs out of merges first
    with safe_open(path / "model.safetensors", "pt") as f:
        lm_head = f.get_tensor("lm_head.weight")
    assert lm_head.shape == (8000, 128)
    assert not lm_head[num_tokens:].any()
    assert lm_head[:num_tokens].abs().sum(dim=1).min() > 0


def test_bf16_and_size_dtype(tmp_path):
    path = build_tiny("qwen2", tmp_path / "m", dtype="bfloat16", overrides={"num_hidden_layers": 1})
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(path / "model.safetensors", "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16


def test_qwen2_sliding_window_override(tmp_path):
    path = build_tiny("qwen2", tmp_path / "m", overrides={"sliding_window": 32, "num_hidden_layers": 2})
    config = json.loads((path / "config.json").read_text())
    assert (config["sliding_window"], config["use_sliding_window"]) == (32, True)
    assert config["layer_types"] == ["sliding_attention", "sliding_attention"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(arch="gpt2"), "'gpt2'"),
        (dict(arch="llama", size="7b"), "'7b'"),
        (dict(arch="llama", dtype="float64"), "'float64'"),
        (dict(arch="llama", overrides={"sliding_window": 16}), "llama has no sliding"),
        (dict(arch="llama", overrides={"vocab_size": 100}), "vocab_size 100"),
    ],
)
def test_bad_arguments_are_named(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_tiny(out_dir=tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()


def test_refuses_directory_with_foreign_files(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="notes.txt"):
        build_tiny("llama", tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_cli_build_tiny(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    model_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "cli-model"
    args = parser.parse_args(["model", "build-tiny", "--arch", "mistral", "--out", str(out), "--seed", "3",
                              "--num-layers", "2", "--sliding-window", "16", "--hidden-size", "64",
                              "--num-heads", "2", "--num-kv-heads", "1", "--dtype", "float16"])
    assert args.func(args) == 0
    assert capsys.readouterr().out == f"{out}\n"
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["sliding_window"], config["hidden_size"],
            config["num_attention_heads"], config["num_key_value_heads"], config["dtype"]) == (
        2, 16, 64, 2, 1, "float16")
    with pytest.raises(SystemExit):
        parser.parse_args(["model", "build-tiny", "--arch", "llama", "--out", "x", "--num-layers", "0"])


def test_cli_module_does_not_import_torch():
    code = "import sys, pdserve.commands.model; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3])
