"""int8 quantization of a loaded model's linear layers, through torchao (the ``quant`` extra).

Methods (:data:`QUANTIZATION_METHODS`, the values of ``--quantization``):

- ``none``: the model is left as loaded.
- ``int8-weight-only``: torchao's ``Int8WeightOnlyConfig``: each weight row (output feature) becomes int8 with
  one scale (symmetric, per row); activations, the KV cache and the logits stay in the model's dtype. Weights take
  ~1/4 of their fp32 bytes (~1/2 of bf16). torchao's eager product casts the int8 weight to the activation dtype
  at every call and scales the result. On the CPU the engine then takes the int8 layers into its own layout
  (:class:`~common.engine.cpu_linear.PackedLinear`, ``int8_rows``: fused q|k|v and gate|up, the engine's fused
  modules), where the engine's own bf16 and fp32 kernels read the int8 values directly, widening them in
  registers (without those kernels: ATen's int8 weight-only kernel for bf16 products of a few rows, torchao's
  form otherwise). On a 2-core Zen 4 VM a bf16 stream decodes 1.2-1.6x faster than bf16 itself, 16 streams at
  bf16's speed; an fp32 stream 2-2.9x faster than fp32, 16 streams 1.0-1.2x (docs/benchmarks.md, session 32).
- ``int8-dynamic``: torchao's ``Int8DynamicActivationInt8WeightConfig`` (W8A8): the weights as above, and at each
  product every input row (token) quantized to int8 with its own symmetric scale, the product computed in int32
  and scaled back to the model's dtype. The KV cache and the logits stay in the model's dtype. Each token's
  result depends on its own row alone, so a request's output does not change with the batch it runs in. On the
  CPU the engine takes these layers into its layout ``int8_dynamic`` (``torch._int_mm``, oneDNN's int8 GEMM:
  VNNI or AMX), where the products of batches and of prompts run faster than in full precision; activations
  rounded to 8 bits cost agreement with the full-precision model beyond what weight-only int8 costs
  (docs/benchmarks.md).

What is quantized: every ``nn.Linear`` whose weight belongs to it alone: the attention and MLP projections,
and the LM head when it is not tied. A weight shared with another module (an LM head tied to the input
embeddings) stays as it is: the embedding lookup needs the full-precision matrix, so an int8 copy would add
memory and break the tie. On build/llama-60m (untied, fp32), quantizing its LM head too took the weights from
148 MiB to 101 MiB and teacher-forced greedy agreement with fp32 from 85.0% to 84.6% (512 positions).
``int8-weight-only`` quantizes a MoE model's experts too (most of its weights: transformers keeps them as 3-D
parameters, not ``nn.Linear``): each expert's rows as torchao quantizes a linear layer's, computed as torchao
computes one (:class:`~common.engine.moe.Int8Experts`, transformers' default experts and GPT-OSS's; the engine's
kernels run them packed, :class:`~common.engine.moe.PackedExperts`). Experts of another arithmetic stay in full
precision, as do every model's experts under ``int8-dynamic``.

Memory: the replaced full-precision weights are freed. Safetensors memory-maps the checkpoint, and one tensor
left on that map (the embeddings) keeps the whole file mapped, with the pages of the replaced weights resident:
so the CPU tensors left in full precision are copied into ordinary memory and the map is dropped. Then glibc is
asked to return the freed heap pages (``malloc_trim``): quantizing frees many blocks below its mmap threshold
(32 MiB in a worker, common/malloc.py), which it would otherwise keep (measured: 52 MiB of the 60M model in
bf16).

torch and torchao are imported on first use: the CLI reads :data:`QUANTIZATION_METHODS` without them.
"""

from __future__ import annotations

import ctypes
import logging
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("none", "int8-weight-only", "int8-dynamic")
_INSTALL_HINT = "pip install 'pdserve[quant]'"


class QuantizationError(ValueError):
    """An unknown quantization method, or a method whose library is not installed; the message says which."""


def check_method(method: str) -> None:
    """Raise :class:`QuantizationError` unless ``method`` is one of :data:`QUANTIZATION_METHODS` and, when it
    quantizes, torchao imports (the message then names ``pip install 'pdserve[quant]'``)."""
    if method not in QUANTIZATION_METHODS:
        raise QuantizationError(f"unknown quantization method {method!r}; expected one of {list(QUANTIZATION_METHODS)}")
    if method != "none":
        _torchao(method)


def quantize_model(model: torch.nn.Module, method: str) -> list[str]:
    """Quantize the linear layers of ``model`` in place with ``method`` (see the module docstring); returns the
    qualified names of the layers quantized, in module order, then those of the experts modules quantized (``[]``
    for ``none``).

    The model must already be on its device. A layer already quantized by torchao is left alone. Raises
    :class:`QuantizationError` as :func:`check_method` does, and naming the layer for a weight of another tensor
    type (a tensor-parallel DTensor shard), rather than quietly leaving it in full precision.
    """
    import torch

    check_method(method)
    if method == "none":
        return []
    quantize_, config, TorchAOBaseTensor = _torchao(method)
    owners = Counter(id(p) for module in model.modules() for p in module.parameters(recurse=False))
    targets, kept = [], []
    for name, module in model.named_modules():
        weight = module.weight.data if isinstance(module, torch.nn.Linear) else None
        if weight is None or isinstance(weight, TorchAOBaseTensor):
            continue
        if type(weight) is not torch.Tensor:
            raise QuantizationError(f"cannot quantize layer {name}: its weight is a {type(weight).__name__}")
        (targets if owners[id(module.weight)] == 1 else kept).append(name)
    before_bytes = weight_bytes(model)
    selected = set(targets)
    quantize_(model, config, filter_fn=lambda _m, fqn: fqn in selected)
    experts, kept_experts = [], []
    if method == "int8-weight-only":  # a MoE model's experts: most of its weights (see the module doc)
        from common.engine.moe import quantize_experts

        experts, kept_experts = quantize_experts(model)
    for param in model.parameters():
        if param.device.type == "cpu" and type(param.data) is torch.Tensor:
            param.data = param.data.clone()  # off the checkpoint's mmap (module docstring); ties keep the Parameter
    if next(model.parameters()).device.type == "cpu":
        trim_heap()
    log.info("%s: %d linear layers quantized, weights %.1f MiB -> %.1f MiB; kept (weight shared): %s",
             method, len(targets), before_bytes / 2**20, weight_bytes(model) / 2**20, kept or "none")
    if experts or kept_experts:
        log.info("%s: %d experts modules quantized; kept in full precision (another arithmetic): %s",
                 method, len(experts), kept_experts or "none")
    return targets + experts


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the parameters and buffers of ``model`` (a shared one once: ``parameters()`` deduplicates);
    a tensor subclass (a torchao quantized weight) counts the tensors it holds (int8 data, scales)."""
    return sum(_tensor_bytes(t) for t in (*model.parameters(), *model.buffers()))


def _tensor_bytes(t: torch.Tensor) -> int:
    if hasattr(t, "__tensor_flatten__"):  # a wrapper subclass: its own storage is empty
        inner_names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(inner) for n in inner_names if (inner := getattr(t, n)) is not None)
    return t.nbytes


def trim_heap() -> None:
    """Give the free pages of glibc's heap back to the kernel (a no-op elsewhere)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _torchao(method: str):
    """``(quantize_, config, TorchAOBaseTensor)`` of torchao for ``method``, imported on first use."""
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_
        from torchao.utils import TorchAOBaseTensor
    except ImportError as exc:
        raise QuantizationError(f"quantization {method!r} needs torchao, which is not installed ({exc}): "
                                f"{_INSTALL_HINT}") from exc
    # set_inductor_config=False: pdserve does not compile, and torchao would change torch._inductor's global config;
    # the dynamic config's defaults: a symmetric scale per weight row and per input row (PerRow), full int8 range
    config = (Int8DynamicActivationInt8WeightConfig if method == "int8-dynamic" else Int8WeightOnlyConfig)
    return quantize_, config(set_inductor_config=False), TorchAOBaseTensor

