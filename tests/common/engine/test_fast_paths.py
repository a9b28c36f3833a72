"""The engine's CPU fast paths keep stock ``generate``'s output: fused sibling projections and RMSNorms, a
lone stream's attention read in place from consecutive blocks, a whole prompt attending to its own K/V
(``is_causal``), with and without a sliding window; each path is shown to be taken, and refused where its
condition fails (blocks out of order, a prompt continuing a cached prefix)."""

from __future__ import annotations

import pytest

import common.engine.attention as attention
from common.engine.cpu_linear import FusedLinear, FusedRMSNorm, LinearSlice
from common.engine.sampling_params import SamplingParams
from tests.common.engine.test_engine_oracle import GREEDY, make_engine, make_prompts
from tests.conftest import hf_greedy


@pytest.fixture
def path_counts(monkeypatch):
    """How many layer calls took the in-place decode path and the fresh-prompt path."""
    counts = {"in_place": 0, "fresh_prompt": 0}
    in_place = attention._in_place_attention

    def counted(*args, **kwargs):
        counts["in_place"] += 1
        return in_place(*args, **kwargs)

    sdpa = attention.F.scaled_dot_product_attention

    def counted_sdpa(*args, **kwargs):
        counts["fresh_prompt"] += bool(kwargs.get("is_causal"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention, "_in_place_attention", counted)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counted_sdpa)
    return counts


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_layers_one_stream_at_a_time(arch, tiny_model_dir, hf_reference, path_counts):
    d = tiny_model_dir(arch)
    engine = make_engine(d)
    modules = list(engine.loaded.model.modules())
    layers = engine.kv_spec.num_layers
    assert sum(isinstance(m, FusedLinear) for m in modules) == 2 * layers  # q/k/v and gate/up of every layer
    assert sum(isinstance(m, LinearSlice) for m in modules) == 5 * layers
    assert sum(isinstance(m, FusedRMSNorm) for m in modules) == 2 * layers + 1
    reference = hf_reference(d)
    prompts = make_prompts(engine.vocab_size, lens=[1, 17, 70], seed=5)
    results = [engine.generate([p], SamplingParams(max_new_tokens=20, **GREEDY))[0] for p in prompts]
    # the prompts of 17 and 70 tokens in one step each, from position 0; a 1-token prompt is decode-shaped
    assert path_counts["fresh_prompt"] == 2 * layers
    assert path_counts["in_place"] == (20 + 19 + 19) * layers  # every other step of a lone stream
    for prompt, result in zip(prompts, results):  # (stock generate's own causal SDPA calls come after counting)
        assert result.token_ids == hf_greedy(reference, prompt, 20)


def test_sliding_window_on_the_fast_paths(tiny_model_dir, hf_reference, path_counts):
    """Window 24: a 20-token prompt takes the causal path, a 50-token one the masked one; decoding past the
    window reads only its last 24 keys in place."""
    d = tiny_model_dir("mistral", sliding_window=24)
    engine = make_engine(d)
    reference = hf_reference(d)
    layers = engine.kv_spec.num_layers
    prompts = make_prompts(engine.vocab_size, lens=[20, 50], seed=6)
    results = []
    for prompt, fresh in zip(prompts, (layers, 0)):
        before = path_counts["fresh_prompt"]
        results.append(engine.generate([prompt], SamplingParams(max_new_tokens=30, **GREEDY))[0])
        assert path_counts["fresh_prompt"] - before == fresh
    assert path_counts["in_place"] == 2 * 29 * layers
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(reference, prompt, 30)


def test_fast_paths_refused_when_their_condition_fails(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), block_size=4)
    engine.add_request(list(range(10, 30)), SamplingParams(max_new_tokens=8, **GREEDY))
    ((request, n),) = engine.scheduler.schedule().scheduled
    assert n == 20 and engine.runner.prepare([(request, n)]).attn.groups[0].fresh_prompt == 1
    request.num_computed_tokens = 8  # as if 8 tokens came from the prefix cache: the rest needs their K/V
    assert engine.runner.prepare([(request, n - 8)]).attn.groups[0].fresh_prompt == 0
    request.num_computed_tokens = 13  # one token at position 13: a decode-shaped step over blocks 0..3
    batch = engine.runner.prepare([(request, 1)])
    assert (batch.attn.groups[0].first_block, batch.attn.groups[0].num_keys) == (request.block_ids[0], 14)
    request.block_ids[1], request.block_ids[2] = request.block_ids[2], request.block_ids[1]  # out of order
    assert engine.runner.prepare([(request, 1)]).attn.groups[0].first_block is None
