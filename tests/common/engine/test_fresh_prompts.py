"""Whole prompts in one step attend each to its own K/V (:func:`common.engine.attention._fresh_attention`): one
causal SDPA per prompt on the CPU, or a varlen kernel's one call (on CUDA in bf16/fp16; here a stand-in with the
kernels' calling convention checks the packing, the bounds and the checks on its first calls). Stock
``generate``'s tokens either way; a kernel that differs or raises is dropped and the prompts still come out
right; a prompt continuing a cached prefix sends its step back to the gathered, masked path."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import common.engine.attention as attention
from common.engine.attention import VarlenKernel
from common.engine.sampling_params import SamplingParams
from tests.common.engine.test_engine_oracle import GREEDY, make_engine, make_prompts
from tests.conftest import hf_greedy


@pytest.fixture
def causal_calls(monkeypatch):
    """How many SDPA calls were causal (the per-prompt path)."""
    counts = {"causal": 0}
    sdpa = attention.F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        counts["causal"] += bool(kwargs.get("is_causal"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counted)
    return counts


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prompts_of_one_step_attend_each_to_its_own_keys(arch, tiny_model_dir, hf_reference, causal_calls):
    d = tiny_model_dir(arch)
    engine = make_engine(d, prefix_caching=False, cpu_kernels=False)
    prompts = make_prompts(engine.vocab_size, lens=[17, 70, 3, 41], seed=8)
    got = generate_together(engine, prompts)
    layers = engine.kv_spec.num_layers
    assert causal_calls["causal"] == len(prompts) * layers  # one step, each prompt by itself
    reference = hf_reference(d)
    assert got == [hf_greedy(reference, p, 12) for p in prompts]


def generate_together(engine, prompts, new_tokens=12):
    params = SamplingParams(max_new_tokens=new_tokens, **GREEDY)
    return [r.token_ids for r in engine.generate(prompts, params)]


def test_beside_decodes_and_windows(tiny_model_dir, hf_reference, causal_calls):
    """Prompts arriving while another decodes still take the per-prompt path; with a window of 24, a step whose
    longest prompt exceeds it takes the gathered, masked one."""
    d = tiny_model_dir("mistral", sliding_window=24)
    engine = make_engine(d, prefix_caching=False, cpu_kernels=False)
    reference = hf_reference(d)
    groups = []
    prepare = engine.runner.prepare

    def spy(scheduled, **kwargs):
        batch = prepare(scheduled, **kwargs)
        groups.append([g.fresh_prompt for g in batch.attn.groups])
        return batch

    engine.runner.prepare = spy
    prompts = make_prompts(engine.vocab_size, lens=[9, 12, 20], seed=3)
    out = {str(i): [] for i in range(3)}
    engine.add_request(prompts[0], SamplingParams(max_new_tokens=20, **GREEDY), request_id="0")
    for o in engine.step():
        out[o.request_id] += o.new_token_ids
    for i in (1, 2):
        engine.add_request(prompts[i], SamplingParams(max_new_tokens=20, **GREEDY), request_id=str(i))
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert groups[:2] == [[1], [0, 2]]  # the first prompt; then its decode group beside both new prompts
    layers = engine.kv_spec.num_layers
    assert causal_calls["causal"] == 3 * layers
    long_ones = make_prompts(engine.vocab_size, lens=[10, 50], seed=5)
    got = generate_together(engine, long_ones, 6)
    assert causal_calls["causal"] == 3 * layers  # 50 tokens > the window: gathered and masked
    # (stock generate's own causal SDPA calls come after counting)
    assert [out[str(i)] for i in range(3)] == [hf_greedy(reference, p, 20) for p in prompts]
    assert got == [hf_greedy(reference, p, 6) for p in long_ones]


def test_a_prompt_continuing_a_cached_prefix_is_not_fresh(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), block_size=4, cpu_kernels=False)
    for p in (list(range(10, 30)), list(range(40, 52))):
        engine.add_request(p, SamplingParams(max_new_tokens=8, **GREEDY))
    (a, na), (b, nb) = engine.scheduler.schedule().scheduled
    assert engine.runner.prepare([(a, na), (b, nb)]).attn.groups[0].fresh_prompt == 2
    a.num_computed_tokens = 8  # as if 8 tokens came from the prefix cache
    assert engine.runner.prepare([(a, na - 8), (b, nb)]).attn.groups[0].fresh_prompt == 0


def reference_varlen(calls: list):
    """A stand-in with the varlen kernels' calling convention: each prompt causal (and windowed) over its own keys."""

    def run(q, k, v, bounds, longest, scale, window):
        calls.append((tuple(q.shape), tuple(k.shape), bounds.dtype, longest, window))
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        out = torch.empty_like(q)
        b = bounds.tolist()
        assert longest == max(y - x for x, y in zip(b, b[1:]))
        for x, y in zip(b, b[1:]):
            i = torch.arange(y - x)
            mask = i[None, :] <= i[:, None]
            if window is not None:
                mask &= i[None, :] > i[:, None] - window
            qq, kk, vv = (t[x:y].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)
            out[x:y] = o[0].transpose(0, 1)
        return out

    return run


def use_kernel(monkeypatch, kernel: VarlenKernel) -> None:
    monkeypatch.setattr(attention, "varlen_kernel", lambda query: None if kernel.failed else kernel)


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("mistral", {"sliding_window": 24})],
                         ids=["llama", "mistral-window"])  # fmt: skip
def test_a_varlen_kernel_gets_the_packed_prompts(arch, overrides, tiny_model_dir, hf_reference, monkeypatch):
    d = tiny_model_dir(arch, **overrides)
    engine = make_engine(d, prefix_caching=False, cpu_kernels=False)
    calls: list = []
    kernel = VarlenKernel("reference", reference_varlen(calls))
    use_kernel(monkeypatch, kernel)
    prompts = make_prompts(engine.vocab_size, lens=[17, 70, 3, 41], seed=8)
    got = generate_together(engine, prompts)
    assert got == [hf_greedy(hf_reference(d), p, 12) for p in prompts]
    cfg = engine.loaded.config
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, engine.kv_spec.head_dim
    window = overrides.get("sliding_window")
    assert calls == [((131, heads, dim), (131, kv_heads, dim), torch.int32, 70, window)] * engine.kv_spec.num_layers
    assert kernel.verified == {"window" if window else "causal"} and not kernel.failed


@pytest.mark.parametrize("how", ["differs", "raises"])
def test_a_kernel_that_differs_or_raises_is_dropped(how, tiny_model_dir, hf_reference, monkeypatch, caplog):
    d = tiny_model_dir("llama")
    engine = make_engine(d, prefix_caching=False, cpu_kernels=False)
    calls: list = []
    good = reference_varlen(calls)

    def bad(q, k, v, bounds, longest, scale, window):
        if how == "raises":
            raise RuntimeError("FlashAttention only supports Ampere GPUs or newer")
        return good(q, k, v, bounds, longest, scale, None if window else 2)  # a window where there is none

    kernel = VarlenKernel("bad", bad)
    use_kernel(monkeypatch, kernel)
    prompts = make_prompts(engine.vocab_size, lens=[17, 70, 3, 41], seed=8)
    with caplog.at_level(logging.WARNING, logger="common.engine.attention"):
        got = generate_together(engine, prompts)
    assert got == [hf_greedy(hf_reference(d), p, 12) for p in prompts]
    assert kernel.failed and not kernel.verified and "varlen attention bad dropped" in caplog.text
    assert len(calls) == (how == "differs")  # tried once, on the first layer, then never again
