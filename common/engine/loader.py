"""Load a local Hugging Face causal-LM directory: checks, weights, tokenizer, identity.

``load_model(dir)`` is the one way pdserve turns a model directory into a :class:`LoadedModel`; the tiny
random checkpoints of ``common.models.tiny`` and real Llama / Qwen2 / Mistral checkpoints take the same path.
Nothing is downloaded. Weights are read from safetensors; a directory with only pickle checkpoints (``*.bin``,
``*.pt``, ...) is refused unless the caller passes ``allow_pickle=True`` (``--allow-pickle-weights``): unpickling
can run code. Transformers then reads ``pytorch_model.bin`` (or its shards) with ``torch.load(weights_only=True)``,
whose restricted unpickler narrows, but does not remove, that risk.

The weight files of a directory (:func:`weight_files`) are its ``*.safetensors`` when it has any (pickle files
beside them are never read), else its pickle checkpoints.

This module also owns the weight manifest: ``SHA256SUMS`` in the model directory, in ``sha256sum`` format
(``<64 hex>  <file name>`` per line; ``sha256sum -c SHA256SUMS`` checks it too). ``write_manifest`` writes it,
``verify_manifest`` checks it.

Fingerprint (``LoadedModel.fingerprint``, :func:`compute_fingerprint`): the SHA-256 of a versioned text made
of ``config.json`` in canonical form (parsed, re-serialised with sorted keys and no whitespace) and, per weight
file sorted by name (:func:`weight_files`, so pickle checkpoints count too), either its manifest digest or, when
there is no manifest, its name, size in bytes and the SHA-256 of its first and last MiB. Prefill and decode
workers compare fingerprints to check they run the same model; without a manifest it is a cheap identity, not an
integrity check.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from common.engine.quantization import check_method, quantize_model

if TYPE_CHECKING:
    from common.engine.tensor_parallel import TensorParallelGroup

MANIFEST_NAME = "SHA256SUMS"
CHUNK_BYTES = 1 << 20  # hashing reads 1 MiB at a time
_FINGERPRINT_VERSION = "pdserve-model-fingerprint-v1"
_MANIFEST_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


class ModelLoadError(ValueError):
    """A model directory cannot be loaded; the message names the path or value at fault."""


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, with everything the engine needs to know about it.

    ``model`` is in eval mode on ``device`` with ``requires_grad`` off. ``eos_token_ids`` is the union, in
    order, of ``generation_config.eos_token_id`` (int or list) and ``tokenizer.eos_token_id``.
    ``max_model_len`` is the config's ``max_position_embeddings``, else the tokenizer's ``model_max_length``.
    ``quantization``: the method applied to the linear layers (common/engine/quantization.py), "none" if none.
    ``tensor_parallel``: this process's group when the model is sharded over several (its linear layers then
    hold this rank's shard as DTensors; see common/engine/tensor_parallel.py), None on one process.
    """

    model: torch.nn.Module
    tokenizer: Any  # what AutoTokenizer returns for the directory
    config: Any  # transformers PretrainedConfig
    generation_config: Any | None  # transformers GenerationConfig; None without generation_config.json
    model_dir: Path
    dtype: torch.dtype
    device: torch.device
    fingerprint: str
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    quantization: str = "none"
    tensor_parallel: TensorParallelGroup | None = None


def load_model(model_dir: str | os.PathLike[str], *, dtype: str | torch.dtype | None = "auto",
               device: str | torch.device = "cpu", attn_implementation: str | None = None,
               verify: bool = True, allow_pickle: bool = False, quantization: str = "none",
               tensor_parallel: TensorParallelGroup | None = None) -> LoadedModel:
    """Load the causal LM in local directory ``model_dir`` offline.

    ``dtype``: see :func:`resolve_dtype` ("auto": the checkpoint's). ``verify``: check ``SHA256SUMS`` when
    present. ``allow_pickle``: load a directory whose only weights are pickle checkpoints (see the module
    docstring); without it such a directory is refused with a message naming its files and
    ``--allow-pickle-weights``. ``quantization``: a method of common/engine/quantization.py, applied once the
    model is on ``device``. ``tensor_parallel``: shard the model over this process group by transformers'
    tensor-parallel plan (every rank calls load_model alike; ``device`` is this rank's). Raises
    :class:`ModelLoadError` naming the path for a missing directory or
    ``config.json``, a model type that is not a causal LM, no weights, refused pickle weights, a manifest
    mismatch, an unavailable device, weights transformers cannot load, or attention heads that do not split
    evenly over ``tensor_parallel``; ``QuantizationError`` (a ValueError),
    before reading weights, for an unknown quantization method or one whose library is not installed.
    """
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    check_method(quantization)
    path = Path(model_dir).expanduser()
    raw_config = _check_directory(path)
    if tensor_parallel is not None:
        check_tensor_parallel_size(path, tensor_parallel.world_size, raw_config)
        if quantization != "none":
            raise ModelLoadError(f"quantization {quantization!r} is not supported with tensor parallelism")
    files = weight_files(path)
    pickled = not files[0].name.endswith(".safetensors")
    if pickled and not allow_pickle:
        names = [f.name for f in files]
        raise ModelLoadError(f"model directory {path} has only pickle checkpoints {names}; pickle checkpoints "
                             "are refused (unpickling can run code): convert them to safetensors, or pass "
                             "--allow-pickle-weights (allow_pickle=True) for a checkpoint you trust")
    if verify:
        verify_manifest(path)
    torch_device = _resolve_device(device)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        torch_dtype = resolve_dtype(dtype, config)
        extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
        sharding = contextlib.nullcontext()
        if tensor_parallel is not None:
            extra["distributed_config"] = tensor_parallel.distributed_config()
            sharding = tensor_parallel.loading()
        with sharding:
            model = AutoModelForCausalLM.from_pretrained(
                path, config=config, dtype=torch_dtype, local_files_only=True, use_safetensors=not pickled,
                weights_only=True, **extra
            )
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        generation_config = (GenerationConfig.from_pretrained(path, local_files_only=True)
                             if (path / "generation_config.json").is_file() else None)
    except ModelLoadError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as exc:
        raise ModelLoadError(f"cannot load model directory {path}: {exc}") from exc
    model = model.to(torch_device).eval()
    model.requires_grad_(False)
    quantize_model(model, quantization)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        generation_config=generation_config,
        model_dir=path,
        dtype=torch_dtype,
        device=torch_device,
        fingerprint=_fingerprint(path, raw_config),
        eos_token_ids=_eos_token_ids(generation_config, tokenizer),
        max_model_len=_max_model_len(config, tokenizer),
        quantization=quantization,
        tensor_parallel=tensor_parallel,
    )


def check_tensor_parallel_size(model_dir: str | os.PathLike[str], size: int,
                               raw_config: dict[str, Any] | None = None) -> None:
    """Raise ModelLoadError, naming the counts, unless ``size`` divides the query and KV heads of the model in
    ``model_dir`` (its ``config.json``, or ``raw_config`` when given; a ``text_config`` when there is one)."""
    raw = _check_directory(Path(model_dir)) if raw_config is None else raw_config
    text = raw.get("text_config") or raw
    num_heads = text.get("num_attention_heads")
    num_kv_heads = text.get("num_key_value_heads") or num_heads
    if not isinstance(size, int) or size < 1:
        raise ModelLoadError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if not isinstance(num_heads, int) or num_heads % size or num_kv_heads % size:
        raise ModelLoadError(f"model directory {model_dir}: tensor_parallel_size {size} must divide the number of "
                             f"attention heads ({num_heads}) and of KV heads ({num_kv_heads})")


def resolve_dtype(name: str | torch.dtype | None, config: Any = None) -> torch.dtype:
    """Map a dtype name ("float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16") or torch dtype to a dtype.

    "auto" or None: ``config.dtype`` (or the older ``torch_dtype``), float32 when unset or no config is given.
    Raises ModelLoadError naming any other value.
    """
    if name is None or name == "auto":
        declared = None if config is None else (getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
        if declared is None:
            return torch.float32
        try:
            return resolve_dtype(declared)
        except ModelLoadError:
            raise ModelLoadError(f"unsupported dtype {declared!r} declared by the model config") from None
    if isinstance(name, torch.dtype):
        if name in _DTYPES.values():
            return name
    elif isinstance(name, str) and name.lower() in _DTYPES:
        return _DTYPES[name.lower()]
    raise ModelLoadError(f"unsupported dtype {name!r}; expected auto, float32, bfloat16 or float16")


def verify_manifest(model_dir: str | os.PathLike[str]) -> bool:
    """Check every file listed in ``model_dir/SHA256SUMS`` against its SHA-256; False if there is no manifest.

    Also requires every weight file (:func:`weight_files`) in the directory to be listed (an unlisted weight
    file would load unchecked). Raises ModelLoadError naming the file, with expected and actual digests, on a
    mismatch; naming it on a missing or unlisted file or a malformed manifest line.
    """
    root = Path(model_dir)
    listed = read_manifest(root)
    if listed is None:
        return False
    for name, expected in listed.items():
        file = root / name
        if not file.is_file():
            raise ModelLoadError(f"{file}: listed in {root / MANIFEST_NAME} but missing")
        actual = sha256_file(file)
        if actual != expected:
            raise ModelLoadError(f"{file}: SHA-256 mismatch, manifest says {expected}, file has {actual}")
    unlisted = sorted(p.name for p in weight_files(root, required=False) if p.name not in listed)
    if unlisted:
        raise ModelLoadError(f"{root}: weight files not in {MANIFEST_NAME}: {unlisted}")
    return True


def read_manifest(model_dir: str | os.PathLike[str]) -> dict[str, str] | None:
    """``{file name: lowercase hex digest}`` from ``model_dir/SHA256SUMS``, or None when there is none."""
    manifest = Path(model_dir) / MANIFEST_NAME
    if not manifest.is_file():
        return None
    entries: dict[str, str] = {}
    for number, line in enumerate(manifest.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        match = _MANIFEST_LINE.match(line)
        if match is None:
            raise ModelLoadError(f"{manifest}:{number}: not a sha256sum line: {line!r}")
        digest, name = match.group(1).lower(), match.group(2)
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ModelLoadError(f"{manifest}:{number}: file name {name!r} leaves the model directory")
        entries[name] = digest
    return entries


def write_manifest(model_dir: str | os.PathLike[str]) -> Path:
    """Write ``model_dir/SHA256SUMS`` covering every weight file (:func:`weight_files`, sorted by name); return
    its path."""
    root = Path(model_dir)
    lines = [f"{sha256_file(path)}  {path.name}\n" for path in weight_files(root, required=False)]
    manifest = root / MANIFEST_NAME
    manifest.write_text("".join(lines), encoding="utf-8")
    return manifest


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def compute_fingerprint(model_dir: str | os.PathLike[str]) -> str:
    """The model identity described in the module docstring, without loading the model."""
    path = Path(model_dir)
    return _fingerprint(path, _check_directory(path))


def _check_directory(path: Path) -> dict[str, Any]:
    """Return the parsed config.json after checking the directory holds a causal LM."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist or is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"model directory {path} has no config.json")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{config_file} is not valid JSON: {exc}") from exc
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(f"model directory {path}: model_type {model_type!r} is not a causal LM")
    # Encoder families (bert, roberta, bart, ...) have a causal head too, usable only when built as a decoder.
    if raw.get("is_encoder_decoder") or (model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
                                         and not raw.get("is_decoder")):
        raise ModelLoadError(f"model directory {path}: model_type {model_type!r} is not a causal LM "
                             "(an encoder or encoder-decoder configuration)")
    architectures = raw.get("architectures") or []
    causal_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if architectures and not any(name in causal_classes or name.endswith(("ForCausalLM", "LMHeadModel"))
                                 for name in architectures):
        raise ModelLoadError(f"model directory {path}: architectures {architectures} include no causal LM")
    return raw


def weight_files(model_dir: str | os.PathLike[str], *, required: bool = True) -> list[Path]:
    """The weight files of ``model_dir``, sorted by name: its ``*.safetensors`` if it has any, else its pickle
    checkpoints (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``). None at all: ModelLoadError naming the directory,
    or ``[]`` when not ``required``. Says nothing about whether pickle files may be loaded (see load_model)."""
    path = Path(model_dir)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        files = sorted(p for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES and p.is_file())
    if not files and required:
        raise ModelLoadError(f"model directory {path} has no weight files (*.safetensors)")
    return files


def _resolve_device(device: str | torch.device) -> torch.device:
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"invalid device {device!r}: {exc}") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ModelLoadError(f"device {device!r} requested but only {torch.cuda.device_count()} "
                                 "CUDA devices exist")
    elif resolved.type != "cpu":
        raise ModelLoadError(f"unsupported device {device!r}; expected cpu, cuda or cuda:N")
    return resolved


def _fingerprint(path: Path, raw_config: dict[str, Any]) -> str:
    parts = [_FINGERPRINT_VERSION, json.dumps(raw_config, sort_keys=True, separators=(",", ":"))]
    listed = read_manifest(path)
    if listed is not None:
        parts += [f"{name} sha256={digest}" for name, digest in sorted(listed.items())]
    else:
        for file in weight_files(path, required=False):
            size_bytes = file.stat().st_size
            with file.open("rb") as f:
                head = f.read(CHUNK_BYTES)
                f.seek(max(size_bytes - CHUNK_BYTES, 0))
                tail = f.read(CHUNK_BYTES)
            parts.append(f"{file.name} size={size_bytes} head={hashlib.sha256(head).hexdigest()} "
                         f"tail={hashlib.sha256(tail).hexdigest()}")
    return hashlib.sha256("\n".join(parts).encode("utf-8")).hexdigest()


def _eos_token_ids(generation_config: Any | None, tokenizer: Any) -> tuple[int, ...]:
    candidates: list[int] = []
    declared = None if generation_config is None else generation_config.eos_token_id
    if isinstance(declared, int):
        candidates.append(declared)
    elif declared is not None:
        candidates.extend(int(i) for i in declared)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        candidates.append(int(tokenizer.eos_token_id))
    return tuple(dict.fromkeys(candidates))


def _max_model_len(config: Any, tokenizer: Any) -> int:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    declared = getattr(text_config, "max_position_embeddings", None)
    if declared is None:
        declared = getattr(tokenizer, "model_max_length", None)
    if declared is None:
        raise ModelLoadError("neither the config's max_position_embeddings nor the tokenizer's "
                             "model_max_length is set")
    return int(declared)
