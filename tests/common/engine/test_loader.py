"""load_model on real (tiny) checkpoints: dtypes, manifest checks, refusals, fingerprint, eos ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig

from common.engine.loader import (
    ModelLoadError,
    compute_fingerprint,
    load_model,
    resolve_dtype,
    sha256_file,
    verify_manifest,
    weight_files,
    write_manifest,
)
from common.models.tiny import build_tiny
from tests.pickle_checkpoint import pickle_copy


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loader-models")
    return {
        "fp32": build_tiny("llama", root / "fp32", seed=0),
        "bf16": build_tiny("qwen2", root / "bf16", seed=0, dtype="bfloat16"),
        "seed1": build_tiny("llama", root / "seed1", seed=1),
    }


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_load_fp32_matches_stock_transformers(models):
    loaded = load_model(models["fp32"])
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    assert loaded.model.training is False
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in loaded.model.parameters())
    assert (loaded.dtype, loaded.device, loaded.model_dir) == (torch.float32, torch.device("cpu"), models["fp32"])
    assert type(loaded.tokenizer).__name__ == "TokenizersBackend"
    assert loaded.config.model_type == "llama"
    assert loaded.generation_config.eos_token_id == 2
    assert loaded.eos_token_ids == (2,)
    assert loaded.max_model_len == 2048
    stock = AutoModelForCausalLM.from_pretrained(models["fp32"]).eval()
    ids = torch.tensor([loaded.tokenizer.encode("The class statement defines")])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, stock(ids).logits)


def test_load_bf16_auto_and_explicit_cast(models):
    loaded = load_model(models["bf16"])  # "auto": the checkpoint's dtype
    assert loaded.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert type(loaded.tokenizer).__name__ == "Qwen2Tokenizer"
    cast = load_model(models["fp32"], dtype="bf16")
    assert cast.dtype == torch.bfloat16
    assert {p.dtype for p in cast.model.parameters()} == {torch.bfloat16}
    upcast = load_model(models["bf16"], dtype=torch.float32)
    assert {p.dtype for p in upcast.model.parameters()} == {torch.float32}


@pytest.mark.parametrize(
    ("name", "expected"),
    [("float32", torch.float32), ("fp32", torch.float32), ("bfloat16", torch.bfloat16), ("BF16", torch.bfloat16),
     ("float16", torch.float16), ("fp16", torch.float16), (torch.bfloat16, torch.bfloat16),
     ("auto", torch.float32), (None, torch.float32)],
)
def test_resolve_dtype(name, expected):
    assert resolve_dtype(name) is expected


def test_resolve_dtype_auto_reads_config():
    assert resolve_dtype("auto", BertConfig(dtype="bfloat16")) is torch.bfloat16
    assert resolve_dtype("auto", BertConfig()) is torch.float32


@pytest.mark.parametrize("bad", ["float64", "int8", "", torch.float64])
def test_resolve_dtype_rejects_and_names_value(bad):
    with pytest.raises(ModelLoadError, match=repr(bad).replace(".", r"\.")):
        resolve_dtype(bad)


def test_load_model_bad_dtype_names_it(models):
    with pytest.raises(ModelLoadError, match="'half-ish'"):
        load_model(models["fp32"], dtype="half-ish")


def test_verify_manifest_true_and_false(models, tmp_path):
    assert verify_manifest(models["fp32"]) is True
    bare = _copy(models["fp32"], tmp_path / "bare")
    (bare / "SHA256SUMS").unlink()
    assert verify_manifest(bare) is False
    assert load_model(bare).fingerprint == compute_fingerprint(bare)


def test_tampered_weights_refused_unless_verify_off(models, tmp_path):
    bad = _copy(models["fp32"], tmp_path / "tampered")
    weights = bad / "model.safetensors"
    expected = sha256_file(weights)
    _flip_byte(weights, weights.stat().st_size // 2)  # inside tensor data: still a valid file
    actual = sha256_file(weights)
    with pytest.raises(ModelLoadError, match="model.safetensors") as info:
        verify_manifest(bad)
    assert expected in str(info.value) and actual in str(info.value)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(bad)
    assert load_model(bad, verify=False).eos_token_ids == (2,)


def test_unreadable_weights_named(models, tmp_path):
    bad = _copy(models["fp32"], tmp_path / "truncated")
    with (bad / "model.safetensors").open("r+b") as f:
        f.truncate(1000)
    with pytest.raises(ModelLoadError, match=f"cannot load model directory {bad}"):
        load_model(bad, verify=False)


def test_manifest_missing_and_unlisted_files(models, tmp_path):
    missing = _copy(models["fp32"], tmp_path / "missing")
    (missing / "SHA256SUMS").write_text((missing / "SHA256SUMS").read_text() + f"{'0' * 64}  extra.safetensors\n")
    with pytest.raises(ModelLoadError, match="extra.safetensors.*missing"):
        verify_manifest(missing)
    unlisted = _copy(models["fp32"], tmp_path / "unlisted")
    shutil.copy(unlisted / "model.safetensors", unlisted / "model-2.safetensors")
    with pytest.raises(ModelLoadError, match="model-2.safetensors"):
        verify_manifest(unlisted)
    malformed = _copy(models["fp32"], tmp_path / "malformed")
    (malformed / "SHA256SUMS").write_text("not a digest  model.safetensors\n")
    with pytest.raises(ModelLoadError, match="SHA256SUMS:1"):
        verify_manifest(malformed)


def test_missing_directory_named(tmp_path):
    with pytest.raises(ModelLoadError, match="nowhere.*does not exist"):
        load_model(tmp_path / "nowhere")


def test_directory_without_config_named(tmp_path):
    with pytest.raises(ModelLoadError, match=f"{tmp_path}.*no config.json"):
        load_model(tmp_path)


def test_non_causal_config_refused(tmp_path):
    BertConfig().save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=f"{tmp_path}.*'bert' is not a causal LM"):
        load_model(tmp_path)


def test_non_causal_architecture_refused(models, tmp_path):
    path = _copy(models["fp32"], tmp_path / "classifier")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSequenceClassification"]}))
    with pytest.raises(ModelLoadError, match="LlamaForSequenceClassification"):
        load_model(path)


def test_pickle_only_checkpoint_refused(models, tmp_path):
    shutil.copy(models["fp32"] / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even read")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin.*pickle checkpoints are refused"):
        load_model(tmp_path)


def test_fingerprint_stable_and_model_specific(models, tmp_path):
    first = load_model(models["fp32"]).fingerprint
    assert len(first) == 64 and int(first, 16) >= 0
    assert load_model(models["fp32"]).fingerprint == first == compute_fingerprint(models["fp32"])
    assert compute_fingerprint(_copy(models["fp32"], tmp_path / "copy")) == first  # path is not identity
    assert compute_fingerprint(models["seed1"]) != first
    assert compute_fingerprint(models["bf16"]) != first


def test_fingerprint_without_manifest_reads_head_and_tail(models, tmp_path):
    bare = _copy(models["seed1"], tmp_path / "bare")
    (bare / "SHA256SUMS").unlink()
    before = compute_fingerprint(bare)
    assert before != compute_fingerprint(models["seed1"])
    weights = bare / "model.safetensors"
    _flip_byte(weights, weights.stat().st_size - 10)
    assert compute_fingerprint(bare) != before


def test_eos_token_ids_union_in_order(models, tmp_path):
    path = _copy(models["fp32"], tmp_path / "eos")
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [5, 2, 5]}))
    assert load_model(path).eos_token_ids == (5, 2)
    (path / "generation_config.json").unlink()
    loaded = load_model(path)
    assert loaded.generation_config is None
    assert loaded.eos_token_ids == (2,)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error(models):
    with pytest.raises(ModelLoadError, match="'cuda'.*CUDA is not available"):
        load_model(models["fp32"], device="cuda")


def test_unsupported_device_named(models):
    with pytest.raises(ModelLoadError, match="'warp-drive'"):
        load_model(models["fp32"], device="warp-drive")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_load(models):
    loaded = load_model(models["fp32"], device="cuda")
    assert loaded.device.type == "cuda"
    assert {p.device.type for p in loaded.model.parameters()} == {"cuda"}


# -- pickle checkpoints: refused unless allowed ---------------------------------------------------------------


def _greedy(loaded, prompt: list[int]) -> list[int]:
    from common.engine.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.engine.sampling_params import SamplingParams

    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=16, max_model_len=64))
    [result] = engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    return result.token_ids


def test_a_pickle_checkpoint_is_refused_by_default_naming_its_files_and_the_flag(models, tmp_path):
    pickled = pickle_copy(models["fp32"], tmp_path / "pickled")
    with pytest.raises(ModelLoadError) as info:
        load_model(pickled)
    assert str(info.value) == (
        f"model directory {pickled} has only pickle checkpoints ['pytorch_model.bin']; pickle checkpoints are "
        "refused (unpickling can run code): convert them to safetensors, or pass --allow-pickle-weights "
        "(allow_pickle=True) for a checkpoint you trust")


def test_a_pickle_checkpoint_loads_with_allow_pickle_and_equals_the_safetensors_copy(models, tmp_path):
    pickled = pickle_copy(models["fp32"], tmp_path / "pickled")
    loaded = load_model(pickled, allow_pickle=True)
    reference = load_model(models["fp32"])
    ours, theirs = loaded.model.state_dict(), reference.model.state_dict()
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    prompt = reference.tokenizer.encode("The class statement defines")
    assert _greedy(loaded, prompt) == _greedy(reference, prompt)  # (engines repack the weights: compare first)
    assert load_model(models["fp32"], allow_pickle=True).fingerprint == reference.fingerprint  # no effect here


def test_pickle_weights_count_in_the_fingerprint_and_the_manifest(models, tmp_path):
    a = pickle_copy(models["fp32"], tmp_path / "a")
    b = pickle_copy(models["seed1"], tmp_path / "b")
    assert compute_fingerprint(a) != compute_fingerprint(b)  # same config, other weights
    assert load_model(a, allow_pickle=True).fingerprint == compute_fingerprint(a)
    manifest = write_manifest(a)
    assert manifest.read_text() == f"{sha256_file(a / 'pytorch_model.bin')}  pytorch_model.bin\n"
    assert verify_manifest(a) is True
    shutil.copy(a / "pytorch_model.bin", a / "extra.bin")
    with pytest.raises(ModelLoadError, match=r"weight files not in SHA256SUMS: \['extra.bin'\]"):
        verify_manifest(a)
    (a / "extra.bin").unlink()
    _flip_byte(a / "pytorch_model.bin", (a / "pytorch_model.bin").stat().st_size // 2)
    with pytest.raises(ModelLoadError, match="pytorch_model.bin: SHA-256 mismatch"):
        load_model(a, allow_pickle=True)


def test_pickle_files_beside_safetensors_are_ignored(models, tmp_path):
    both = _copy(models["fp32"], tmp_path / "both")
    (both / "pytorch_model.bin").write_bytes(b"never read")
    assert [p.name for p in weight_files(both)] == ["model.safetensors"]
    assert verify_manifest(both) is True
    assert load_model(both).fingerprint == compute_fingerprint(models["fp32"])


def test_torchao_import_noise_is_dropped_and_other_warnings_pass(caplog):
    import logging

    import common.engine  # noqa: F401 - the package installs the filters

    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/site-packages/torchao/_C_mxfp8.so: no CUDA")
        logging.getLogger("torch.utils._pytree").warning(
            "<enum 'KernelPreference'> ... Calling register_constant() on Enum subclasses is deprecated and will be")
        logging.getLogger("torchao").warning("int8 weight-only: layer skipped")
    assert [r.getMessage() for r in caplog.records] == ["int8 weight-only: layer skipped"]
