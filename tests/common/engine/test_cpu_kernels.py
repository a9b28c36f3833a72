"""The engine's CPU kernels. Decode attention against attention computed in float64 from the same cache:
scattered blocks, lengths on and across block edges, grouped-query heads, sliding windows, head sizes with
and without a specialised build, fp32 and bf16 (queries and cache of either), strided queries; bad
arguments raise instead of reading out of bounds. RMSNorm against transformers' own ``LlamaRMSNorm``, the
gated MLP's silu(gate) * up against PyTorch's, the linear layers against float matmuls. Without the kernels
the engine keeps its PyTorch paths; prebuilt kernels load where no compiler is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from common.engine import cpu_kernels
from common.engine.kv_cache import KVCacheSpec, PagedKVCache

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels unavailable")


def reference(q, cache: PagedKVCache, layer, table, lens, scale, window, softcap=None, sinks=None):
    """[B, Hq, D] float64 attention of one query per sequence over its first lens[b] cached keys; a soft cap of
    the scores and sink logits [Hq] (a softmax column without a value) where given."""
    kv = cache.data[layer].double()  # [2, H, NB, bs, D]
    h = kv.shape[1]
    bs = cache.spec.block_size
    out = []
    for b, n in enumerate(lens.tolist()):
        slots = torch.arange(n)
        first = max(0, n - window) if window else 0
        slots = slots[first:]
        blocks = table[b, slots // bs]
        k = kv[0][:, blocks, slots % bs]  # [H, n, D]
        v = kv[1][:, blocks, slots % bs]
        qb = q[b].double().view(h, -1, q.shape[-1])  # [H, g, D]
        logits = qb @ k.transpose(1, 2) * scale
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if sinks is not None:
            column = sinks.double().view(h, -1, 1)
            logits = torch.cat([logits, column], dim=-1)
        p = torch.softmax(logits, -1)
        if sinks is not None:
            p = p[..., :-1]
        out.append((p @ v).reshape(-1, q.shape[-1]))
    return torch.stack(out)


def random_case(q_dtype, cache_dtype, heads=4, group=2, dim=64, block_size=4, lens=(1, 4, 5, 17, 30), seed=0):
    g = torch.Generator().manual_seed(seed)
    spec = KVCacheSpec(num_layers=3, num_kv_heads=heads, head_dim=dim, block_size=block_size, dtype=cache_dtype)
    width = -(-max(lens) // block_size)
    num_blocks = len(lens) * width + 5
    cache = PagedKVCache(spec, num_blocks)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    table = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width)  # scattered
    q = torch.randn(len(lens), heads * group, dim, generator=g).to(q_dtype)
    return q, cache, table, torch.tensor(lens)


@pytest.mark.parametrize(
    "q_dtype,cache_dtype,tol",
    [(torch.float32, torch.float32, 1e-5), (torch.bfloat16, torch.bfloat16, 2e-2),
     (torch.float32, torch.bfloat16, 1e-5), (torch.bfloat16, torch.float32, 2e-2)],  # fmt: skip
)
@pytest.mark.parametrize("dim", [64, 128, 40])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [0, 6])
def test_kernel_matches_float64_attention(q_dtype, cache_dtype, tol, dim, group, window):
    q, cache, table, lens = random_case(q_dtype, cache_dtype, group=group, dim=dim)
    out = torch.full_like(q, float("nan"))
    scale = dim**-0.5
    torch.ops.pdserve.paged_decode_attention(out, q, cache.data, 1, table, lens, scale, window)
    expected = reference(q, cache, 1, table, lens, scale, window)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("q_dtype,cache_dtype,tol", [(torch.float32, torch.float32, 1e-5),
                                                     (torch.bfloat16, torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("dim", [64, 128, 40])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("extra", ["softcap", "sinks", "both"])
def test_kernel_computes_soft_caps_and_sink_logits(q_dtype, cache_dtype, tol, dim, group, window, extra):
    """Gemma 2's soft cap (a cap the scaled scores pass, so it bends them) and GPT-OSS's sink logits (some above
    every score: most of the weight on the sink), as transformers' eager attention computes them, in float64."""
    q, cache, table, lens = random_case(q_dtype, cache_dtype, group=group, dim=dim)
    q = (q.float() * 3).to(q_dtype)  # scores of several units
    scale = dim**-0.5
    softcap = 1.5 if extra in ("softcap", "both") else None
    sinks = torch.linspace(-4, 6, q.shape[1]) if extra in ("sinks", "both") else None
    out = torch.full_like(q, float("nan"))
    torch.ops.pdserve.paged_decode_attention(out, q, cache.data, 1, table, lens, scale, window, softcap or 0.0, sinks)
    expected = reference(q, cache, 1, table, lens, scale, window, softcap, sinks)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    plain = reference(q, cache, 1, table, lens, scale, window)
    assert (expected - plain).abs().max() > 0.1  # the extra changes the output


def test_soft_caps_and_sinks_take_only_their_forms():
    q, cache, table, lens = random_case(torch.float32, torch.float32)
    out = torch.empty_like(q)
    op = torch.ops.pdserve.paged_decode_attention
    with pytest.raises(RuntimeError, match="softcap must be positive"):
        op(out, q, cache.data, 1, table, lens, 0.125, 0, -1.0, None)
    hq = q.shape[1]
    refused = r"sinks must be a contiguous float \[Hq\] tensor"
    with pytest.raises(RuntimeError, match=rf"{refused} \(Hq = {hq}\), got Float \[{hq + 1}\]"):
        op(out, q, cache.data, 1, table, lens, 0.125, 0, 0.0, torch.zeros(hq + 1))
    with pytest.raises(RuntimeError, match=rf"sinks must be a contiguous float \[Hq\].*got BFloat16 \[{hq}\]"):
        op(out, q, cache.data, 1, table, lens, 0.125, 0, 0.0, torch.zeros(hq, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"sinks must be a contiguous float \[Hq\].*\(not contiguous\)"):
        op(out, q, cache.data, 1, table, lens, 0.125, 0, 0.0, torch.zeros(hq, 2)[:, 0])


def test_rotary_names_the_dtypes_it_refuses():
    qkv, cos = torch.zeros(3, 4 * 8, dtype=torch.bfloat16), torch.zeros(3, 8, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="must be qkv's dtype .*, got qkv BFloat16, cos Half, sin Half"):
        torch.ops.pdserve.rotary_(qkv, cos, cos, 2, 1, 8)


@pytest.mark.parametrize("q_dtype,cache_dtype,tol", [(torch.float32, torch.float32, 1e-5),
                                                     (torch.bfloat16, torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group,dim", [(1, 64), (2, 64), (3, 128), (2, 96)])
@pytest.mark.parametrize("window", [0, 21])
def test_kernel_over_engine_sized_blocks(q_dtype, cache_dtype, tol, block_size, group, dim, window):
    """Blocks of 16 and 32 keys: the bf16 path on AVX512-BF16 CPUs scores runs of up to 16 keys at once (a block
    of 32 is two runs; a window or a length starts and ends them inside a block), odd query groups included."""
    q, cache, table, lens = random_case(q_dtype, cache_dtype, group=group, dim=dim, block_size=block_size,
                                        lens=(1, 15, 16, 17, 31, 33, 70, 100), seed=3)
    out = torch.full_like(q, float("nan"))
    scale = dim**-0.5
    torch.ops.pdserve.paged_decode_attention(out, q, cache.data, 2, table, lens, scale, window)
    expected = reference(q, cache, 2, table, lens, scale, window)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("q_dtype,cache_dtype,tol", [(torch.float32, torch.float32, 1e-5),
                                                     (torch.bfloat16, torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("at", ["first", "last"])
def test_kernel_finds_the_largest_score_wherever_it_is(q_dtype, cache_dtype, tol, at):
    """Scores hundreds apart, the largest on a sequence's first or last key (lengths off every vector width): a
    maximum that missed it would leave exp(score - maximum) to overflow into inf and NaN."""
    lens = (1, 7, 15, 17, 31, 33, 47, 70)
    q, cache, table, lens_t = random_case(q_dtype, cache_dtype, group=1, dim=64, block_size=16, lens=lens, seed=5)
    bs, layer = cache.spec.block_size, 1
    for b, n in enumerate(lens):
        slot = 0 if at == "first" else n - 1
        block = table[b, slot // bs]
        # key = 4 q: with the query times 16 below, a score of 64 |q|^2 / 8 ~ 512 against others ~ N(0, 16^2)
        cache.data[layer, 0, :, block, slot % bs] = (4 * q[b].float()).to(cache_dtype)
    q16 = (16 * q.float()).to(q_dtype)
    out = torch.full_like(q16, float("nan"))
    torch.ops.pdserve.paged_decode_attention(out, q16, cache.data, layer, table, lens_t, 0.125, 0)
    expected = reference(q16, cache, layer, table, lens_t, 0.125, 0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def test_kernel_reads_a_strided_query_and_the_right_layer():
    q, cache, table, lens = random_case(torch.float32, torch.float32)
    packed = q.transpose(0, 1).contiguous().transpose(0, 1)  # [B, Hq, D] with the token axis innermost-but-one
    assert not packed.is_contiguous()
    out = torch.empty_like(q)
    for layer in range(3):
        torch.ops.pdserve.paged_decode_attention(out, packed, cache.data, layer, table, lens, 0.125, 0)
        expected = reference(q, cache, layer, table, lens, 0.125, 0)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_what_would_read_out_of_bounds():
    q, cache, table, lens = random_case(torch.float32, torch.float32)
    out = torch.empty_like(q)
    op = torch.ops.pdserve.paged_decode_attention
    with pytest.raises(RuntimeError, match="outside the block table"):
        op(out, q, cache.data, 0, table, lens + table.shape[1] * 4, 0.125, 0)
    bad = table.clone()
    bad[0, 0] = cache.num_blocks
    with pytest.raises(RuntimeError, match="out of range"):
        op(out, q, cache.data, 0, bad, lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="layer out of range"):
        op(out, q, cache.data, 3, table, lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(out.bfloat16(), q, cache.data, 0, table, lens, 0.125, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 1024), (1, 7, 512), (3, 1000)])
def test_rms_norm_matches_transformers(dtype, shape):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(1)
    norm = LlamaRMSNorm(shape[-1], eps=1e-6)
    norm.weight.data.copy_(torch.randn(shape[-1], generator=g))
    norm = norm.to(dtype)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    with torch.inference_mode():
        expected = norm(x)
        got = torch.ops.pdserve.rms_norm(x, norm.weight, 1e-6)
        strided = torch.ops.pdserve.rms_norm(torch.cat([x, x], -1)[..., : shape[-1]], norm.weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(strided, got, rtol=0, atol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:  # the same roundings; only the sum of squares may add in another order
        assert (got == expected).float().mean() > 0.99
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 1024), (1, 37, 512), (3, 1000), (1, 300, 96)])
def test_add_rms_norm_is_the_addition_then_the_norm_bit_for_bit(dtype, shape):
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(shape[-1], generator=g).to(dtype)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    residual = (torch.randn(shape, generator=g) * 5).to(dtype)
    wide = torch.cat([residual, residual], -1)[..., : shape[-1]]  # rows apart by twice their length
    with torch.inference_mode():
        want_sum = x + residual
        want = torch.ops.pdserve.rms_norm(want_sum, weight, 1e-5)
        for res in (residual, wide):
            got_x = x.clone()
            got = torch.ops.pdserve.add_rms_norm_(got_x, res, weight, 1e-5)
            assert got.shape == x.shape and got.dtype == dtype
            assert torch.equal(got_x, want_sum), "x must hold x + residual, rounded as torch rounds it"
            assert torch.equal(got, want), "the norm must be rms_norm's of the sum, bit for bit"
    n = shape[-1]
    with pytest.raises(RuntimeError, match="contiguous x"):
        torch.ops.pdserve.add_rms_norm_(torch.zeros(2, 2 * n, dtype=dtype)[:, :n], torch.zeros(2, n, dtype=dtype),
                                        weight, 1e-5)  # fmt: skip
    with pytest.raises(RuntimeError, match="shape"):
        torch.ops.pdserve.add_rms_norm_(x.clone(), torch.cat([residual, residual]), weight, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 1024), (1, 7, 512), (3, 1000)])
def test_rms_norm_scaled_matches_gemmas_norm(dtype, shape):
    """Gemma's x / rms(x) * (1 + w), one rounding: fp32 within a few ulps, bf16 the same roundings (only the sum of
    squares may add in another order)."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    g = torch.Generator().manual_seed(3)
    norm = GemmaRMSNorm(shape[-1], eps=1e-6)
    norm.weight.data.copy_(torch.randn(shape[-1], generator=g))
    norm = norm.to(dtype)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    scale = 1.0 + norm.weight.float()
    with torch.inference_mode():
        expected = norm(x)
        got = torch.ops.pdserve.rms_norm_scaled(x, scale, 1e-6)
        strided = torch.ops.pdserve.rms_norm_scaled(torch.cat([x, x], -1)[..., : shape[-1]], scale, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(strided, got, rtol=0, atol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:
        assert (got == expected).float().mean() > 0.99
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-3)
    with pytest.raises(RuntimeError, match="float32 scale"):
        torch.ops.pdserve.rms_norm_scaled(x, scale.to(dtype) if dtype != torch.float32 else scale.double(), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["gpt_oss", "olmo2"])
def test_weighted_norms_fuse_as_the_scaled_norm_without_its_offset(dtype, family):
    """GPT-OSS's and OLMo 2's x / rms(x) * w in fp32, rounded once: FusedScaledRMSNorm over w (no 1 +) gives it,
    bf16 the same roundings but where the sum of squares adds in another order."""
    import importlib

    from common.engine.cpu_linear import FusedScaledRMSNorm, fuse_rms_norms

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = getattr(module, "GptOssRMSNorm" if family == "gpt_oss" else "Olmo2RMSNorm")
    g = torch.Generator().manual_seed(4)
    parent = torch.nn.Module()
    parent.norm = cls(512, eps=1e-5)
    parent.norm.weight.data.copy_(torch.randn(512, generator=g))
    parent = parent.to(dtype)
    norm = parent.norm
    assert fuse_rms_norms(parent, kernel=True) == 1 and type(parent.norm) is FusedScaledRMSNorm
    x = (torch.randn(7, 512, generator=g) * 3).to(dtype)
    with torch.inference_mode():
        got, expected = parent.norm(x), norm(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:
        assert (got == expected).float().mean() > 0.99
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_gelu_tanh_mul_matches_pytorch(dtype, rows):
    """gelu(gate, approximate="tanh") * up (Gemma's gated MLP) with PyTorch's formula and two roundings in bf16; the
    tanh is the kernel's own (Cephes' tanhf): fp32 within a few ulps of 1 (1 + tanh cancels where tanh nears -1, in
    PyTorch as here), bf16 bit for bit but where those ulps cross a rounding boundary. Extremes (0, +-100,
    +-1e-30, +-1e30, inf, NaN) as PyTorch gives them."""
    g = torch.Generator().manual_seed(rows)
    gu = (torch.randn(rows, 2 * 1408, generator=g) * 4).to(dtype)
    gu[0, :10] = torch.tensor([0.0, 100.0, -100.0, 1e-30, -1e-30, 1e30, -1e30, float("inf"), float("-inf"),
                               float("nan")])  # fmt: skip
    expected = torch.nn.functional.gelu(gu[:, :1408], approximate="tanh") * gu[:, 1408:]
    got = torch.ops.pdserve.gelu_tanh_mul(gu)
    assert got.dtype == dtype and got.shape == (rows, 1408)
    torch.testing.assert_close(torch.ops.pdserve.gelu_tanh_mul(torch.cat([gu, gu], -1)[:, : 2 * 1408]), got, rtol=0,
                               atol=0, equal_nan=True)  # fmt: skip
    same = (got == expected) | (got.isnan() & expected.isnan())
    torch.testing.assert_close(got[0, :10], expected[0, :10], rtol=0, atol=0, equal_nan=True)
    if dtype == torch.bfloat16:
        assert same.float().mean() > 0.99
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-5, equal_nan=True)
    else:  # a few ulps of 1 in the activation, times up
        act_err = ((got - expected) / gu[:, 1408:]).abs()
        assert act_err[~same].max() < 1e-6 and same.float().mean() > 0.8


@pytest.mark.parametrize("width", [65536, 7])
def test_silu_mul_bf16_every_gate_value(width):
    """Every one of the 65,536 bf16 gates (infinities, NaNs, subnormals, -88 and the like among them) gives
    PyTorch's bf16 silu(gate) * up bit for bit: rows of 65,536 go through the vector loop, rows of 7 through the
    element-wise one alone."""
    gates = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gates = torch.cat([gates, gates[:(-gates.numel()) % width]]).view(-1, width)
    ups = [torch.ones_like(gates), torch.randn(gates.shape, generator=torch.Generator().manual_seed(0)).bfloat16()]
    for up in ups:
        expected = torch.nn.functional.silu(gates) * up
        fused = torch.ops.pdserve.silu_mul(torch.cat([gates, up], -1))
        for got in (torch.ops.pdserve.silu_mul_parts(gates, up), fused):
            same = (got.view(torch.int16) == expected.view(torch.int16)) | (got.isnan() & expected.isnan())
            assert same.all(), f"{(~same).sum().item()} gates differ, e.g. {gates[~same][:4].tolist()}"


def gpt_oss_gate_reference(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GptOssExperts._apply_gate over [gate | up] (the columns taken apart as moe.py takes them)."""
    experts = GptOssExperts(transformers.GptOssConfig(hidden_size=8, intermediate_size=8, num_local_experts=1))
    experts.alpha, experts.limit = alpha, limit
    n = gate_up.shape[-1] // 2
    interleaved = torch.stack([gate_up[..., :n], gate_up[..., n:]], -1).flatten(-2)
    return experts._apply_gate(interleaved)


@pytest.mark.parametrize("width", [65536, 7])
def test_gpt_oss_gate_bf16_every_gate_value(width):
    """GPT-OSS's clamped gate, (clamp(up) + 1) * (g * sigmoid(g * alpha)) with g = min(gate, limit), for every one of
    the 65,536 bf16 gates (NaNs, infinities, subnormals among them) against ups past the clamp, near it and small:
    PyTorch's bf16 result bit for bit, in the vector loop (rows of 65,536) and the element-wise one (rows of 7).
    Without the clamp of the gate (a limit of 1e30) every bf16 sigmoid input is met: the kernel's sigmoid is
    PyTorch's bf16 sigmoid bit for bit."""
    gates = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gates = torch.cat([gates, gates[:(-gates.numel()) % width]]).view(-1, width)
    g = torch.Generator().manual_seed(width)
    for alpha, limit in ((1.702, 7.0), (1.0, 1e30)):
        for up in ((torch.randn(gates.shape, generator=g) * 6).bfloat16(), torch.full_like(gates, -7.5),
                   torch.full_like(gates, float("nan"))):  # fmt: skip
            gate_up = torch.cat([gates, up], -1)
            expected = gpt_oss_gate_reference(gate_up, alpha, limit)
            got = torch.ops.pdserve.gpt_oss_gate(gate_up, alpha, limit)
            assert got.shape == expected.shape and got.dtype == torch.bfloat16
            same = (got.view(torch.int16) == expected.view(torch.int16)) | (got.isnan() & expected.isnan())
            assert same.all(), f"{(~same).sum().item()} gates differ, e.g. {gates[~same][:4].tolist()}"


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_gpt_oss_gate_fp32_matches_pytorch(rows):
    """fp32: within the exp's ulps of PyTorch's, clamps and NaNs as PyTorch gives them; a [..., 2I] of more dims
    keeps them, an odd width is refused."""
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 352, generator=g) * 6
    gate_up[0, :6] = torch.tensor([float("nan"), float("inf"), float("-inf"), 100.0, -100.0, 0.0])
    gate_up[0, 352 : 352 + 6] = torch.tensor([1.0, float("nan"), float("inf"), -1e30, 3.0, float("-inf")])
    expected = gpt_oss_gate_reference(gate_up, 1.702, 7.0)
    got = torch.ops.pdserve.gpt_oss_gate(gate_up, 1.702, 7.0)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert torch.ops.pdserve.gpt_oss_gate(gate_up.view(1, rows, -1), 1.702, 7.0).shape == (1, rows, 352)
    with pytest.raises(RuntimeError, match=r"\[\.\.\., 2I\]"):
        torch.ops.pdserve.gpt_oss_gate(gate_up[:, :-1], 1.702, 7.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_silu_mul_matches_pytorch(dtype, rows):
    """silu(gate) * up from the fused [rows, 2I] product (and a strided view of one): bf16 bit for bit (the same
    two roundings), fp32 within exp's ulps; gates at the extremes (0, +-100, +-1e-30, 88, inf, NaN) as PyTorch
    gives them."""
    g = torch.Generator().manual_seed(rows)
    gu = (torch.randn(rows, 2 * 1408, generator=g) * 4).to(dtype)
    gu[0, :8] = torch.tensor([0.0, 100.0, -100.0, 1e-30, -1e-30, 88.0, float("inf"), float("nan")])
    expected = torch.nn.functional.silu(gu[:, :1408]) * gu[:, 1408:]
    got = torch.ops.pdserve.silu_mul(gu)
    strided = torch.ops.pdserve.silu_mul(torch.cat([gu, gu], -1)[:, : 2 * 1408])
    assert got.dtype == dtype and got.shape == (rows, 1408)
    torch.testing.assert_close(strided, got, rtol=0, atol=0, equal_nan=True)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, equal_nan=True)
    with pytest.raises(RuntimeError, match=r"\[\.\.\., 2I\]"):
        torch.ops.pdserve.silu_mul(gu[:, :-1])
    # the products apart (a prefill worker's oneDNN layers): bit for bit the fused form's, strided views too
    gate, up = gu[:, :1408].contiguous(), gu[:, 1408:].contiguous()
    torch.testing.assert_close(torch.ops.pdserve.silu_mul_parts(gate, up), got, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(torch.ops.pdserve.silu_mul_parts(gu[:, :1408], gu[:, 1408:]), got, rtol=0, atol=0,
                               equal_nan=True)  # fmt: skip
    with pytest.raises(RuntimeError, match="one shape and dtype"):
        torch.ops.pdserve.silu_mul_parts(gate, up[:, :-1])


def rotary_case(tokens: int, heads: tuple[int, int], dim: int, dtype: torch.dtype):
    """A fused q|k|v product of ``tokens`` rows in ``dtype``, each row's angles for half a head (positions up to
    thousands), and the view of a buffer of that layout as its q, k and v heads ([1, H, T, D] each)."""
    num_q, num_kv = heads
    splits = [num_q * dim, num_kv * dim, num_kv * dim]
    g = torch.Generator().manual_seed(tokens)
    qkv = (torch.randn(1, tokens, sum(splits), generator=g) * 3).to(dtype)
    angles = torch.rand(1, tokens, dim // 2, generator=g) * 4000

    def parts(t):
        return [p.view(1, tokens, -1, dim).transpose(1, 2) for p in t.split(splits, -1)]

    return qkv, angles, parts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,dim", [(1, (8, 4), 64), (16, (16, 8), 64), (300, (4, 2), 128), (3, (2, 2), 40)])
def test_rotary_matches_transformers_bit_for_bit(dtype, tokens, heads, dim):
    """RoPE in place over a fused q/k/v product: queries and keys exactly as transformers' apply_rotary_pos_emb
    rotates them (its roundings, fp32 and bf16), values untouched; a step's rows of a larger buffer (strided)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    num_q, num_kv = heads
    qkv, half, parts = rotary_case(tokens, heads, dim, dtype)
    angles = torch.cat((half, half), -1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q, k, v = parts(qkv)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got = qkv.clone()
    torch.ops.pdserve.rotary_(got, cos, sin, num_q, num_kv, dim)
    got_q, got_k, got_v = parts(got)
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=0)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=0)
    torch.testing.assert_close(got_v, v, rtol=0, atol=0)
    wide = torch.cat([qkv, qkv], -1)[..., : qkv.shape[-1]]  # rows one stride apart, not contiguous as a whole
    torch.ops.pdserve.rotary_(wide, cos, sin, num_q, num_kv, dim)
    torch.testing.assert_close(wide, got, rtol=0, atol=0)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    for bad_cos in (cos.to(other), cos[..., :-2]):
        with pytest.raises(RuntimeError, match="cos and sin"):
            torch.ops.pdserve.rotary_(qkv.clone(), bad_cos, sin, num_q, num_kv, dim)
    with pytest.raises(RuntimeError, match="qkv"):
        torch.ops.pdserve.rotary_(qkv.clone()[..., :-dim], cos, sin, num_q, num_kv, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,dim", [(1, (8, 4), 64), (16, (16, 8), 64), (300, (4, 2), 128), (3, (2, 2), 40)])
def test_rotary_of_each_angle_once_matches_gpt_oss_bit_for_bit(dtype, tokens, heads, dim):
    """cos and sin of half a head (GPT-OSS's rotary embedding gives each angle once): both halves rotated by them,
    as GPT-OSS's apply_rotary_pos_emb rotates, bit for bit."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    num_q, num_kv = heads
    qkv, angles, parts = rotary_case(tokens, heads, dim, dtype)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q, k, v = parts(qkv)
    want_q, want_k = modeling_gpt_oss._apply_rotary_emb(q, cos[:, None], sin[:, None]), \
        modeling_gpt_oss._apply_rotary_emb(k, cos[:, None], sin[:, None])  # fmt: skip
    got = qkv.clone()
    torch.ops.pdserve.rotary_(got, cos, sin, num_q, num_kv, dim)
    got_q, got_k, got_v = parts(got)
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=0)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=0)
    torch.testing.assert_close(got_v, v, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,dim,rotary_dim", [(1, (8, 4), 64, 32), (16, (16, 8), 128, 64),
                                                         (300, (4, 2), 128, 32), (3, (2, 2), 40, 20)])  # fmt: skip
def test_rotary_of_part_of_each_head_matches_glm4_moe_bit_for_bit(dtype, tokens, heads, dim, rotary_dim):
    """rotary_dim: only each head's first rotary_dim features rotated, half-split within them (GLM-4-MoE's partial
    rotary: half the head), the rest untouched, as GLM-4-MoE's apply_rotary_pos_emb does, bit for bit; cos and sin
    of another width are refused."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    num_q, num_kv = heads
    qkv, half, parts = rotary_case(tokens, heads, dim, dtype)
    angles = torch.cat((half[..., : rotary_dim // 2], half[..., : rotary_dim // 2]), -1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q, k, v = parts(qkv)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got = qkv.clone()
    torch.ops.pdserve.rotary_(got, cos, sin, num_q, num_kv, dim, rotary_dim)
    got_q, got_k, got_v = parts(got)
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=0)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=0)
    torch.testing.assert_close(got_v, v, rtol=0, atol=0)
    assert torch.equal(got_q[..., rotary_dim:], q[..., rotary_dim:]) and not torch.equal(got_q, q)
    with pytest.raises(RuntimeError, match="rotary_dim must be even and at most the head dim"):
        torch.ops.pdserve.rotary_(qkv.clone(), cos, sin, num_q, num_kv, dim, rotary_dim + 1)
    with pytest.raises(RuntimeError, match=r"cos and sin \[\.\.\., T, rotary_dim\]"):
        torch.ops.pdserve.rotary_(qkv.clone(), cos[..., :-2], sin[..., :-2], num_q, num_kv, dim, rotary_dim)


@pytest.mark.parametrize("tokens,heads,dim", [(1, (8, 4), 64), (300, (4, 2), 128), (3, (2, 2), 40)])
def test_rotary_of_float_angles_matches_olmo2_bit_for_bit(tokens, heads, dim):
    """bf16 heads and float cos and sin (OLMo 2's and 3's rotary embedding): rotated in float and rounded once, as
    OLMo 2's apply_rotary_pos_emb computes, bit for bit."""
    from transformers.models.olmo2.modeling_olmo2 import apply_rotary_pos_emb

    num_q, num_kv = heads
    qkv, half, parts = rotary_case(tokens, heads, dim, torch.bfloat16)
    angles = torch.cat((half, half), -1)
    cos, sin = angles.cos(), angles.sin()
    q, k, v = parts(qkv)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got = qkv.clone()
    torch.ops.pdserve.rotary_(got, cos, sin, num_q, num_kv, dim)
    got_q, got_k, got_v = parts(got)
    assert want_q.dtype == torch.bfloat16
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=0)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=0)
    torch.testing.assert_close(got_v, v, rtol=0, atol=0)
    rounded = qkv.clone()  # the products rounded to bf16 first (Llama's rotation): other bits
    torch.ops.pdserve.rotary_(rounded, cos.bfloat16(), sin.bfloat16(), num_q, num_kv, dim)
    assert not torch.equal(rounded, got)
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.pdserve.rotary_(qkv.float(), cos.bfloat16(), sin.bfloat16(), num_q, num_kv, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rounds_special_values_as_transformers(dtype):
    """Subnormal products (rounded, not flushed to zero), infinities, NaNs and exact ties of the rounding, in the
    kernel's vector lanes (heads of 64: 32 pairs) as in its tail (heads of 40)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    tiny = torch.finfo(torch.float32).tiny  # bf16 has float32's exponents: its subnormals lie below this
    for dim in (64, 40):
        g = torch.Generator().manual_seed(dim)
        qkv = torch.randn(1, 6, 4 * dim, generator=g).to(dtype)
        qkv[0, 0] *= tiny  # subnormal products with any cos, sin below 1
        qkv[0, 1, ::7] = float("inf")
        qkv[0, 2, ::5] = float("nan")
        qkv[0, 3] = 1 + 2.0 ** -7 * torch.arange(4 * dim).remainder(3)  # ties of bf16's rounding when times 1.5
        qkv[0, 4] = torch.finfo(dtype).max  # products that overflow
        angles = torch.rand(1, 6, dim // 2, generator=g) * 100
        angles[0, 3] = torch.pi / 3
        angles = torch.cat((angles, angles), -1)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        cos[0, 3], sin[0, 3] = 1.5, 0.75
        q, k = (p.view(1, 6, -1, dim).transpose(1, 2) for p in qkv[..., : 3 * dim].split([2 * dim, dim], -1))
        want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
        got = qkv.clone()
        torch.ops.pdserve.rotary_(got, cos, sin, 2, 1, dim)
        got_q, got_k = (p.view(1, 6, -1, dim).transpose(1, 2) for p in got[..., : 3 * dim].split([2 * dim, dim], -1))
        assert ((got_q.abs() < tiny) & (got_q != 0)).any()  # subnormal results
        torch.testing.assert_close(got_q, want_q, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got_k, want_k, rtol=0, atol=0, equal_nan=True)


def test_rope_attention_only_where_the_kernel_rotates_as_the_model_does():
    """The swap's check: a model whose apply_rotary_pos_emb differs (here: no sin term) keeps its own module."""
    from types import SimpleNamespace

    from transformers.models.llama import modeling_llama

    from common.engine.fused_attention import _kernel_matches

    other = SimpleNamespace(apply_rotary_pos_emb=lambda q, k, cos, sin: (q * cos, k * cos))
    for dtype in (torch.float32, torch.bfloat16):
        assert _kernel_matches(modeling_llama, dtype, 4, 2, 64)
        assert not _kernel_matches(other, dtype, 4, 2, 64)
    assert not _kernel_matches(SimpleNamespace(), torch.float32, 4, 2, 64)


@pytest.mark.parametrize("rows", [1, 3, 7, 8, 16, 17, 300])
@pytest.mark.parametrize("out_features,bias", [(64, False), (1000, True), (70, True)])
def test_bf16_linear_matches_float_matmul(rows, out_features, bias):
    """The engine's bf16 linear over its pair packing: every row count path (AVX512-BF16: 1, tiles of 8 and 4, the
    rest; AVX2: 1, tiles of 6 and of 1 to 5, row chunks), output features that are not a multiple of the 16 or 32
    a tile covers, bias; one bf16 rounding of the output."""
    if not torch.ops.pdserve.bf16_linear_supported():
        pytest.skip("this build has neither AVX512-BF16 nor AVX2 with FMA")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, 256, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16() if bias else None
    x = torch.randn(2, rows, 256, generator=g).bfloat16()[1:]  # [1, rows, K]
    packed = torch.ops.pdserve.pack_bf16_pairs(w)
    got = torch.ops.pdserve.bf16_linear(x, packed, b, out_features)
    expected = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == (1, rows, out_features)
    torch.testing.assert_close(got.float(), expected, rtol=2**-7, atol=1e-2)
    with pytest.raises(RuntimeError, match="even number"):
        torch.ops.pdserve.pack_bf16_pairs(torch.zeros(4, 3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="input features and n is"):
        torch.ops.pdserve.bf16_linear(x, packed, b, out_features + 64)


@pytest.mark.parametrize("rows", [1, 7, 13, 130])
@pytest.mark.parametrize("out_features,in_features", [(1000, 256), (70, 1408)])
def test_bf16_linear_over_int8_pairs_is_the_widened_weights_product_bit_for_bit(rows, out_features, in_features):
    """int8 values in the pair layout (an int8 bf16 model's weight, cpu_linear._int8_pairs) widened in registers:
    the same output, bit for bit, as the weight widened to bf16 and packed in pairs, in every regime (one row, the
    AVX-512 tiles of 8, 4 and 1 rows, AVX2's row tiles and its widened slices from 128 rows), the range's ends and
    output features past the last full block."""
    if not torch.ops.pdserve.bf16_linear_supported():
        pytest.skip("this build has no AVX512-BF16 or AVX2 with FMA")
    from common.engine import cpu_linear

    g = torch.Generator().manual_seed(rows + out_features)
    w = torch.randint(-128, 128, (out_features, in_features), generator=g, dtype=torch.int32).to(torch.int8)
    w[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    b = torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    pairs = cpu_linear._int8_pairs(w)
    got = torch.ops.pdserve.bf16_linear(x, pairs, b, out_features)
    want = torch.ops.pdserve.bf16_linear(x, torch.ops.pdserve.pack_bf16_pairs(w.bfloat16()), b, out_features)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features) and torch.equal(got, want)
    expected = torch.nn.functional.linear(x.float(), w.float(), b)
    torch.testing.assert_close(got.float(), expected, rtol=2**-7, atol=2**-7 * expected.abs().max().item())
    with pytest.raises(RuntimeError, match="bf16 or int8 packed weight"):
        torch.ops.pdserve.bf16_linear(x, pairs.to(torch.int16), b, out_features)


def test_bf16_linear_many_rows_over_column_slices():
    """Prefill-sized inputs with wide rows: the AVX2 build widens the weight a slice of columns at a time (512 at
    2048 inputs, so 1000 outputs take a full slice and a shorter last one) for torch's fp32 GEMM."""
    if not torch.ops.pdserve.bf16_linear_supported():
        pytest.skip("this build has neither AVX512-BF16 nor AVX2 with FMA")
    g = torch.Generator().manual_seed(7)
    w = torch.randn(1000, 2048, generator=g).bfloat16()
    b = torch.randn(1000, generator=g).bfloat16()
    x = torch.randn(130, 2048, generator=g).bfloat16()
    got = torch.ops.pdserve.bf16_linear(x, torch.ops.pdserve.pack_bf16_pairs(w), b.float(), 1000)
    expected = torch.nn.functional.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(got.float(), expected, rtol=2**-7, atol=5e-2)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 130, 520, 576, 611])
@pytest.mark.parametrize("out_features,in_features,bias", [(1000, 1024, True), (70, 64, False), (2048, 2816, True)])
def test_bf16_amx_linear_matches_float_matmul(rows, out_features, in_features, bias):
    """The AMX kernel over the pair packing: one A tile (1-16 rows) or several (17, 33: a partial last one, 130),
    groups of three blocks and the one or two left (70 = 4.4 blocks: 5 used of the 6 packed), bias; from 512 rows
    the slices widened for torch's GEMM (bias added before its one rounding) over the rows down to a multiple of
    64 (520: 512 and 8 on the tiles, 576: all, 611: 576 and 35). Results within bf16's rounding of the float
    product; input sizes not a multiple of 32 refused."""
    if not torch.ops.pdserve.bf16_amx_supported():
        pytest.skip("this build or CPU has no AMX-BF16")
    g = torch.Generator().manual_seed(rows * out_features)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    packed = torch.ops.pdserve.pack_bf16_pairs(w)
    got = torch.ops.pdserve.bf16_linear_amx(x.view(1, rows, -1), packed, None if b is None else b.float(), out_features)
    assert got.dtype == torch.bfloat16 and got.shape == (1, rows, out_features)
    expected = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(got[0].float(), expected, rtol=2**-7, atol=2 ** -7 * expected.abs().max().item())
    with pytest.raises(RuntimeError, match="a multiple of 32 needed"):
        w48 = torch.ops.pdserve.pack_bf16_pairs(torch.randn(16, 48).bfloat16())
        torch.ops.pdserve.bf16_linear_amx(torch.randn(1, 48).bfloat16(), w48, None, 16)


@pytest.mark.parametrize("rows", [520, 611, 1000])
def test_bf16_amx_linear_gives_the_gemm_whole_multiples_of_64_rows(rows):
    """oneDNN builds its GEMM anew for every row count it has not seen (milliseconds each), so from 512 rows it
    takes the rows down to a multiple of 64 and the tiles the rest: each part bit for bit what the kernel gives
    for those rows alone (the GEMM's rows a call of that multiple, the rest a tile call under 512 rows)."""
    if not torch.ops.pdserve.bf16_amx_supported():
        pytest.skip("this build or CPU has no AMX-BF16")
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(704, 512, generator=g).bfloat16(), torch.randn(704, generator=g)
    x = torch.randn(rows, 512, generator=g).bfloat16()
    packed = torch.ops.pdserve.pack_bf16_pairs(w)
    got = torch.ops.pdserve.bf16_linear_amx(x, packed, b, 704)
    bulk = rows // 64 * 64
    assert torch.equal(got[:bulk], torch.ops.pdserve.bf16_linear_amx(x[:bulk], packed, b, 704))
    assert torch.equal(got[bulk:], torch.ops.pdserve.bf16_linear_amx(x[bulk:], packed, b, 704))


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 65, 127, 130, 520])
@pytest.mark.parametrize("out_features,in_features,bias",
                         [(1000, 256, True), (70, 1408, False), (33, 2048, True), (1000, 2048, False)])  # fmt: skip
def test_fp32_linear_matches_float_matmul(rows, out_features, in_features, bias):
    """The engine's fp32 linear over its 16-feature blocks: one row, register tiles and the rows left after them
    in groups of 64 rows (65, 127 and 130 take two or three) over slices of inputs (1408 and 2048 take several),
    output features not a multiple of 16 (33: one partial block; 1000 = 62.5 blocks: tiles of 4 blocks and 1 to
    3 left on AVX-512), bias; on AVX-512 CPUs 520 rows widen the blocks for torch's GEMM, 1000 x 2048 in two
    slices."""
    if not torch.ops.pdserve.fp32_linear_supported():
        pytest.skip("this build has no AVX2 with FMA")
    g = torch.Generator().manual_seed(rows * out_features)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(2, rows, in_features, generator=g)[1:]  # [1, rows, K]
    got = torch.ops.pdserve.fp32_linear(x, torch.ops.pdserve.pack_fp32_blocks(w), b, out_features)
    assert got.dtype == torch.float32 and got.shape == (1, rows, out_features)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="float32 CPU tensor, got BFloat16"):
        torch.ops.pdserve.pack_fp32_blocks(w.bfloat16())
    with pytest.raises(RuntimeError, match="input features from 0 and n is"):
        torch.ops.pdserve.fp32_linear(x, torch.ops.pdserve.pack_fp32_blocks(w), b, out_features + 16)


@pytest.mark.parametrize("rows", [1, 7, 65, 520])
@pytest.mark.parametrize("out_features,in_features,k0,k",
                         [(1000, 256, 0, 256), (70, 1408, 0, 1408), (33, 2816, 1024, 1024), (40, 2816, 2048, 768)])
def test_fp32_linear_over_int8_blocks_is_the_widened_weights_product_bit_for_bit(rows, out_features, in_features, k0,
                                                                                 k):
    """int8 values in the 16-feature blocks (an int8 model's weight, cpu_linear._int8_blocks) widened in registers
    as the kernel loads them: the same sums, in the same order, as the weight widened and packed as floats, in
    every regime (one row, tiles, widened slices for torch's GEMM at 520 rows on AVX-512), and over a slice of
    the inputs from ``k0`` (the exact int32 chunks of W8A8 float sums)."""
    if not torch.ops.pdserve.fp32_linear_supported():
        pytest.skip("this build has no AVX2 with FMA")
    from common.engine import cpu_linear

    g = torch.Generator().manual_seed(rows + out_features)
    w = torch.randint(-128, 128, (out_features, in_features), generator=g, dtype=torch.int32).to(torch.int8)
    b = torch.randn(out_features, generator=g)
    x = torch.randn(rows, k, generator=g)
    blocks = cpu_linear._int8_blocks(w)
    got = torch.ops.pdserve.fp32_linear(x, blocks, b, out_features, k0)
    want = torch.ops.pdserve.fp32_linear(x, torch.ops.pdserve.pack_fp32_blocks(w[:, k0:k0 + k].float()), b,
                                         out_features)  # fmt: skip
    assert got.shape == (rows, out_features) and torch.equal(got, want)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w[:, k0:k0 + k].float(), b), rtol=1e-4, atol=1e-2)
    with pytest.raises(RuntimeError, match="input features from"):
        torch.ops.pdserve.fp32_linear(x, blocks, b, out_features, in_features - k + 1)
    with pytest.raises(RuntimeError, match="float32 or int8 packed weight"):
        torch.ops.pdserve.fp32_linear(x, blocks.to(torch.int16), b, out_features, k0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,k", [(1, 1024), (3, 2816), (17, 1000), (300, 96)])
def test_quantize_rows_and_dequantize_sums_round_where_torchao_rounds(dtype, rows, k):
    """W8A8's ends in one pass each, bit for bit torchao's tensor ops (common/engine/cpu_linear.py,
    _int8_dynamic_forward): each row's scale (amax / 127.5 in the row's dtype, floored at fp32's eps: the zero row),
    values at half steps (round half to even), the range's ends, 16-wide vectors and the elements after them; the
    sums scaled by the row's scale, rounded to the dtype, scaled by the weight's and the bias added, each rounded."""
    g = torch.Generator().manual_seed(rows * k)
    x = (torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 5).to(dtype)
    x[0, :5] = torch.tensor([0.5, 1.5, -2.5, 127.5, -0.5]).to(dtype)
    if rows > 2:
        x[2] = 0
    x_scale = (x.abs().amax(dim=1, keepdim=True) / 127.5).clamp(min=torch.finfo(torch.float32).eps).float()
    q = torch.round(x * (1.0 / x_scale)).clamp_(-128, 127).to(torch.int8)
    got_q, got_scale = torch.ops.pdserve.quantize_rows(x, False)
    assert torch.equal(got_q, q) and torch.equal(got_scale, x_scale)
    offset, offset_scale = torch.ops.pdserve.quantize_rows(x.t().contiguous().t(), True)  # strided rows too
    assert offset.dtype == torch.uint8 and torch.equal(offset, q.view(torch.uint8) ^ 128)
    assert torch.equal(offset_scale, x_scale)
    n = 777
    sums = torch.randint(-(2**20), 2**20, (rows, n), generator=g).float()
    w_scale = torch.rand(n, generator=g) * 0.01
    bias = torch.randn(n, generator=g).to(dtype)
    for b in (bias, None):
        y = sums * x_scale
        if dtype != torch.float32:
            y.copy_(y.to(dtype))
        y.mul_(w_scale)
        if b is not None:
            y.add_(b)
        got = torch.ops.pdserve.dequantize_sums(sums, x_scale, w_scale, b, dtype == torch.bfloat16)
        assert got.dtype == dtype and torch.equal(got, y.to(dtype))
    with pytest.raises(RuntimeError, match="float32 or bf16 CPU rows"):
        torch.ops.pdserve.quantize_rows(x.half(), False)
    with pytest.raises(RuntimeError, match="x_scale must be"):
        torch.ops.pdserve.dequantize_sums(sums, x_scale[:-1], w_scale, None, False)


def test_engine_without_kernels_keeps_the_pytorch_paths(tiny_model_dir):
    """``PDSERVE_CPU_KERNELS=0``: load() says why, the engine decodes through the gather/in-place paths."""
    code = (
        "from common.engine import cpu_kernels\n"
        "from common.engine.engine import LLMEngine\n"
        "from common.engine.config import EngineConfig\n"
        "from common.engine.loader import load_model\n"
        "from common.engine.sampling_params import SamplingParams\n"
        "assert not cpu_kernels.load() and 'PDSERVE_CPU_KERNELS=0' in cpu_kernels.unavailable_reason()\n"
        f"e = LLMEngine(load_model({tiny_model_dir('llama')!r}), EngineConfig())\n"
        "assert not e.runner.decode_kernel\n"
        "r = e.generate([[5, 6, 7]] * 2, SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))\n"
        "print([x.token_ids for x in r])\n"
    )
    env = dict(os.environ, PDSERVE_CPU_KERNELS="0")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    from common.engine.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.engine.loader import load_model
    from common.engine.sampling_params import SamplingParams

    engine = LLMEngine(load_model(tiny_model_dir("llama")), EngineConfig())
    assert engine.runner.decode_kernel
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    assert str([r.token_ids for r in engine.generate([[5, 6, 7]] * 2, params)]) == done.stdout.strip()


def test_prebuilt_kernels_load_where_no_compiler_is(tmp_path, tiny_model_dir):
    """``--prebuild`` compiles a variant (here the best this CPU runs) into a folder with its manifest; a process
    given that folder in PDSERVE_CPU_KERNELS_DIR, with no compiler it could use (CXX points nowhere, an empty
    extension cache), loads it and generates what the kernels built for this CPU generate."""
    fits = [(name, need) for name, _, need in cpu_kernels.VARIANTS.get(cpu_kernels._machine(), ())
            if need <= cpu_kernels.cpu_flags()]  # fmt: skip
    if not fits:
        pytest.skip("no prebuilt variant for this CPU")
    name, need = fits[0]
    folder = tmp_path / "kernels"
    cmd = [sys.executable, "-m", "common.engine.cpu_kernels", "--prebuild", str(folder), "--variants", name]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["torch"] == torch.__version__
    assert manifest["variants"] == [{"name": name, "file": f"pdserve_cpu_kernels_{name}.so", "cpu_flags": sorted(need)}]
    code = (
        "import torch\n"
        "from common.engine import cpu_kernels\n"
        "from common.engine.engine import LLMEngine\n"
        "from common.engine.config import EngineConfig\n"
        "from common.engine.loader import load_model\n"
        "from common.engine.sampling_params import SamplingParams\n"
        "assert cpu_kernels.load(), cpu_kernels.unavailable_reason()\n"
        "print(cpu_kernels.source())\n"
        "print(torch.ops.pdserve.bf16_linear_supported())\n"
        f"e = LLMEngine(load_model({tiny_model_dir('llama')!r}), EngineConfig())\n"
        "assert e.runner.decode_kernel\n"
        "p = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)\n"
        "r = e.generate([[5, 6, 7], list(range(4, 60))], p)\n"
        "print([x.token_ids for x in r])\n"
    )
    env = dict(os.environ, PDSERVE_CPU_KERNELS_DIR=str(folder), CXX=str(tmp_path / "no-compiler"),
               TORCH_EXTENSIONS_DIR=str(tmp_path / "empty-cache"))  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    where, bf16_linear, tokens = done.stdout.strip().splitlines()
    assert where == f"prebuilt {name} from {folder}"
    assert bf16_linear == str(name != "x86-64")  # the baseline build has no vector bf16 path
    assert not (tmp_path / "empty-cache").exists() or not any((tmp_path / "empty-cache").iterdir())
    from common.engine.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.engine.loader import load_model
    from common.engine.sampling_params import SamplingParams

    engine = LLMEngine(load_model(tiny_model_dir("llama")), EngineConfig())
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    assert str([r.token_ids for r in engine.generate([[5, 6, 7], list(range(4, 60))], params)]) == tokens


def test_prebuilt_kernels_that_do_not_fit_are_left_for_a_build(tmp_path, monkeypatch, caplog):
    """A manifest for another torch, or with no variant this CPU runs, loads nothing and says why: load() then
    compiles for this CPU as it would without the folder."""
    folder = tmp_path / "kernels"
    folder.mkdir()
    monkeypatch.setenv(cpu_kernels.PREBUILT_ENV, str(folder))
    assert not cpu_kernels._load_prebuilt() and "no readable manifest.json" in caplog.text
    variant = {"name": "future", "file": "missing.so", "cpu_flags": ["avx2", "no-such-flag"]}
    for torch_version, expected in (("0.0.1", "for torch 0.0.1"), (torch.__version__, "no prebuilt CPU kernel")):
        manifest = {"torch": torch_version, "machine": cpu_kernels._machine(), "variants": [variant]}
        (folder / "manifest.json").write_text(json.dumps(manifest))
        caplog.clear()
        assert not cpu_kernels._load_prebuilt()
        assert expected in caplog.text


def test_an_engine_packed_for_prefill_keeps_onednn_layouts_for_bf16_on_amx(tiny_model_dir):
    """``weight_layout="prefill"`` (a prefill worker's default): on CPUs with AMX its bf16 weights keep oneDNN's
    layout (its AMX GEMM runs batches of prompt tokens without the pair layout's widening), elsewhere the same
    layouts as for decode; either way the same tokens as the decode-layout engine."""
    from common.engine.config import EngineConfig
    from common.engine.cpu_linear import FusedGatedMLP, PackedLinear
    from common.engine.engine import LLMEngine
    from common.engine.loader import load_model
    from common.engine.sampling_params import SamplingParams

    model = tiny_model_dir("llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                           num_key_value_heads=2)  # fmt: skip
    engines = {layout: LLMEngine(load_model(model, dtype="bfloat16"), EngineConfig(weight_layout=layout))
               for layout in ("decode", "prefill")}  # fmt: skip
    layouts = {name: sorted({m.layout for m in e.runner.model.modules() if isinstance(m, PackedLinear)})
               for name, e in engines.items()}  # fmt: skip
    mlps = {name: [type(m.gate_up).__name__ if m.gate_up is not None else "apart" for m in e.runner.model.modules()
                   if isinstance(m, FusedGatedMLP)] for name, e in engines.items()}  # fmt: skip
    if "amx_bf16" in cpu_kernels.cpu_flags() and torch.ops.pdserve.bf16_amx_supported():
        assert layouts == {"decode": ["bf16_amx"], "prefill": ["onednn"]}
        # and gate and up as two oneDNN products, the activation from both (cpu_linear._keep_apart)
        assert mlps == {"decode": ["FusedLinear"] * 4, "prefill": ["apart"] * 4}
    else:
        assert layouts["prefill"] == layouts["decode"]
        assert mlps["prefill"] == mlps["decode"] == ["FusedLinear"] * 4  # one a layer
    prompts = [[5 + i * 7 + j for j in range(40 + 9 * i)] for i in range(3)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = {name: [r.token_ids for r in e.generate(prompts, params)] for name, e in engines.items()}
    assert tokens["prefill"] == tokens["decode"]
    with pytest.raises(ValueError, match="weight_layout must be one of decode, prefill"):
        EngineConfig(weight_layout="auto")


def test_a_prefill_engine_on_amx_runs_gate_and_up_apart_wherever_it_runs(tiny_model_dir, monkeypatch):
    """The AMX prefill worker's MLP (gate and up as two oneDNN products, ``silu_mul_parts`` over both) on any CPU,
    its flags made to say AMX: the same tokens as the fused decode layout. Without AMX in the flags a prefill engine
    keeps the decode layout's fused MLPs (a build without the bf16 kernel packs oneDNN's layout for both roles)."""
    from common.engine.config import EngineConfig
    from common.engine.cpu_linear import FusedGatedMLP
    from common.engine.engine import LLMEngine
    from common.engine.loader import load_model
    from common.engine.sampling_params import SamplingParams

    if not cpu_kernels.load() or not torch.ops.pdserve.bf16_linear_supported():
        pytest.skip("needs the engine's kernels with bf16_linear")
    flags = cpu_kernels.cpu_flags()
    if not ({"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags):
        pytest.skip("oneDNN packs bf16 weights only on CPUs with AVX-512 BW/VL/DQ or AVX-NE-CONVERT: elsewhere the "
                    "prefill layout keeps stock nn.Linear")
    model = tiny_model_dir("llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                           num_key_value_heads=2)  # fmt: skip
    prompts = [[5 + i * 7 + j for j in range(40 + 9 * i)] for i in range(3)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    decode = LLMEngine(load_model(model, dtype="bfloat16"), EngineConfig(weight_layout="decode"))
    want = [r.token_ids for r in decode.generate(prompts, params)]
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"amx_bf16", "amx_tile"}))
    prefill = LLMEngine(load_model(model, dtype="bfloat16"), EngineConfig(weight_layout="prefill"))
    mlps = [m for m in prefill.runner.model.modules() if isinstance(m, FusedGatedMLP)]
    assert len(mlps) == 4 and all(m.gate_up is None for m in mlps)
    assert [r.token_ids for r in prefill.generate(prompts, params)] == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 16, 700])
def test_write_kv_puts_each_row_where_index_copy_does(dtype, tokens):
    """K and V as a fused q/k/v product leaves them (strided views) into a cache's slots: the same cache as
    stack + index_copy_; a slot outside the cache is refused before anything is written."""
    from common.engine.kv_cache import KVCacheSpec, PagedKVCache

    spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, dtype=dtype)
    caches = [PagedKVCache(spec, 64), PagedKVCache(spec, 64)]
    caches[1].write_kernel = True
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (8 + 4 + 4) * 64, generator=g).to(dtype)
    key = qkv[:, 8 * 64 : 12 * 64].view(tokens, 4, 64).transpose(0, 1)  # [H, T, D], token stride 1024
    value = qkv[:, 12 * 64 :].view(tokens, 4, 64).transpose(0, 1)
    slots = torch.randperm(64 * 16, generator=g)[:tokens]
    for cache in caches:
        cache.write(1, cache.write_index(slots), key, value)
    assert torch.equal(caches[0].data, caches[1].data) and caches[1].data[1].abs().sum() > 0
    assert caches[1].data[0].abs().sum() == 0
    before = caches[1].data.clone()
    bad = caches[1].write_index(slots)
    bad[-1] = caches[1]._by_slot.shape[1]
    with pytest.raises(RuntimeError, match="outside the cache"):
        caches[1].write(0, bad, key, value)
    assert torch.equal(caches[1].data, before)
    with pytest.raises(RuntimeError, match="cache's dtype"):
        torch.ops.pdserve.write_kv_(caches[1]._by_slot[0], caches[1].write_index(slots), key.double(), value.double())
