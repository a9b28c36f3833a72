"""The engine's bf16 flash attention for whole prompts on CPUs with AVX512-BF16
(``torch.ops.pdserve.prefill_attention``, common/engine/csrc/prefill_attention.cpp). The kernel against float64
attention, within 1.6x of the error of that exact result rounded to bf16 (torch's CPU flash attention is as far
off: both round the probabilities to bf16 for their products; 1.1-1.4x measured here, a scale 1% off 3.7-6.9x):
several prompts packed, an empty one, grouped-query heads, head sizes 16 to 128, sliding windows, the strided
views of a fused q|k|v product; bad arguments raise. In an engine: every layer of a prefill step of whole prompts
runs it (checked once against SDPA), its logits within bf16 rounding of stock bf16's, and ``prefill_attention``
chooses it or not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import common.engine.attention as attention
from common.engine import cpu_kernels
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.loader import load_model
from common.engine.sampling_params import SamplingParams
from tests.common.engine.test_engine_oracle import GREEDY, make_prompts, next_logits_and_stock

pytestmark = pytest.mark.skipif(
    not (cpu_kernels.load() and torch.ops.pdserve.prefill_attention_supported()),
    reason="no AVX512-BF16 prefill attention kernel on this CPU",
)


def packed_case(lens, heads, kv_heads, dim, seed=0, spread=1.0):
    """q, k, v as [T, H, D] views of one fused [T, heads + 2 kv_heads, D] bf16 tensor (as the engine's step makes
    them), and the prompts' bounds."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lens), heads + 2 * kv_heads, dim, generator=g)
    qkv[:, :heads] *= spread  # sharper softmaxes
    qkv = qkv.to(torch.bfloat16)
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
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
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
])  # fmt: skip
def test_kernel_is_within_bf16_rounding_of_float64(lens, heads, kv_heads, dim, window, spread):
    q, k, v, bounds = packed_case(lens, heads, kv_heads, dim, seed=len(lens) + dim, spread=spread)
    scale = dim**-0.5
    got = run_kernel(q, k, v, bounds, scale, window).double()
    want = reference(q, k, v, bounds, scale, window)
    err, floor = (got - want).abs(), (want.to(torch.bfloat16).double() - want).abs()  # floor: the output's rounding
    assert not got.isnan().any()
    assert err.max() <= max(3 * floor.max(), 1e-2), (err.max(), floor.max())
    assert err.mean() <= 1.6 * floor.mean(), (err.mean(), floor.mean())


def test_a_wrong_scale_or_window_is_caught():
    """What the test above would see of a kernel that got the scale 1% wrong or ignored the window."""
    q, k, v, bounds = packed_case([200, 90], 4, 2, 64, seed=3, spread=2.0)
    scale = 64**-0.5
    want = reference(q, k, v, bounds, scale, 20)
    floor = (want.to(torch.bfloat16).double() - want).abs().mean()
    assert (run_kernel(q, k, v, bounds, scale, 20).double() - want).abs().mean() <= 1.6 * floor
    for wrong_scale, wrong_window in ((scale * 1.01, 20), (scale, 0)):
        err = (run_kernel(q, k, v, bounds, wrong_scale, wrong_window).double() - want).abs().mean()
        assert err > 1.6 * floor, (wrong_scale, wrong_window)


def test_kernel_refuses_what_it_cannot_read():
    q, k, v, bounds = packed_case([10, 20], 4, 2, 64)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    call = torch.ops.pdserve.prefill_attention
    with pytest.raises(RuntimeError, match="bounds outside the tokens"):
        call(out, q, k, v, torch.tensor([0, 10, 31], dtype=torch.int32), 0.1, 0)
    with pytest.raises(RuntimeError, match="must not decrease"):
        call(out, q, k, v, torch.tensor([0, 20, 10, 30], dtype=torch.int32), 0.1, 0)
    with pytest.raises(RuntimeError, match="int32"):
        call(out, q, k, v, bounds.long(), 0.1, 0)
    with pytest.raises(RuntimeError, match="bfloat16"):
        call(out.float(), q.float(), k.float(), v.float(), bounds, 0.1, 0)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        call(out[:, :3], q[:, :3], k, v, bounds, 0.1, 0)
    q40, k40, v40, _ = packed_case([10, 20], 4, 2, 40)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        call(torch.empty(q40.shape, dtype=torch.bfloat16), q40, k40, v40, bounds, 0.1, 0)


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
    monkeypatch.setitem(attention._VARLEN, "cpu", kernel)
    return kernel, calls


@pytest.mark.parametrize("arch,overrides,lens,mode", [
    ("llama", {}, [5, 50, 200], "causal"),
    ("mistral", {"sliding_window": 24}, [17, 70, 3, 41], "window"),
])  # fmt: skip
def test_an_engine_prefills_whole_prompts_by_the_kernel(arch, overrides, lens, mode, tiny_model_dir,
                                                        counted_kernel):  # fmt: skip
    from transformers import AutoModelForCausalLM

    kernel, calls = counted_kernel
    d = tiny_model_dir(arch, **overrides)
    engine = LLMEngine(load_model(d, dtype="bfloat16"), EngineConfig(prefill_attention="kernel"))
    assert engine.runner.prefill_kernel
    reference = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    calls.clear()  # the engine's own warm-up at start
    for p in make_prompts(engine.vocab_size, lens=lens, seed=4):
        engine.add_request(p, SamplingParams(max_new_tokens=2, **GREEDY))
    sched = engine.scheduler.schedule()
    for row, ref in next_logits_and_stock(engine, reference, sched.scheduled):
        assert (row - ref).abs().max().item() < 0.15
        assert int(row.argmax()) == int(ref.argmax())
    window = overrides.get("sliding_window")
    # every layer (twice: the first step also checks the flat layer loop against the model's own forward), on the
    # step's strided views (no copies of q, k, v)
    assert calls == [(sum(lens), window, False)] * engine.kv_spec.num_layers * (1 + (engine.runner.flat is not None))
    assert kernel.verified == {mode} and not kernel.failed


def test_prefill_attention_chooses(tiny_model_dir, counted_kernel):
    d = tiny_model_dir("llama")
    amx = "amx_bf16" in cpu_kernels.cpu_flags()
    for choice, dtype, want in (("kernel", "bfloat16", True), ("auto", "bfloat16", not amx),
                                ("sdpa", "bfloat16", False), ("kernel", "float32", False)):  # fmt: skip
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
