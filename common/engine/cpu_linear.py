"""Faster linear layers on the CPU: pre-packed weights for oneDNN's matmuls or the engine's own kernels.

Stock ``nn.Linear`` on the CPU goes through MKL's sgemm with a transposed weight, which is slow for the
small batches of decoding: measured here (2 cores, fp32), a 16-row matmul with the 32000x512 LM head took
~17 ms through ``F.linear`` and ~4 ms through oneDNN with a packed weight, and the 1408x512 MLP projections
~1.8x faster. Results differ from ``F.linear`` only by summation order (~1e-6 relative).

:func:`pack_linear_layers` swaps every ``nn.Linear`` of a model for a :class:`PackedLinear` in place. The
model is the engine's own: the swap keeps ``weight`` (packed) and ``bias`` as attributes, so code that reads
``module.weight.dtype`` or ``.shape`` still works, but the packed tensor is meant for oneDNN only.

Before packing, sibling projections that read the same input (``q_proj``/``k_proj``/``v_proj`` of an
attention block, ``gate_proj``/``up_proj`` of a gated MLP) are fused into one packed matmul
(:class:`FusedLinear`): the model's own forward still calls each projection, the first call computes all of
them and the others take their column slice. One wide matmul streams the weights faster than three narrow
ones at decode batch sizes (measured here, 60M model, 8 layers at one token: 5.7 ms → 4.5 ms per step).

:func:`fuse_rms_norms` swaps Llama-style RMSNorm modules (``weight * x / rms(x)``, computed in fp32) for one
call each: the engine's C++ kernel where it is built (:mod:`common.engine.cpu_kernels`), else one fused
``F.rms_norm`` (~25 µs → ~16 µs per call at one token, 17 calls a step on that model).
"""

from __future__ import annotations

import logging

import torch

from common.engine import cpu_kernels
from common.engine.module_match import same_forward

log = logging.getLogger(__name__)

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# An int8 layer's product (the ``int8_rows`` layout of PackedLinear) where the engine's kernels are not built: bf16
# inputs of up to this many rows by ATen's int8 weight-only kernel (``torch._weight_int8pack_mm``), more rows as
# torchao computes them (the weight widened to bf16, one matmul); fp32 inputs by oneDNN's matmul over the widened
# weight. (With the kernels: the engine's bf16 and fp32 kernels over the int8 values, PackedLinear.pairs/blocked;
# on AMX CPUs bf16 products of more than this many rows take torchao's form.) Measured in the engine on a Zen 4 VM
# (2 threads), decode steps against torchao's form: 0.35B bf16, 1 stream ~3.5x (11-13 -> 38-44 tokens/s), 8
# streams 78 vs 105 ms, 16: 117 vs 134, 32: 256 vs 170 (oneDNN there: 201; a 512-token prefill 911 vs 923 ms, no
# gain); 60M fp32 by oneDNN, 1 stream 30 vs 37 ms, 16: 40 vs 55, 64: 84 vs 118, a 512-token prefill 207 vs 239 ms.
INT8_PACK_ROWS = 16
# torchao's floor for a dynamic activation scale (choose_qparams_affine's eps: fp32's, whatever the input dtype)
_INT8_EPS = torch.finfo(torch.float32).eps


# sibling projections of one block that read the same input, in the order the models call them
_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# RMSNorm classes computing weight * (x / sqrt(mean(x^2) + eps)) in fp32 (Gemma's 1 + weight is not one), and
# every class whose forward repeats theirs (module_match.py: Qwen3-MoE's, Mixtral's, Granite's ...)
_LLAMA_STYLE_NORMS = ("llama.LlamaRMSNorm", "qwen2.Qwen2RMSNorm", "qwen3.Qwen3RMSNorm", "mistral.MistralRMSNorm")
# MLPs computing down_proj(act_fn(gate_proj(x)) * up_proj(x)) (and their copies: Gemma's too)
_GATED_MLPS = ("llama.LlamaMLP", "qwen2.Qwen2MLP", "qwen3.Qwen3MLP", "mistral.MistralMLP")
# MLPs computing down_proj(up * act_fn(gate)) from one gate|up layer (gate columns first)
_GATE_UP_MLPS = ("phi3.Phi3MLP",)
# Gemma's RMSNorm: x / rms(x) * (1 + weight), in fp32, rounded once (Gemma 2's, Gemma 3's: copies)
_GEMMA_STYLE_NORMS = ("gemma.GemmaRMSNorm",)
# RMSNorms computing x / rms(x) * weight in fp32, rounded once (Llama's rounds x / rms(x) first): GPT-OSS's, OLMo 2's
# (and copies: OLMoE's ...)
_WEIGHTED_NORMS = ("gpt_oss.GptOssRMSNorm", "olmo2.Olmo2RMSNorm")
# the activations of a gated MLP the engine's kernels compute (torch.ops.pdserve.<op>), by transformers' class name
_ACT_MUL = {"SiLUActivation": "silu_mul", "SiLU": "silu_mul", "GELUTanh": "gelu_tanh_mul"}


class PackedLinear(torch.nn.Module):
    """A linear layer over a pre-packed weight, in one of six layouts (``layout``), chosen once at packing:

    - ``"bf16_pairs"``: a bf16 weight on an x86 CPU without AMX, with ``kernel``: the engine's pair packing for
      ``torch.ops.pdserve.bf16_linear``. With AVX512-BF16 faster than oneDNN at one row and as fast at 16 to 512
      (a Zen 4 VM); with AVX2 alone, where oneDNN packs no bf16 and torch's bf16 matmul is a scalar loop, the
      only fast path (common/engine/csrc/bf16_linear.cpp).
    - ``"bf16_amx"``: a bf16 weight on a CPU with AMX, with ``kernel``: the same pair packing, whose 16-pair runs
      are AMX's B tiles, for ``torch.ops.pdserve.bf16_linear_amx`` (common/engine/csrc/bf16_amx.cpp): on a Xeon
      the 0.35B bf16 engine 1.12-1.16x at 16 streams, 1.30x single-stream, prefill unchanged.
    - ``"fp32_blocks"``: an fp32 weight on an x86 CPU with AVX2 and FMA, with ``kernel``: blocks of 16 features
      for ``torch.ops.pdserve.fp32_linear``, 1.4-1.65x oneDNN at the 1-16 rows of decoding on AVX2 alone, and
      with AVX-512 (a Xeon) the 60M engine 1.25x at 16 streams, 1.32x single-stream and 1.09x on a 2,048-token
      prefill (common/engine/csrc/fp32_linear.cpp).
    - ``"onednn"``: oneDNN's own packing for its matmul (every other case, and bf16 weights on AMX CPUs of an
      engine that packs for ``prefill``: oneDNN's AMX GEMM runs batches of prompt tokens from its own layout,
      where the pair layout must be widened for it a slice at a time; a 2,048-token prefill of the 0.35B bf16
      model 8% faster, 16 prompts of 128 tokens 10% faster, the decode steps 10-30% slower).
    - ``"int8_rows"``: a weight torchao quantized to int8 with one scale per output feature
      (``--quantization int8-weight-only``, common/engine/quantization.py), kept as its int8 values and scales:
      bf16 products by the engine's ``bf16_linear`` where it was built (``pairs``: the int8 values in its pair
      layout, widened in registers; on AMX CPUs only up to :data:`INT8_PACK_ROWS` rows, torchao's form above),
      else up to :data:`INT8_PACK_ROWS` rows by ``torch._weight_int8pack_mm`` and larger ones as torchao
      computes them; fp32 ones by the engine's fp32 kernel where it was built (``blocked``: the int8 values kept
      in its 16-feature blocks and widened in registers, :func:`_blocked_product`), else by oneDNN over the
      weight widened a tile at a time at each call. As PackedLinears an
      int8 model's projections fuse as a full-precision model's do (q|k|v, gate|up: per-row scales concatenate
      exactly), and its layers run in the engine's fused modules and flat layer loop.
    - ``"int8_dynamic"``: the same int8 weight with dynamic per-token quantization of the inputs
      (``--quantization int8-dynamic``, W8A8): each input row rounded to int8 on its own scale, the products
      summed in int32 and scaled back as torchao does, bit for bit. The sums come from oneDNN's quantized linear
      over its own packing of the weight (``sums == "onednn_u8"``, where it computes them exactly:
      :func:`_onednn_u8s8`), else from an fp32 product over the int8 values widened (``"float"``: exact in
      chunks of :data:`FLOAT_EXACT_K` inputs, :func:`_float_sums`; ``blocked`` as in ``int8_rows``), else from
      ``torch._int_mm``. Fuses as
      ``int8_rows`` does.

    ``dtype`` is the dtype of the layer's inputs and outputs (``weight`` is int8 in the int8 layouts: [out, in],
    [out / 16 rounded up, in, 16] where ``blocked``, or [out / 16 (rounded up to 32 features), in / 2, 16, 2] where
    ``pairs``).
    """

    def __init__(self, linear: torch.nn.Linear, kernel: bool = False, prefill: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.dtype = linear.weight.dtype
        int8 = _int8_layout(linear)
        if int8 is not None:
            self._set_int8(int8, [linear], kernel)
            return
        weight = linear.weight.detach()
        self.layout = _own_layout(weight, prefill) if kernel else "onednn"
        if self.layout in ("bf16_pairs", "bf16_amx"):
            packed = torch.ops.pdserve.pack_bf16_pairs(weight)
        elif self.layout == "fp32_blocks":
            packed = torch.ops.pdserve.pack_fp32_blocks(weight)
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.weight = torch.nn.Parameter(packed, requires_grad=False)
        bias = None if linear.bias is None else linear.bias.detach()
        if bias is not None and self.layout in ("bf16_pairs", "bf16_amx"):  # the kernels add it in float: convert once
            bias = bias.float()
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def _set_int8(self, layout: str, linears: list[torch.nn.Linear], kernel: bool = False) -> None:
        """Take the int8 values, scales and biases of ``linears`` (torchao's, one layout), side by side. ``kernel``:
        products in fp32 arrange the values in the 16-feature blocks of ``torch.ops.pdserve.fp32_linear``
        (``blocked``), where that kernel was built."""
        self.layout = layout
        qdata = torch.cat([m.weight.qdata.detach() for m in linears]).contiguous()
        fp32_kernel = kernel and qdata.device.type == "cpu" and torch.ops.pdserve.fp32_linear_supported()
        scale = torch.cat([m.weight.scale.detach().reshape(-1) for m in linears])
        self.out_features = qdata.shape[0]
        # weight-only: torchao scales in the activation dtype; dynamic: in its own (fp32), as it multiplies
        self.register_buffer("scale", (scale.to(self.dtype) if layout == "int8_rows" else scale).contiguous())
        bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
        if bias is not None and layout == "int8_dynamic":  # added to fp32 sums: converted once, not at every call
            bias = bias.float()
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        packed = _onednn_u8s8(qdata) if layout == "int8_dynamic" else None
        self.sums = None  # where an int8_dynamic layer's int32 sums come from
        # an int8_dynamic layer's rows quantized and its sums scaled back by the engine's kernels (quantize.cpp)
        self.ends = (kernel and layout == "int8_dynamic" and qdata.device.type == "cpu"
                     and self.dtype in _PACKABLE_DTYPES)  # fmt: skip
        if layout == "int8_dynamic":
            exact = packed is None and _float_sums_exact(qdata, fp32_kernel)
            self.sums = "onednn_u8" if packed is not None else "float" if exact else "int_mm"
        self.blocked = fp32_kernel and (self.sums == "float" or layout == "int8_rows" and self.dtype == torch.float32)
        # bf16 products of a weight-only layer by the engine's bf16 kernel over the int8 values in its pairs
        self.pairs = (kernel and layout == "int8_rows" and self.dtype == torch.bfloat16 and qdata.device.type == "cpu"
                      and qdata.shape[1] % 2 == 0 and torch.ops.pdserve.bf16_linear_supported())  # fmt: skip
        # rows from which torchao's form runs instead (oneDNN's AMX GEMM over the widened weight beats vdpbf16ps)
        self.pair_rows = INT8_PACK_ROWS if "amx_bf16" in cpu_kernels.cpu_flags() else None
        if self.blocked:
            qdata = _int8_blocks(qdata)
        elif self.pairs:
            qdata = _int8_pairs(qdata)
        elif packed is not None:  # oneDNN's own layout of the weight for its u8s8 product
            qdata = packed
            self.register_buffer("_ones", torch.ones(self.out_features))
            self.register_buffer("_zeros", torch.zeros(self.out_features, dtype=torch.int32))
        self.weight = torch.nn.Parameter(qdata, requires_grad=False)

    @property
    def own(self) -> bool:
        """Whether the engine's own kernel runs this layer (not oneDNN)."""
        return self.layout != "onednn"

    @classmethod
    def concatenated(cls, linears: list[torch.nn.Linear], kernel: bool = False, prefill: bool = False) -> PackedLinear:
        """One packed layer whose output is the outputs of ``linears`` side by side."""
        int8 = _shared_int8_layout(linears)
        if int8 is not None:  # per-row scales concatenate exactly
            fused = cls.__new__(cls)
            torch.nn.Module.__init__(fused)
            fused.in_features, fused.dtype = linears[0].in_features, linears[0].weight.dtype
            fused._set_int8(int8, linears, kernel)
            return fused
        cat = torch.nn.Linear(linears[0].in_features, sum(m.out_features for m in linears),
                              bias=linears[0].bias is not None, device="meta")  # fmt: skip
        cat.weight = torch.nn.Parameter(torch.cat([m.weight.detach() for m in linears]), requires_grad=False)
        if cat.bias is not None:
            cat.bias = torch.nn.Parameter(torch.cat([m.bias.detach() for m in linears]), requires_grad=False)
        return cls(cat, kernel=kernel, prefill=prefill)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the kernels refuse any other input dtype, as F.linear would with that weight
        if self.layout == "bf16_pairs":
            return torch.ops.pdserve.bf16_linear(x, self.weight, self.bias, self.out_features)
        if self.layout == "bf16_amx":
            return torch.ops.pdserve.bf16_linear_amx(x, self.weight, self.bias, self.out_features)
        if self.layout == "fp32_blocks":
            return torch.ops.pdserve.fp32_linear(x, self.weight, self.bias, self.out_features)
        if self.layout == "int8_rows":
            return self._int8_forward(x)
        if self.layout == "int8_dynamic":
            return self._int8_dynamic_forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [None], "")

    def _int8_forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if x.dtype == torch.float32:
            y = _fp32_product(rows.contiguous(), self.weight, self.out_features, self.in_features, self.blocked)
            y.mul_(self.scale)
        elif self.pairs and (self.pair_rows is None or rows.shape[0] <= self.pair_rows):
            y = torch.ops.pdserve.bf16_linear(rows, self.weight, None, self.out_features).mul_(self.scale)
        elif self.pairs:  # torchao's form over the values taken back out of their pairs
            plain = self.weight.permute(0, 2, 1, 3).reshape(-1, self.in_features)[: self.out_features]
            y = torch.mm(rows, plain.t().to(x.dtype)) * self.scale
        elif rows.shape[0] <= INT8_PACK_ROWS:
            y = torch._weight_int8pack_mm(rows.contiguous(), self.weight, self.scale)
        else:  # torchao's weight-only product (torchao/quantization/quantize_/workflows/int8/int8_tensor.py)
            y = torch.mm(rows, self.weight.t().to(x.dtype)) * self.scale
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def _int8_dynamic_forward(self, x: torch.Tensor) -> torch.Tensor:
        # torchao's product for Int8DynamicActivationInt8WeightConfig, op for op where rounding happens (its
        # choose_qparams_affine / quantize_affine of each row, then int_scaled_matmul; tests compare bit for bit).
        # The int32 sums are exact whichever int8 GEMM computes them. Rows: one token each, quantized on its own.
        rows = x.reshape(-1, self.in_features)
        if self.ends:  # the same steps, one pass each (at one row, torchao's dozen ops cost more than the GEMM)
            q, x_scale = torch.ops.pdserve.quantize_rows(rows, self.sums == "onednn_u8")
            if self.sums == "onednn_u8":
                sums = _qlinear_sums(q, self.weight, self._ones, self._zeros)
            elif self.sums == "float":
                sums = _float_sums(q, self.weight, self.out_features, self.blocked)
            else:
                sums = torch._int_mm(q, self.weight.t()).float()
            y = torch.ops.pdserve.dequantize_sums(sums, x_scale, self.scale, self.bias, x.dtype == torch.bfloat16)
            return y.reshape(*x.shape[:-1], self.out_features)
        x_scale = (rows.abs().amax(dim=1, keepdim=True) / 127.5).clamp(min=_INT8_EPS).float()
        q = torch.round(rows * (1.0 / x_scale)).clamp_(-128, 127).to(torch.int8)
        if self.sums == "onednn_u8":  # q + 128 as uint8 (a flip of the sign bit) against a zero point of 128
            y = _qlinear_sums(q.view(torch.uint8).bitwise_xor_(128), self.weight, self._ones, self._zeros)
            y.mul_(x_scale)
        elif self.sums == "float":
            y = _float_sums(q, self.weight, self.out_features, self.blocked).mul_(x_scale)
        else:
            y = torch._int_mm(q, self.weight.t()) * x_scale  # int32 * fp32: fp32
        if x.dtype != torch.float32:
            y.copy_(y.to(x.dtype))  # torchao rounds to the input dtype before the weight scale (in fp32)
        y.mul_(self.scale)
        if self.bias is not None:
            y.add_(self.bias)
        # in place throughout: fresh (M, N) buffers cost more than the arithmetic at prompt sizes
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"layout={self.layout}")  # fmt: skip


def _own_layout(weight: torch.Tensor, prefill: bool = False) -> str:
    """The layout of a weight when the engine's kernels are loaded. bf16: the pair packing, run by AMX tiles on
    CPUs with AMX (where ``vdpbf16ps`` ran at half oneDNN's AMX speed from 16 rows) when the kernel was built
    with AMX and the input size is a multiple of 32, else oneDNN there; oneDNN's on AMX CPUs for an engine that
    packs for ``prefill`` (a prefill worker). fp32: the 16-feature blocks wherever the kernel was built (AVX2 and
    FMA; wider tiles and a GEMM hand-off for prefill with AVX-512)."""
    flags = cpu_kernels.cpu_flags()
    if weight.device.type != "cpu":
        return "onednn"
    if weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0:
        if "amx_bf16" in flags:
            if prefill:
                return "onednn"
            amx = weight.shape[1] % 32 == 0 and torch.ops.pdserve.bf16_amx_supported()
            return "bf16_amx" if amx else "onednn"
        if torch.ops.pdserve.bf16_linear_supported():
            return "bf16_pairs"
    if weight.dtype == torch.float32 and torch.ops.pdserve.fp32_linear_supported():
        return "fp32_blocks"
    return "onednn"


class FusedLinear(torch.nn.Module):
    """Sibling linear layers as one packed matmul; the model calls them through their :class:`LinearSlice`.

    The output of the last input is kept until every part has been served once (or a new input arrives),
    so each forward pass computes the product once and holds it no longer than the block runs.
    """

    def __init__(self, linears: list[torch.nn.Linear], kernel: bool = False, prefill: bool = False) -> None:
        super().__init__()
        self.linear = PackedLinear.concatenated(linears, kernel=kernel, prefill=prefill)
        ends = torch.tensor([m.out_features for m in linears]).cumsum(0).tolist()
        self.bounds = list(zip([0, *ends[:-1]], ends))
        # [input, its product, parts not yet served]: a plain list, as nn.Module.__setattr__ costs ~2 µs a field
        self._last: list = [None, None, 0]

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        last = self._last
        if x is not last[0]:
            last[0], last[1], last[2] = x, self.linear(x), len(self.bounds)
        lo, hi = self.bounds[index]
        out = last[1][..., lo:hi]
        last[2] -= 1
        if last[2] == 0:
            last[0] = last[1] = None
        return out


class LinearSlice(torch.nn.Module):
    """Stands where one of a :class:`FusedLinear`'s layers stood: its output columns of the fused product."""

    def __init__(self, fused: FusedLinear, index: int, linear: torch.nn.Linear) -> None:
        super().__init__()
        self._fused = (fused,)  # not a submodule: the parent registers the fused layer once
        self.index = index
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused[0].part(self.index, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, part={self.index}"


class FusedRMSNorm(torch.nn.Module):
    """A Llama-style RMSNorm as one call: the engine's C++ kernel (``torch.ops.pdserve.rms_norm``, one pass per
    row) when ``kernel`` is set, else one ``F.rms_norm`` (fp32 math; bf16 in and out like the original)."""

    def __init__(self, norm: torch.nn.Module, kernel: bool = False) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = float(norm.variance_epsilon)
        self.kernel = kernel and norm.weight.dtype in _PACKABLE_DTYPES and norm.weight.device.type == "cpu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel and x.dtype == self.weight.dtype:
            return torch.ops.pdserve.rms_norm(x, self.weight, self.eps)
        shape = (x.shape[-1],)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return torch.nn.functional.rms_norm(x, shape, self.weight, self.eps)
        return self.weight * torch.nn.functional.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + residual, forward(x + residual))``, bit for bit. With the kernel, one call that adds into ``x``
        in place (``torch.ops.pdserve.add_rms_norm_``): the caller must own ``x`` (a decoder layer's hidden state,
        which no one else holds)."""
        if (self.kernel and x.dtype == self.weight.dtype and residual.dtype == x.dtype and x.is_contiguous()
                and residual.shape == x.shape):  # fmt: skip
            return x, torch.ops.pdserve.add_rms_norm_(x, residual, self.weight, self.eps)
        x = x + residual
        return x, self.forward(x)


class FusedScaledRMSNorm(torch.nn.Module):
    """Gemma's RMSNorm (``x / rms(x) * (1 + weight)``, in fp32, rounded once) as one call of the engine's kernel
    (``torch.ops.pdserve.rms_norm_scaled``), 1 + weight computed once; ``offset=0``: GPT-OSS's and OLMo 2's
    (``x / rms(x) * weight``, the same roundings)."""

    def __init__(self, norm: torch.nn.Module, offset: float = 1.0) -> None:
        super().__init__()
        self.register_buffer("scale", (offset + norm.weight.detach().float()).contiguous())
        self.eps = float(norm.eps if offset else norm.variance_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.pdserve.rms_norm_scaled(x, self.scale, self.eps)


class FusedGatedMLP(torch.nn.Module):
    """A gated MLP (``down(act(gate(x)) * up(x))``, Llama/Qwen/Mistral with SiLU, Gemma with GeLU's tanh
    approximation; Phi-3's ``up * silu(gate)`` over its checkpoint's own gate|up projection) over its fused gate/up
    product, the activation one call of the engine's kernel (``torch.ops.pdserve.silu_mul``, ``gelu_tanh_mul``)
    instead of an activation and a multiply over two column slices. A prefill worker's oneDNN layers keep gate and
    up apart (``gate``, ``up``; see :func:`_keep_apart`): the kernel then reads the two products
    (``silu_mul_parts``, SiLU only)."""

    def __init__(self, gate_up: FusedLinear | PackedLinear | None, down_proj: torch.nn.Module,
                 gate: PackedLinear | None = None, up: PackedLinear | None = None,
                 act_mul: str = "silu_mul") -> None:  # fmt: skip
        super().__init__()
        self.gate_up = gate_up
        # the layer computing gate|up (not a submodule: gate_up registers it) and the activation's kernel
        self._product = (gate_up.linear if isinstance(gate_up, FusedLinear) else gate_up,)
        self._act_mul = (getattr(torch.ops.pdserve, act_mul),)
        self.gate, self.up = gate, up
        self.down_proj = down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(torch.ops.pdserve.silu_mul_parts(self.gate(x), self.up(x)))
        return self.down_proj(self._act_mul[0](self._product[0](x)))


def fuse_gated_mlps(model: torch.nn.Module) -> int:
    """Replace each gated MLP (SiLU or GeLU-tanh) whose gate and up projections were fused
    (:func:`pack_linear_layers`, or one layer in the checkpoint: Phi-3) by a :class:`FusedGatedMLP` whose output
    matches it on a random input; returns how many. Needs the engine's CPU kernels (the caller checked that they
    loaded)."""
    done = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            fused = _gated_mlp(child)
            if fused is None:
                continue
            product = fused._product[0] or fused.gate
            x = torch.randn(3, product.in_features, dtype=product.dtype)
            done += _swap_if_equal(parent, name, child, fused, x, tol=1e-4 if x.dtype == torch.float32 else 2e-2)
    return done


def _gated_mlp(child: torch.nn.Module) -> FusedGatedMLP | None:
    """``child`` as a :class:`FusedGatedMLP`, where it is a gated MLP of an activation in :data:`_ACT_MUL` over
    packed layers."""
    down = getattr(child, "down_proj", None)
    if down is None:
        return None
    if same_forward(type(child), _GATE_UP_MLPS):  # Phi-3: one gate|up layer, up * act(gate)
        gate_up = getattr(child, "gate_up_proj", None)
        act_mul = _ACT_MUL.get(type(getattr(child, "activation_fn", None)).__name__)
        if act_mul and type(gate_up) is PackedLinear and gate_up.out_features % 2 == 0:
            return FusedGatedMLP(gate_up, down, act_mul=act_mul)
        return None
    act_mul = _ACT_MUL.get(type(getattr(child, "act_fn", None)).__name__)
    if act_mul is None or not same_forward(type(child), _GATED_MLPS):
        return None
    gate, up = getattr(child, "gate_proj", None), getattr(child, "up_proj", None)
    if (isinstance(gate, LinearSlice) and isinstance(up, LinearSlice) and gate._fused[0] is up._fused[0]
            and (gate.index, up.index) == (0, 1) and len(gate._fused[0].bounds) == 2):  # fmt: skip
        return FusedGatedMLP(gate._fused[0], down, act_mul=act_mul)
    if (act_mul == "silu_mul" and type(gate) is PackedLinear and type(up) is PackedLinear
            and gate.layout == up.layout == "onednn" and gate.dtype == up.dtype and gate.in_features == up.in_features
            and gate.out_features == up.out_features and gate.bias is None and up.bias is None):  # fmt: skip
        return FusedGatedMLP(None, down, gate=gate, up=up)  # kept apart (_keep_apart)
    return None


def _swap_if_equal(parent: torch.nn.Module, name: str, child: torch.nn.Module, fused: torch.nn.Module,
                   x: torch.Tensor, tol: float) -> bool:
    """Put ``fused`` in ``child``'s place under ``parent`` if both give the same output on ``x`` (within ``tol``);
    else log and keep ``child``."""
    with torch.inference_mode():
        if not torch.allclose(fused(x).float(), child(x).float(), rtol=tol, atol=tol):
            log.warning("keeping %s for %s: fused result differs", type(child).__name__, name)
            return False
    setattr(parent, name, fused)
    return True


def fuse_rms_norms(model: torch.nn.Module, kernel: bool = False) -> int:
    """Replace each Llama-style RMSNorm of ``model`` by a :class:`FusedRMSNorm` (on the engine's C++ kernel
    when ``kernel``: the caller checked that it loaded), and with the kernel each Gemma-style one (or one of
    :data:`_WEIGHTED_NORMS`) by a :class:`FusedScaledRMSNorm`, whose output matches it on a random input; returns
    how many."""
    done = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            weight = getattr(child, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.device.type != "cpu":
                continue
            if hasattr(child, "variance_epsilon") and same_forward(type(child), _LLAMA_STYLE_NORMS):
                fused = FusedRMSNorm(child, kernel=kernel)
            elif (kernel and isinstance(getattr(child, "eps", None), float) and weight.dtype in _PACKABLE_DTYPES
                    and same_forward(type(child), _GEMMA_STYLE_NORMS)):  # fmt: skip
                fused = FusedScaledRMSNorm(child)
            elif (kernel and isinstance(getattr(child, "variance_epsilon", None), float)
                    and weight.dtype in _PACKABLE_DTYPES and same_forward(type(child), _WEIGHTED_NORMS)):  # fmt: skip
                fused = FusedScaledRMSNorm(child, offset=0.0)
            else:
                continue
            x = torch.randn(3, weight.shape[-1], dtype=weight.dtype)
            done += _swap_if_equal(parent, name, child, fused, x, tol=1e-5 if x.dtype == torch.float32 else 1e-2)
    return done


def _fuse_siblings(model: torch.nn.Module, kernel: bool = False, prefill: bool = False) -> int:
    """Fuse each group of :data:`_SIBLINGS` that are plain packable ``nn.Linear`` layers of one input size,
    dtype and bias-ness; returns how many layers were fused."""
    done = 0
    for parent in list(model.modules()):
        for names in _SIBLINGS:
            layers = [getattr(parent, n, None) for n in names]
            if not all(type(m) is torch.nn.Linear for m in layers):
                continue
            if not (all(_plain(m) for m in layers) or _shared_int8_layout(layers)):
                continue
            first = layers[0]
            if any(m.in_features != first.in_features or m.weight.dtype != first.weight.dtype
                   or (m.bias is None) != (first.bias is None) for m in layers):  # fmt: skip
                continue
            if not packing_supported(first.weight.dtype, first.weight.device):
                continue
            if _keep_apart(names, first, kernel, prefill):
                continue
            try:
                fused = FusedLinear(layers, kernel=kernel, prefill=prefill)
                with torch.inference_mode():
                    x = torch.randn(3, first.in_features, dtype=first.weight.dtype)
                    tol = 1e-3 if x.dtype == torch.float32 else 1e-1
                    ok = all(torch.allclose(fused.part(i, x), m(x), rtol=tol, atol=tol) for i, m in enumerate(layers))
            except RuntimeError as exc:
                log.warning("keeping separate %s: %s", "/".join(names), exc)
                continue
            if not ok:
                log.warning("keeping separate %s: fused result differs", "/".join(names))
                continue
            parent.add_module("_".join(n.removesuffix("_proj") for n in names) + "_fused", fused)
            for i, (n, m) in enumerate(zip(names, layers)):
                setattr(parent, n, LinearSlice(fused, i, m))
            done += len(layers)
    return done


def _keep_apart(names: tuple[str, ...], first: torch.nn.Linear, kernel: bool, prefill: bool) -> bool:
    """Whether a prefill worker keeps a gated MLP's gate and up products apart: bf16 layers in oneDNN's layout on
    an AMX CPU (its AMX GEMM; the engine's kernels then compute the activation from both, :class:`FusedGatedMLP`;
    a build without the bf16 kernel elsewhere keeps oneDNN's layout for both roles, fused as for decode). oneDNN
    ran the 0.35B model's gate/up product of a 2,048-token prompt (2 x 2,816 features) at 10.1-11.2 ms a layer as
    one product and 8.9-9.8 ms as two (an Intel Xeon with AMX, weights and inputs cold as in a forward pass); the
    q/k/v product (2,048 features) and the down projection split gained nothing."""
    return (kernel and prefill and names == ("gate_proj", "up_proj") and _plain(first) and "amx_bf16" in
            cpu_kernels.cpu_flags() and first.weight.dtype == torch.bfloat16
            and _own_layout(first.weight, prefill) == "onednn")  # fmt: skip


def _plain(linear: torch.nn.Linear) -> bool:
    # A torchao quantized weight (a tensor subclass, common/engine/quantization.py) reports the full-precision
    # dtype but has no oneDNN reorder (each layer would fail and warn): see _int8_layout.
    return type(linear.weight) is torch.nn.Parameter and type(linear.weight.data) is torch.Tensor


def _int8_layout(linear: torch.nn.Linear) -> str | None:
    """The int8 layout for ``linear``'s weight, or ``None``: ``"int8_rows"`` for torchao's weight-only int8 with
    one symmetric scale per output feature (``Int8WeightOnlyConfig``'s per-row default), ``"int8_dynamic"`` for
    the same weight with symmetric per-row dynamic quantization of the activations at the full int8 range
    (``Int8DynamicActivationInt8WeightConfig``'s defaults); on the CPU, for fp32 or bf16 inputs."""
    w = linear.weight
    q, scale, zero = getattr(w, "qdata", None), getattr(w, "scale", None), getattr(w, "zero_point", None)
    if not (type(w).__name__ == "Int8Tensor" and isinstance(q, torch.Tensor) and q.dtype == torch.int8
            and q.dim() == 2 and q.device.type == "cpu" and w.dtype in _PACKABLE_DTYPES
            and list(getattr(w, "block_size", ())) == [1, q.shape[1]] and getattr(w, "act_pre_scale", None) is None
            and isinstance(scale, torch.Tensor) and scale.numel() == q.shape[0]
            and (zero is None or not bool(zero.any()))):  # fmt: skip
        return None
    act = getattr(w, "act_quant_kwargs", None)
    if act is None:
        return "int8_rows"
    granularity = getattr(act, "granularity", None)
    if (type(act).__name__ == "QuantizeTensorToInt8Kwargs" and type(granularity).__name__ == "PerRow"
            and getattr(granularity, "dim", -1) == -1 and getattr(act.mapping_type, "name", "") == "SYMMETRIC"
            and not getattr(act, "reduce_range", False) and not getattr(w, "reduce_range", False)
            and getattr(w, "act_quant_scale", None) is None):  # fmt: skip  (a static scale: another scheme)
        return "int8_dynamic"
    return None


def _shared_int8_layout(linears: list[torch.nn.Linear]) -> str | None:
    """The int8 layout all of ``linears`` take (:func:`_int8_layout`), or ``None`` when they do not share one."""
    layouts = {_int8_layout(m) for m in linears}
    return layouts.pop() if len(layouts) == 1 else None


def _qlinear_sums(rows_u8: torch.Tensor, packed: torch.Tensor, ones: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The int32 sums of (rows_u8 - 128) times the int8 weight, as fp32 (scales of 1: each sum converted once)."""
    return torch.ops.onednn.qlinear_pointwise(rows_u8, 1.0, 128, packed, ones, zeros, None, 1.0, 0, torch.float32,
                                              "none", [], "")  # fmt: skip


def _extreme_rows(k: int) -> torch.Tensor:
    """8 rows of ``k`` int8 values at the range's ends (int32): +-127, every third -128, the first all 127."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 2, (8, k), generator=g, dtype=torch.int32).mul_(254).sub_(127)  # +-127
    rows[:, ::3] = -128
    rows[0] = 127  # every uint8 at 255: the largest pair sums any input gives (a saturating CPU fails this row)
    return rows


# Inputs a float product of int8 values takes at once: each partial sum an integer of at most 1024 * 128 * 128 =
# 2**24 in magnitude, exact in fp32 whatever the order of summation.
FLOAT_EXACT_K = 1024


# Weight values a product over widened int8 weights converts at a time (2 MiB of fp32: in L2 or L3 while used)
_FLOAT_TILE = 512 * 1024


def _widened_product(rows: torch.Tensor, weight: torch.Tensor, kc: int) -> torch.Tensor:
    """fp32 ``rows`` ([m, k]) times the int8 ``weight`` ([n, k]) transposed, in fp32: oneDNN's matmul over the
    weight widened a tile at a time into one buffer (widening it whole wrote 4 bytes a weight to fresh pages at
    every call: an LM head's 16M weights took 30 ms against 4.4 a row on a 2-core Zen 3 VM). ``kc`` < ``k`` splits
    the inputs into tiles of ``kc`` whose products are integers, added in int32 (:func:`_float_sums`)."""
    linear = torch.ops.mkldnn._linear_pointwise
    (m, k), n = rows.shape, weight.shape[0]
    kc = min(k, kc)
    nc = max(1, min(n, _FLOAT_TILE // kc))
    buf = torch.empty(nc * kc)
    out = torch.empty(m, n) if k == kc else torch.zeros(m, n, dtype=torch.int32)
    for n0 in range(0, n, nc):
        n1 = min(n, n0 + nc)
        for k0 in range(0, k, kc):
            k1 = min(k, k0 + kc)
            tile = buf[: (n1 - n0) * (k1 - k0)].view(n1 - n0, k1 - k0)
            tile.copy_(weight[n0:n1, k0:k1])
            if k == kc:
                out[:, n0:n1] = linear(rows, tile, None, "none", [None], "")
            else:
                out[:, n0:n1] += linear(rows[:, k0:k1].contiguous(), tile, None, "none", [None], "").to(torch.int32)
    return out if k == kc else out.float()


def _int8_blocks(qdata: torch.Tensor) -> torch.Tensor:
    """int8 ``qdata`` ([n, k]) arranged as :func:`torch.ops.pdserve.pack_fp32_blocks` arranges floats: [n / 16
    (rounded up), k, 16], zeros past feature n. Widened, a slice of it is that kernel's packed weight."""
    n, k = qdata.shape
    padded = torch.zeros((n + 15) // 16 * 16, k, dtype=torch.int8)
    padded[:n] = qdata
    return padded.view(-1, 16, k).permute(0, 2, 1).contiguous()


def _int8_pairs(qdata: torch.Tensor) -> torch.Tensor:
    """int8 ``qdata`` ([n, k], k even) arranged as :func:`torch.ops.pdserve.pack_bf16_pairs` arranges bf16: [n / 16
    (n rounded up to 32), k / 2, 16, 2], zeros past feature n: the engine's ``bf16_linear`` widens it as it loads."""
    n, k = qdata.shape
    padded = torch.zeros((n + 31) // 32 * 32, k, dtype=torch.int8)
    padded[:n] = qdata
    return padded.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def _blocked_product(rows: torch.Tensor, blocks: torch.Tensor, n: int, kc: int) -> torch.Tensor:
    """fp32 ``rows`` ([m, k]) times int8 ``blocks`` (:func:`_int8_blocks` of a weight of ``n`` features) by the
    engine's ``fp32_linear``, which widens each weight in a register as it loads it (the same products, bit for
    bit, as the weight widened and packed as floats, from a quarter of its bytes). ``kc`` < ``k`` splits the
    inputs into slices of ``kc`` whose products are integers, added in int32 (:func:`_float_sums`). Against
    widening each 2 MiB tile of blocks into a buffer for that kernel first (session 30), on a 2-core Zen 4 VM:
    1 row x 512 x 2,816 0.22 -> 0.032 ms, the LM head's 32,000 outputs 2.5 -> 0.29, 16 rows 0.40 -> 0.22, 2,048
    rows 1.07x."""
    k = rows.shape[1]
    kc = min(k, kc)
    if k == kc:
        return torch.ops.pdserve.fp32_linear(rows, blocks, None, n)
    out = torch.zeros(rows.shape[0], n, dtype=torch.int32)
    for k0 in range(0, k, kc):
        part = torch.ops.pdserve.fp32_linear(rows[:, k0:k0 + kc].contiguous(), blocks, None, n, k0)
        out += part.to(torch.int32)
    return out.float()


def _fp32_product(rows: torch.Tensor, weight: torch.Tensor, n: int, kc: int, blocked: bool) -> torch.Tensor:
    """fp32 ``rows`` times an int8 weight of ``n`` features (plain, or :func:`_int8_blocks` where ``blocked``)."""
    return _blocked_product(rows, weight, n, kc) if blocked else _widened_product(rows, weight, kc)


def _float_sums(q: torch.Tensor, weight: torch.Tensor, n: int | None = None, blocked: bool = False) -> torch.Tensor:
    """The int32 sums of int8 rows ``q`` times the int8 ``weight`` ([out, in], or :func:`_int8_blocks` of ``n``
    features where ``blocked``: :func:`_blocked_product`) as fp32, as
    ``torch._int_mm(q, weight.t())`` converted: fp32 products of the widened values (:func:`_widened_product`) over
    tiles of at most :data:`FLOAT_EXACT_K` inputs, added in int32. For CPUs without VNNI, whose ``torch._int_mm``
    is a slow loop: on a 2-core Zen 3 VM, 16 rows x 512 x 2,816 0.86 ms (``_int_mm`` 7.9), 1 row 0.44 (0.48)."""
    return _fp32_product(q.float(), weight, weight.shape[0] if n is None else n, FLOAT_EXACT_K, blocked)


def _float_sums_exact(qdata: torch.Tensor, blocked: bool = False) -> bool:
    """Whether :func:`_float_sums` (over the weight's blocks where ``blocked``) gives ``torch._int_mm``'s sums over
    ``qdata``: a matmul that accumulates below fp32 would not. (Inputs rounded to bf16 or TF32 on the way would not
    matter: int8 values are exact there.)"""
    if not torch.backends.mkldnn.is_available():
        return False
    rows = _extreme_rows(qdata.shape[1]).to(torch.int8)
    try:
        weight = _int8_blocks(qdata) if blocked else qdata
        return torch.equal(_float_sums(rows, weight, qdata.shape[0], blocked), torch._int_mm(rows, qdata.t()).float())
    except RuntimeError as exc:
        log.info("int8 products by torch._int_mm: oneDNN's fp32 matmul failed (%s)", exc)
        return False


def _onednn_u8s8(qdata: torch.Tensor) -> torch.Tensor | None:
    """``qdata`` packed for oneDNN's quantized linear (``torch.ops.onednn.qlinear_pointwise``: unsigned int8 inputs
    with a zero point, the weight in oneDNN's own layout), or ``None`` where that product does not give
    ``torch._int_mm``'s sums exactly: checked on rows at the int8 range's ends, where a CPU without VNNI (16-bit
    pair sums that saturate: a row of 127s gives each pair of weights its largest sum) would differ. Its
    signed-input form runs a reference loop (over 100x slower); ``torch._int_mm`` converts the plain weight at
    each call. On a Zen 4 VM (2 threads), rows x 1024 x 5632: 1 row 0.23 ms (``_int_mm`` 0.28), 16: 0.39 (0.56),
    64: 1.03 (1.23), 128: 2.1 (2.15); the engine's bf16 kernel 0.25, 0.59, 1.84, 3.5."""
    if not hasattr(torch.ops.onednn, "qlinear_prepack") or not torch.backends.mkldnn.is_available():
        return None
    rows = _extreme_rows(qdata.shape[1])
    try:
        packed = torch.ops.onednn.qlinear_prepack(qdata, None)
        n = qdata.shape[0]
        sums = _qlinear_sums(rows.add(128).to(torch.uint8), packed, torch.ones(n), torch.zeros(n, dtype=torch.int32))
    except RuntimeError as exc:
        log.info("int8 products without oneDNN's quantized linear: it failed (%s)", exc)
        return None
    return packed if torch.equal(sums, torch._int_mm(rows.to(torch.int8), qdata.t()).float()) else None


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in _PACKABLE_DTYPES and torch.backends.mkldnn.is_available()


def pack_linear_layers(model: torch.nn.Module, kernel: bool = False, prefill: bool = False) -> int:
    """Replace each CPU ``nn.Linear`` of ``model`` (fp32/bf16, plain weight) by a :class:`PackedLinear`, sibling
    projections fused into a :class:`FusedLinear` first; returns how many layers were packed. ``kernel``: the
    engine's CPU kernels are loaded (the weights then take the kernels' layouts where :func:`_own_layout` says);
    ``prefill``: the engine runs mostly prefill (a prefill worker): the layouts for large batches of tokens.

    A layer whose packed result differs from ``F.linear`` by more than summation-order noise is left
    alone (the check runs once per layer on a small random input).
    """
    fused_layers = _fuse_siblings(model, kernel=kernel, prefill=prefill)
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is not torch.nn.Linear:
                continue
            if (_plain(child) or _int8_layout(child)) and packing_supported(child.weight.dtype, child.weight.device):
                swaps.append((parent, name, child))
    done = 0
    for parent, name, child in swaps:
        try:
            packed = PackedLinear(child, kernel=kernel, prefill=prefill)
            with torch.inference_mode():
                x = torch.randn(3, child.in_features, dtype=child.weight.dtype)
                expected = torch.nn.functional.linear(x, child.weight, child.bias)
                tol = 1e-3 if child.weight.dtype == torch.float32 else 1e-1
                if not torch.allclose(packed(x), expected, rtol=tol, atol=tol):
                    raise RuntimeError("packed result differs")
        except RuntimeError as exc:  # oneDNN missing a kernel for this shape/CPU: keep the stock layer
            log.warning("keeping stock nn.Linear for %s: %s", name, exc)
            continue
        setattr(parent, name, packed)
        done += 1
    return done + fused_layers
