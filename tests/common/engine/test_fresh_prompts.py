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
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        counts["causal"] += bool(kwargs.get("is_causal"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
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


@pytest.mark.parametrize("version", ["2.12", "2.10", "2.9"])
def test_torch_varlen_by_the_signature_it_has(version, monkeypatch):
    """torch's varlen_attn took ``enable_gqa`` from 2.12, ``scale`` and ``window_size`` from 2.10 (2.9: only
    ``is_causal``): the adapter repeats KV heads without the first and leaves a torch without the others to SDPA."""
    import torch.nn.attention.varlen as varlen

    calls: list = []
    reference = reference_varlen(calls)

    def v212(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
             enable_gqa=False):  # fmt: skip
        assert enable_gqa == (key.shape[1] != query.shape[1]) and window_size[1] == 0
        return reference(query, key, value, cu_seq_q, max_q, scale, window_size[0] + 1 or None)

    def v210(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        assert key.shape[1] == query.shape[1] and window_size[1] == 0
        return reference(query, key, value, cu_seq_q, max_q, scale, window_size[0] + 1 or None)

    def v29(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False):
        raise AssertionError("not to be called")

    monkeypatch.setattr(varlen, "varlen_attn", {"2.12": v212, "2.10": v210, "2.9": v29}[version])
    kernel = attention._torch_varlen()
    if version == "2.9":
        assert kernel is None
        return
    g = torch.Generator().manual_seed(3)
    bounds = torch.tensor([0, 5, 19, 20], dtype=torch.int32)
    q, k, v = (torch.randn(20, h, 16, generator=g) for h in (4, 2, 2))
    for window in (None, 3):
        want = reference_varlen([])(q, k, v, bounds, 14, 0.3, window)
        torch.testing.assert_close(kernel(q, k, v, bounds, 14, 0.3, window), want, rtol=0, atol=0)
    assert len(calls) == 2


def use_kernel(monkeypatch, kernel: VarlenKernel) -> None:
    def pick(query, cpu_kernel=False, extras=None):  # as varlen_kernel picks: none once failed, or for extras it lacks
        return None if kernel.failed or (extras is not None and not kernel.takes_extras) else kernel

    monkeypatch.setattr(attention, "varlen_kernel", pick)


@pytest.mark.parametrize("arch,overrides,lens,window", [
    ("llama", {}, [17, 70, 3, 41], None),
    ("mistral", {"sliding_window": 24}, [17, 70, 3, 41], 24),
    ("mistral", {"sliding_window": 24}, [17, 24, 3, 11], None),  # no prompt reaches the window: the kernel gets none
], ids=["llama", "mistral-window", "mistral-window-unreached"])  # fmt: skip
def test_a_varlen_kernel_gets_the_packed_prompts(arch, overrides, lens, window, tiny_model_dir, hf_reference,
                                                 monkeypatch):  # fmt: skip
    d = tiny_model_dir(arch, **overrides)
    engine = make_engine(d, prefix_caching=False, cpu_kernels=False)
    calls: list = []
    kernel = VarlenKernel("reference", reference_varlen(calls))
    use_kernel(monkeypatch, kernel)
    prompts = make_prompts(engine.vocab_size, lens=lens, seed=8)
    got = generate_together(engine, prompts)
    assert got == [hf_greedy(hf_reference(d), p, 12) for p in prompts]
    cfg = engine.loaded.config
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, engine.kv_spec.head_dim
    total, longest = sum(lens), max(lens)
    assert calls == [((total, heads, dim), (total, kv_heads, dim), torch.int32, longest, window)] * (
        engine.kv_spec.num_layers
    )
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


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("mistral", {"sliding_window": 24})],
                         ids=["llama", "mistral-window"])  # fmt: skip
def test_chunks_after_cached_prefixes_attend_one_sequence_at_a_time(arch, overrides, tiny_model_dir, hf_reference):
    """Prompts continuing cached prefixes of different lengths, in one step: each sequence attends over its own
    keys (not padded to the group's longest), the logits those of the padded group, the tokens stock generate's;
    chunks of one shape stay one padded group."""
    d = tiny_model_dir(arch, **overrides)
    engine = make_engine(d, block_size=4, cpu_kernels=False)
    prefixes = make_prompts(engine.vocab_size, lens=[8, 40, 16, 60], seed=12)
    engine.generate(prefixes, SamplingParams(max_new_tokens=1, **GREEDY))  # now cached
    extensions = make_prompts(engine.vocab_size, lens=[30, 3, 12, 21], seed=13)
    prompts = [p + e for p, e in zip(prefixes, extensions)]
    spans, logits = [], []
    prepare, run = engine.runner.prepare, engine.runner.run

    def spy_prepare(scheduled, **kwargs):
        batch = prepare(scheduled, **kwargs)
        if batch.attn is not None:
            spans.append((batch.attn.groups[-1].fresh_prompt, batch.attn.groups[-1].seq_spans))
        return batch

    def spy_run(batch):
        got = run(batch)
        group = batch.attn.groups[-1] if batch.attn is not None else None
        if group is not None and group.seq_spans is not None:  # the same step, padded, for comparison
            group.seq_spans, group._masks = None, {}
            logits.append((got, run(batch)))
        return got

    engine.runner.prepare, engine.runner.run = spy_prepare, spy_run
    got = generate_together(engine, prompts, 10)
    assert spans[0][0] == 0 and spans[0][1][:, 1:].tolist() == [[8, 30], [40, 3], [16, 12], [60, 21]]
    (per_sequence, padded), = logits
    assert float((per_sequence - padded).abs().max()) < 1e-4
    reference = hf_reference(d)
    assert got == [hf_greedy(reference, p, 10) for p in prompts]
    same = [p + e for p, e in zip(prefixes, make_prompts(engine.vocab_size, lens=[8, 8, 8, 8], seed=14))]
    spans.clear()
    generate_together(engine, [p[:16] + p[-8:] for p in same[2:]], 2)  # two chunks of 8 after 16 cached tokens
    assert spans[0] == (0, None)
