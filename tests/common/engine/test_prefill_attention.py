"""The engine's flash attention for prefill steps on AVX-512 CPUs, bf16 (AVX512-BF16) and fp32, or both computed in
float on AVX2 CPUs (``torch.ops.pdserve.prefill_attention``, ``paged_prefill_attention``:
common/engine/csrc/prefill_attention.cpp). The kernels against float64 attention: in bf16 within 1.6x of the error
of that exact result rounded to bf16 (torch's CPU flash attention is as far off: both round the probabilities to
bf16 for their products, the AVX2 path does not; 1.1-1.4x measured here, a scale 1% off 3.7-6.9x), in fp32 within
2e-5 of it: several prompts packed, an empty one, grouped-query heads, head sizes 16 to 128, sliding windows, the
strided views of a fused q|k|v product, chunks after prefixes read from a paged cache; bad arguments raise. In an
engine: every layer of a prefill step runs them (checked once against SDPA or the gathered path), bf16 logits within
bf16 rounding of stock bf16's, fp32 tokens stock ``generate``'s, and ``prefill_attention`` chooses them or not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import common.engine.attention as attention
from common.engine import cpu_kernels
from common.engine.attention_math import LogitExtras, attend
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.loader import load_model
from common.engine.sampling_params import SamplingParams
from tests.common.engine.test_engine_oracle import GREEDY, make_prompts, next_logits_and_stock
from tests.conftest import hf_greedy

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels unavailable")
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]


def needs(dtype: torch.dtype) -> None:
    if not torch.ops.pdserve.prefill_attention_supported(dtype):
        pytest.skip(f"no {dtype} prefill attention kernel on this CPU (AVX2 and FMA, or AVX-512 with AVX512-BF16 for "
                    "bf16)")


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` (the kernel's, any dtype) against float64 ``want``: bf16 within its rounding (module doc), fp32 2e-5."""
    got = got.double()
    assert not got.isnan().any()
    err = (got - want).abs()
    if dtype == torch.float32:
        assert err.max() <= 2e-5 * max(1.0, float(want.abs().max())), err.max()
        return
    floor = (want.to(torch.bfloat16).double() - want).abs()  # the output's own rounding
    assert err.max() <= max(3 * floor.max(), 1e-2), (err.max(), floor.max())
    assert err.mean() <= 1.6 * floor.mean(), (err.mean(), floor.mean())


def packed_case(lens, heads, kv_heads, dim, seed=0, spread=1.0, dtype=torch.bfloat16):
    """q, k, v as [T, H, D] views of one fused [T, heads + 2 kv_heads, D] tensor (as the engine's step makes
    them), and the prompts' bounds."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lens), heads + 2 * kv_heads, dim, generator=g)
    qkv[:, :heads] *= spread  # sharper softmaxes
    qkv = qkv.to(dtype)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    return q, k, v, torch.tensor([0, *lens]).cumsum(0).to(torch.int32)


def reference(q, k, v, bounds, scale, window, dtype=torch.float64):
    """Per-prompt attention (causal, optional window) in ``dtype`` by SDPA with a mask; float output."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        if a == b:
            continue
        qq, kk, vv = (t[a:b].to(dtype).transpose(0, 1) for t in (q, k, v))
        kk, vv = kk.repeat_interleave(group, 0), vv.repeat_interleave(group, 0)
        pos = torch.arange(b - a)
        mask = pos[None, :] <= pos[:, None]
        if window:
            mask &= pos[None, :] > pos[:, None] - window
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)
        out[a:b] = o.transpose(0, 1).double()
    return out


def run_kernel(q, k, v, bounds, scale, window):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    torch.ops.pdserve.prefill_attention(out, q, k, v, bounds, scale, window)
    return out


@pytest.mark.parametrize("lens,heads,kv_heads,dim,window,spread", [
    ([1], 2, 1, 64, 0, 1.0),
    ([5, 70, 129], 4, 2, 64, 0, 1.0),
    ([200], 4, 4, 128, 0, 3.0),
    ([300, 64], 6, 2, 96, 0, 1.0),
    ([257], 4, 2, 64, 50, 1.0),
    ([100, 3], 2, 1, 16, 7, 2.0),
    ([3, 0, 65], 2, 2, 32, 0, 1.0),
    ([64, 128, 63, 65], 8, 2, 64, 64, 4.0),
    ([150, 40], 4, 2, 160, 0, 2.0),  # head dims past 128 (Gemma's 256): O^T's dims past 64 in L1 on AMX
    ([90, 200], 4, 1, 256, 70, 2.0),
])  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_is_within_rounding_of_float64(lens, heads, kv_heads, dim, window, spread, dtype):
    needs(dtype)
    q, k, v, bounds = packed_case(lens, heads, kv_heads, dim, seed=len(lens) + dim, spread=spread, dtype=dtype)
    scale = dim**-0.5
    assert_close(run_kernel(q, k, v, bounds, scale, window), reference(q, k, v, bounds, scale, window), dtype)


@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("window", [0, 90])
def test_scores_that_keep_growing_along_the_keys(dim, window):
    """Each key scores higher than the last by more than the AMX path lets a row's maximum lag (2^8): every
    chunk of keys rescales the outputs kept in tiles; the result stays within bf16 rounding of float64."""
    needs(torch.bfloat16)
    q, k, v, bounds = packed_case([300, 130], 4, 2, dim, seed=dim + window)
    ramp = torch.arange(430, dtype=torch.float32).remainder(300)[:, None, None] / 300.0
    q = (q.float().abs() + 0.5).to(torch.bfloat16)  # a query's scores rise with the key
    k = (ramp * 4.0).expand(k.shape).to(torch.bfloat16).contiguous()
    scale = dim**-0.5 * 8
    assert_close(run_kernel(q, k, v, bounds, scale, window), reference(q, k, v, bounds, scale, window), torch.bfloat16)


def test_a_wrong_scale_or_window_is_caught():
    """What the test above would see of a kernel that got the scale 1% wrong or ignored the window."""
    needs(torch.bfloat16)
    q, k, v, bounds = packed_case([200, 90], 4, 2, 64, seed=3, spread=2.0)
    scale = 64**-0.5
    want = reference(q, k, v, bounds, scale, 20)
    floor = (want.to(torch.bfloat16).double() - want).abs().mean()
    assert (run_kernel(q, k, v, bounds, scale, 20).double() - want).abs().mean() <= 1.6 * floor
    for wrong_scale, wrong_window in ((scale * 1.01, 20), (scale, 0)):
        err = (run_kernel(q, k, v, bounds, wrong_scale, wrong_window).double() - want).abs().mean()
        assert err > 1.6 * floor, (wrong_scale, wrong_window)


def test_kernel_refuses_what_it_cannot_read():
    needs(torch.bfloat16)
    q, k, v, bounds = packed_case([10, 20], 4, 2, 64)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    call = torch.ops.pdserve.prefill_attention
    with pytest.raises(RuntimeError, match="bounds outside the tokens"):
        call(out, q, k, v, torch.tensor([0, 10, 31], dtype=torch.int32), 0.1, 0)
    with pytest.raises(RuntimeError, match="must not decrease"):
        call(out, q, k, v, torch.tensor([0, 20, 10, 30], dtype=torch.int32), 0.1, 0)
    with pytest.raises(RuntimeError, match="int32"):
        call(out, q, k, v, bounds.long(), 0.1, 0)
    with pytest.raises(RuntimeError, match="one dtype"):
        call(out.float(), q, k, v, bounds, 0.1, 0)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        call(out.half(), q.half(), k.half(), v.half(), bounds, 0.1, 0)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        call(out[:, :3], q[:, :3], k, v, bounds, 0.1, 0)
    q40, k40, v40, _ = packed_case([10, 20], 4, 2, 40)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        call(torch.empty(q40.shape, dtype=torch.bfloat16), q40, k40, v40, bounds, 0.1, 0)


def attention_with_extras(q, k, v, mask, scale, softcap, sinks):
    """One prompt's attention (q [H, Q, D], k and v [H, K, D], mask [Q, K] True where visible) with a soft cap (0:
    none) and sink logits ([H] or None), as float64 [Q, H, D] and as the plain-op path the kernels replace computes
    it in q's dtype (common/engine/attention_math.py: Gemma 2's and GPT-OSS's eager attention, op for op)."""
    qd, kd, vd = q.double(), k.double(), v.double()
    logits = qd @ kd.transpose(1, 2) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        column = sinks.double()[:, None, None].expand(logits.shape[0], logits.shape[1], 1)
        exact = torch.softmax(torch.cat([logits, column], -1), -1)[..., :-1] @ vd
    else:
        exact = torch.softmax(logits, -1) @ vd
    extras = LogitExtras(softcap or None, None if sinks is None else sinks.to(q.dtype))
    eager = attend(q[None], k[None], v[None], extras, scale=scale, mask=mask)[0]
    return exact.transpose(0, 1), eager.double().transpose(0, 1)


def assert_as_close_as_plain_ops(got, want, eager, dtype):
    """``got`` within 2e-5 of float64 ``want`` in fp32; in bf16 its largest error within 3x the output's own rounding
    and its mean error no larger than the plain-op path's (``eager``): bf16 probabilities over a row flattened by a
    cap or dimmed by a sink lose more against the smaller outputs' rounding than in plain attention (1.1-1.6x
    measured here) and the plain ops lose more still (1.7-10.9x)."""
    if dtype == torch.float32:
        assert_close(got, want, dtype)
        return
    err, floor = (got.double() - want).abs(), (want.to(torch.bfloat16).double() - want).abs()
    assert not got.isnan().any()
    assert err.max() <= max(3 * floor.max(), 1e-2), (err.max(), floor.max())
    assert err.mean() <= (eager - want).abs().mean(), (err.mean(), (eager - want).abs().mean(), floor.mean())


def reference_with_extras(q, k, v, bounds, scale, window, softcap, sinks):
    """Per prompt: float64, and the plain ops in q's dtype (:func:`attention_with_extras`)."""
    exact, eager = torch.zeros(q.shape, dtype=torch.float64), torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        if a == b:
            continue
        qq, kk, vv = (t[a:b].transpose(0, 1) for t in (q, k, v))
        pos = torch.arange(b - a)
        mask = pos[None, :] <= pos[:, None]
        if window:
            mask &= pos[None, :] > pos[:, None] - window
        exact[a:b], eager[a:b] = attention_with_extras(qq, kk.repeat_interleave(group, 0),
                                                       vv.repeat_interleave(group, 0), mask, scale, softcap, sinks)
    return exact, eager


def extras_of(kind, heads, seed):
    """(soft cap, sinks) for ``kind``: a cap of 2 over scores of spread 3 (most are bent); sink logits 4 +- 2, as
    large as a long row's top scores (smaller ones change too little of a row of hundreds of keys to be seen)."""
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2.0 + 4.0
    return {"softcap": (2.0, None), "sinks": (0.0, sinks), "both": (2.0, sinks)}[kind]


@pytest.mark.parametrize("lens,heads,kv_heads,dim,window", [
    ([1, 9], 2, 1, 64, 0),
    ([5, 70, 129], 4, 2, 64, 0),
    ([300, 64], 6, 2, 96, 0),
    ([257, 3], 4, 2, 64, 50),
    ([64, 128, 0, 65], 8, 2, 128, 64),
    ([130, 33], 4, 2, 256, 0),
    ([70], 2, 1, 192, 40),
])  # fmt: skip
@pytest.mark.parametrize("kind", ["softcap", "sinks", "both"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_with_a_soft_cap_or_sinks_is_within_rounding_of_float64(lens, heads, kv_heads, dim, window, kind,
                                                                       dtype):  # fmt: skip
    """Gemma 2's soft cap and GPT-OSS's sink logits (bf16 on CPUs with AMX: the tile path for these head dims). The
    result without them is far outside the tolerance: the kernel applies them."""
    needs(dtype)
    q, k, v, bounds = packed_case(lens, heads, kv_heads, dim, seed=len(lens) + dim, spread=3.0, dtype=dtype)
    softcap, sinks = extras_of(kind, heads, seed=dim)
    scale = dim**-0.5
    got = torch.full(q.shape, float("nan"), dtype=dtype)
    torch.ops.pdserve.prefill_attention(got, q, k, v, bounds, scale, window, softcap, sinks)
    want, eager = reference_with_extras(q, k, v, bounds, scale, window, softcap, sinks)
    assert_as_close_as_plain_ops(got, want, eager, dtype)
    plain, _ = reference_with_extras(q, k, v, bounds, scale, window, 0.0, None)
    floor = (want.to(torch.bfloat16).double() - want).abs().mean()
    assert (plain - want).abs().mean() > 10 * floor


def test_a_bf16_soft_cap_near_its_logits_is_checked_against_float(monkeypatch):
    """The first call of a kind is checked against the plain ops, in float where the model is bf16: Gemma 2's
    eager attention in bf16 rounds every logit before its cap of 50 (steps of 0.125-0.25 up there), and a kernel
    computing them in float differed from it by more than bf16 rounding, so it was dropped (prompts then ran on
    the plain ops, 7x slower at 2,048 tokens). Here logits reach ~40 and the kernel stays, within rounding."""
    needs(torch.bfloat16)
    monkeypatch.setattr(attention, "_VARLEN", {})
    q, k, v, bounds = packed_case([300], 4, 2, 64, seed=5, spread=20.0)
    extras = LogitExtras(softcap=50.0)
    logits = (q.double()[:, ::2] * k.double()).sum(-1) / 8
    assert logits.abs().max() > 30  # near the cap
    group = attention.AttentionGroup(gather_index=None, query_pos=torch.arange(300)[None], fresh_prompt=True,
                                     fresh_bounds=bounds, num_keys=300, cpu_prefill_kernel=True)  # fmt: skip
    out = torch.zeros(q.shape, dtype=torch.bfloat16)
    as_model = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # [1, H, T, D] as the model hands them
    attention._fresh_attention(group, *as_model, out, 0.125, None, extras)
    kernel = attention._VARLEN[attention.cpu_kernel_key(torch.bfloat16)]
    assert kernel is not None and kernel.verified == {"causal+softcap"}
    want, eager = reference_with_extras(q, k, v, bounds, 0.125, 0, 50.0, None)
    assert_as_close_as_plain_ops(out, want, eager, torch.bfloat16)
    assert (eager - want).abs().max() > 1e-2 * want.abs().max()  # what a check against the bf16 plain ops saw


def test_kernel_refuses_extras_it_cannot_read():
    needs(torch.float32)
    q, k, v, bounds = packed_case([10, 20], 4, 2, 64, dtype=torch.float32)
    out = torch.empty(q.shape)
    call = torch.ops.pdserve.prefill_attention
    with pytest.raises(RuntimeError, match="softcap must be positive"):
        call(out, q, k, v, bounds, 0.1, 0, -1.0, None)
    for sinks, what in ((torch.zeros(3), r"\[3\]"), (torch.zeros(4, dtype=torch.bfloat16), "BFloat16"),
                        (torch.zeros(8)[::2], "not contiguous")):  # fmt: skip
        refusal = r"sinks must be a contiguous float \[Hq\] tensor \(Hq = 4\), got .*" + what
        with pytest.raises(RuntimeError, match=refusal):
            call(out, q, k, v, bounds, 0.1, 0, 0.0, sinks)


@pytest.fixture
def counted_kernel(monkeypatch):
    """The CPU kernel as the engine's attention gets it, counting its calls (and its checks' outcomes)."""
    monkeypatch.setattr(attention, "_VARLEN", {})
    inner = attention._cpu_prefill_varlen()
    calls = []

    def run(q, k, v, bounds, longest, scale, window):
        calls.append((q.shape[0], window, q.is_contiguous()))

        return inner.fn(q, k, v, bounds, longest, scale, window)

    kernel = attention.VarlenKernel(inner.name, run, strided=True)
    monkeypatch.setitem(attention._VARLEN, attention.cpu_kernel_key(torch.bfloat16), kernel)
    return kernel, calls


@pytest.mark.parametrize("arch,overrides,lens,mode", [
    ("llama", {}, [5, 50, 200], "causal"),
    ("mistral", {"sliding_window": 24}, [17, 70, 3, 41], "window"),
])  # fmt: skip
def test_an_engine_prefills_whole_prompts_by_the_kernel(arch, overrides, lens, mode, tiny_model_dir,
                                                        counted_kernel):  # fmt: skip
    from transformers import AutoModelForCausalLM

    needs(torch.bfloat16)
    kernel, calls = counted_kernel
    d = tiny_model_dir(arch, **overrides)
    engine = LLMEngine(load_model(d, dtype="bfloat16"), EngineConfig(prefill_attention="kernel"))
    assert engine.runner.prefill_kernel
    reference = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    exact = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    calls.clear()  # the engine's own warm-up at start
    for p in make_prompts(engine.vocab_size, lens=lens, seed=4):
        engine.add_request(p, SamplingParams(max_new_tokens=2, **GREEDY))
    sched = engine.scheduler.schedule()
    for (row, ref), r in zip(next_logits_and_stock(engine, reference, sched.scheduled), sched.scheduled):
        # as far from fp32 as stock bf16 is (two bf16 paths round apart: on an AMX Xeon stock bf16 was 0.11-0.23
        # from fp32 in these logits, the engine 0.13-0.22, and the two 0.18 apart)
        with torch.no_grad():
            fp32 = exact(torch.tensor([r[0].all_token_ids])).logits[0, -1]
        assert (row - fp32).abs().max().item() <= 1.25 * (ref - fp32).abs().max().item() + 0.05
        assert int(row.argmax()) == int(ref.argmax())
    window = overrides.get("sliding_window")
    # every layer (twice: the first step also checks the flat layer loop against the model's own forward), on the
    # step's strided views (no copies of q, k, v)
    assert calls == [(sum(lens), window, False)] * engine.kv_spec.num_layers * (1 + (engine.runner.flat is not None))
    assert kernel.verified == {mode} and not kernel.failed


def test_prefill_attention_chooses(tiny_model_dir, counted_kernel):
    needs(torch.bfloat16)
    needs(torch.float32)
    d = tiny_model_dir("llama")
    amx = "amx_bf16" in cpu_kernels.cpu_flags()
    # AMX CPUs: bf16 on tiles for head dims that are multiples of 32 up to 256 (auto takes the kernel there, SDPA
    # for other head dims)
    dims = (-32, 0, 16, 32, 48, 64, 96, 128, 160, 208, 256, 288)
    assert [torch.ops.pdserve.prefill_attention_amx(d) for d in dims] == [
        d > 0 and d % 32 == 0 and d <= 256 and amx for d in dims]
    assert attention.cpu_prefill_kernel_chosen("auto", torch.bfloat16, 208) is not amx
    assert attention.cpu_prefill_kernel_chosen("auto", torch.bfloat16, 256)
    assert attention.cpu_prefill_kernel_chosen("kernel", torch.bfloat16, 208)
    # a soft cap or sinks: SDPA computes neither, so auto takes the kernel on AMX CPUs too, for any head dim
    assert attention.cpu_prefill_kernel_chosen("auto", torch.bfloat16, 208, extras=True)
    assert not attention.cpu_prefill_kernel_chosen("sdpa", torch.bfloat16, 64, extras=True)
    head_dim = LLMEngine(load_model(d, dtype="float32")).kv_spec.head_dim
    for choice, dtype, want in (("kernel", "bfloat16", True), ("auto", "bfloat16", not amx or head_dim % 32 == 0),
                                ("sdpa", "bfloat16", False), ("kernel", "float32", True), ("auto", "float32", True),
                                ("sdpa", "float32", False), ("kernel", "float16", False)):  # fmt: skip
        engine = LLMEngine(load_model(d, dtype=dtype), EngineConfig(prefill_attention=choice))
        assert engine.runner.prefill_kernel is want, (choice, dtype)
    engine = LLMEngine(load_model(d, dtype="bfloat16"), EngineConfig(prefill_attention="kernel", cpu_kernels=False))
    assert not engine.runner.prefill_kernel
    with pytest.raises(ValueError, match="prefill_attention must be one of auto, kernel, sdpa"):
        EngineConfig(prefill_attention="flash")
    _, calls = counted_kernel
    sdpa = LLMEngine(load_model(d, dtype="bfloat16"), EngineConfig(prefill_attention="sdpa"))
    sdpa.generate([[5] * 30], SamplingParams(max_new_tokens=2, **GREEDY))
    assert calls == []


def paged_case(seqs, heads, kv_heads, dim, block_size=16, seed=0, spread=1.0, dtype=torch.bfloat16):
    """A paged cache holding each sequence's keys [0, start + n) in scattered blocks, the step's queries
    (n rows per sequence, packed, strided as the step's are), the block table and spans (row, position, n)."""
    from common.engine.kv_cache import KVCacheSpec, PagedKVCache

    g = torch.Generator().manual_seed(seed)
    spec = KVCacheSpec(num_layers=2, num_kv_heads=kv_heads, head_dim=dim, block_size=block_size, dtype=dtype)
    width = max(-(-(s + n) // block_size) for s, n in seqs)
    cache = PagedKVCache(spec, len(seqs) * width + 3)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    table = torch.randperm(cache.data.shape[3], generator=g)[: len(seqs) * width].view(len(seqs), width)
    rows = sum(n for _, n in seqs)
    q = (torch.randn(rows, heads + 8, dim, generator=g) * spread).to(dtype)[:, 3 : 3 + heads]  # strided
    starts = torch.tensor([0] + [n for _, n in seqs]).cumsum(0)[:-1]
    spans = torch.tensor([[int(r), s, n] for r, (s, n) in zip(starts, seqs)], dtype=torch.long).view(-1, 3)
    return q, cache, table, spans


def paged_reference(q, cache, layer, table, spans, scale, window, dtype=torch.float64):
    out = torch.zeros(q.shape, dtype=torch.float64)
    kv = cache.data[layer]  # [2, H, NB, bs, D]
    bs = cache.spec.block_size
    group = q.shape[1] // kv.shape[1]
    for b, (row, start, n) in enumerate(spans.tolist()):
        if n == 0:
            continue
        keys = torch.arange(start + n)
        blocks = table[b, keys // bs]
        k = kv[0][:, blocks, keys % bs].to(dtype).repeat_interleave(group, 0)  # [Hq, K, D]
        v = kv[1][:, blocks, keys % bs].to(dtype).repeat_interleave(group, 0)
        pos = torch.arange(start, start + n)[:, None]
        mask = keys[None, :] <= pos
        if window:
            mask &= keys[None, :] > pos - window
        o = F.scaled_dot_product_attention(q[row : row + n].to(dtype).transpose(0, 1), k, v, attn_mask=mask,
                                           scale=scale)  # fmt: skip
        out[row : row + n] = o.transpose(0, 1).double()
    return out


@pytest.mark.parametrize("seqs,heads,kv_heads,dim,window,block_size", [
    ([(0, 40)], 2, 1, 64, 0, 16),
    ([(64, 64), (100, 7), (3, 130)], 4, 2, 64, 0, 16),  # chunks after prefixes, one a block's edge off
    ([(500, 33), (0, 1), (17, 0)], 4, 4, 128, 0, 32),  # a long prefix, a lone token, an empty span
    ([(200, 80), (31, 50)], 6, 2, 96, 45, 16),  # sliding window across the prefix
    ([(100, 60), (0, 35)], 4, 2, 256, 0, 16),  # Gemma's head dim
])  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_kernel_reads_the_cache_within_rounding(seqs, heads, kv_heads, dim, window, block_size, dtype):
    needs(dtype)
    q, cache, table, spans = paged_case(seqs, heads, kv_heads, dim, block_size, seed=dim + len(seqs), spread=2.0,
                                        dtype=dtype)  # fmt: skip
    scale = dim**-0.5
    got = torch.zeros(q.shape, dtype=dtype)
    torch.ops.pdserve.paged_prefill_attention(got, q, cache.data, 1, table, spans, scale, window)
    want = paged_reference(q, cache, 1, table, spans, scale, window)
    assert_close(got, want, dtype)
    other = torch.empty_like(got)  # another layer's keys give other outputs: the layer is read, not assumed
    torch.ops.pdserve.paged_prefill_attention(other, q, cache.data, 0, table, spans, scale, window)
    assert (other.double() - want).abs().mean() > 0.05


@pytest.mark.parametrize("seqs,heads,kv_heads,dim,window", [
    ([(64, 64), (100, 7), (3, 130)], 4, 2, 64, 0),
    ([(200, 80), (31, 50)], 6, 2, 96, 45),
])  # fmt: skip
@pytest.mark.parametrize("kind", ["softcap", "both"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_kernel_with_a_soft_cap_or_sinks_is_within_rounding(seqs, heads, kv_heads, dim, window, kind, dtype):
    needs(dtype)
    q, cache, table, spans = paged_case(seqs, heads, kv_heads, dim, seed=dim + len(seqs), spread=3.0, dtype=dtype)
    softcap, sinks = extras_of(kind, heads, seed=dim + 1)
    scale = dim**-0.5
    got = torch.zeros(q.shape, dtype=dtype)
    torch.ops.pdserve.paged_prefill_attention(got, q, cache.data, 1, table, spans, scale, window, softcap, sinks)
    want, eager = torch.zeros(q.shape, dtype=torch.float64), torch.zeros(q.shape, dtype=torch.float64)
    kv = cache.data[1]
    bs, group = cache.spec.block_size, heads // kv_heads
    for b, (row, start, n) in enumerate(spans.tolist()):
        keys = torch.arange(start + n)
        blocks = table[b, keys // bs]
        k = kv[0][:, blocks, keys % bs].repeat_interleave(group, 0)
        v = kv[1][:, blocks, keys % bs].repeat_interleave(group, 0)
        pos = torch.arange(start, start + n)[:, None]
        mask = (keys[None, :] <= pos) & ((keys[None, :] > pos - window) if window else True)
        want[row : row + n], eager[row : row + n] = attention_with_extras(q[row : row + n].transpose(0, 1), k, v,
                                                                          mask, scale, softcap, sinks)
    assert_as_close_as_plain_ops(got, want, eager, dtype)
    assert (paged_reference(q, cache, 1, table, spans, scale, window) - want).abs().mean() > 0.01


def test_paged_kernel_refuses_what_would_read_out_of_bounds():
    needs(torch.bfloat16)
    q, cache, table, spans = paged_case([(20, 10)], 2, 1, 64)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    call = torch.ops.pdserve.paged_prefill_attention
    with pytest.raises(RuntimeError, match="out of range"):
        call(out, q, cache.data, 0, torch.full_like(table, 10_000), spans, 0.1, 0)
    with pytest.raises(RuntimeError, match="past the block table"):
        call(out, q, cache.data, 0, table, torch.tensor([[0, 30, 10]]), 0.1, 0)
    with pytest.raises(RuntimeError, match="outside q"):
        call(out, q, cache.data, 0, table, torch.tensor([[5, 20, 10]]), 0.1, 0)
    with pytest.raises(RuntimeError, match="layer out of range"):
        call(out, q, cache.data, 2, table, spans, 0.1, 0)


@pytest.mark.parametrize("arch,overrides,mode", [("llama", {}, "causal"),
                                                 ("mistral", {"sliding_window": 24}, "window")])  # fmt: skip
def test_an_engine_prefills_long_prompts_in_chunks_by_the_kernel(arch, overrides, mode, tiny_model_dir, monkeypatch):
    """Prompts longer than the step's budget: the chunks after the first read their keys from the cache by the
    kernel (checked once against the gathered path); the first token's logprob within bf16 rounding of stock
    bf16's full forward, and that token among stock's best."""
    from transformers import AutoModelForCausalLM

    needs(torch.bfloat16)
    monkeypatch.setattr(attention, "_VARLEN", {})
    d = tiny_model_dir(arch, **overrides)
    engine = LLMEngine(load_model(d, dtype="bfloat16"),
                       EngineConfig(prefill_attention="kernel", max_num_batched_tokens=64, prefix_caching=False))
    reference = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    prompts = make_prompts(engine.vocab_size, lens=[150, 97, 230], seed=5)
    results = engine.generate(prompts, [SamplingParams(max_new_tokens=1, logprobs=3, **GREEDY)] * len(prompts))
    for prompt, result in zip(prompts, results):
        first = result.logprobs[0]
        with torch.no_grad():
            stock = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, -1].float(), -1)
        assert abs(first.logprob - float(stock[first.token_id])) < 0.15
        assert float(stock[first.token_id]) >= float(stock.max()) - 0.15
    paged = attention._VARLEN[attention.cpu_kernel_key(torch.bfloat16, paged=True)]
    assert paged is not None and paged.verified == {mode} and not paged.failed


@pytest.mark.parametrize("arch,overrides,budget", [("llama", {}, 2048), ("llama", {}, 48),
                                                   ("mistral", {"sliding_window": 24}, 48)])  # fmt: skip
def test_fp32_engine_gives_stock_generates_tokens(arch, overrides, budget, tiny_model_dir, hf_reference, monkeypatch):
    """fp32 on the kernels, whole prompts in one step and in chunks of 48 (the later ones reading the cache), with
    and without a sliding window: stock ``generate``'s tokens, and the kernels passed their checks."""
    needs(torch.float32)
    monkeypatch.setattr(attention, "_VARLEN", {})
    d = tiny_model_dir(arch, **overrides)
    engine = LLMEngine(load_model(d), EngineConfig(max_num_batched_tokens=budget, prefix_caching=False))
    assert engine.runner.prefill_kernel  # auto: the kernels in fp32
    prompts = make_prompts(engine.vocab_size, lens=[150, 97, 230, 5], seed=6)
    results = engine.generate(prompts, [SamplingParams(max_new_tokens=10, **GREEDY)] * len(prompts))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(hf_reference(d), prompt, 10)
    kinds = {k: v for k, v in attention._VARLEN.items() if k.startswith("cpu")}
    assert kinds and all(v is not None and v.verified and not v.failed for v in kinds.values()), kinds
    assert (attention.cpu_kernel_key(torch.float32, paged=True) in kinds) == (budget < 230)


@pytest.mark.parametrize("how", ["differs", "raises"])
def test_a_paged_kernel_that_differs_or_raises_is_dropped(how, tiny_model_dir, hf_reference, monkeypatch, caplog):
    """The continuing chunks' first check: a kernel whose output differs from the gathered path (or that raises) is
    dropped for good, that step's output is the gathered path's, and the chunks after it go gathered: stock tokens."""
    import logging

    needs(torch.float32)
    monkeypatch.setattr(attention, "_VARLEN", {})
    calls = []

    def bad(out, *args):
        calls.append(1)
        if how == "raises":
            raise RuntimeError("bad kernel")
        out.zero_()

    monkeypatch.setattr(torch.ops.pdserve, "paged_prefill_attention", bad)
    d = tiny_model_dir("llama")
    engine = LLMEngine(load_model(d), EngineConfig(max_num_batched_tokens=48, prefix_caching=False))
    prompt = make_prompts(engine.vocab_size, lens=[150], seed=7)[0]
    with caplog.at_level(logging.WARNING, logger="common.engine.attention"):
        result = engine.generate([prompt], SamplingParams(max_new_tokens=10, **GREEDY))[0]
    assert result.token_ids == hf_greedy(hf_reference(d), prompt, 10)
    assert attention._VARLEN[attention.cpu_kernel_key(torch.float32, paged=True)] is None
    assert calls == [1] and "pdserve.paged_prefill_attention dropped" in caplog.text
    assert attention.cpu_prefill_dropped()
