"""What the engine counts for metrics: tokens, preemptions, prefix-cache lookups, and each request's stages."""

from __future__ import annotations

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.engine_loop import EngineLoop
from common.engine.loader import load_model
from common.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(tiny_model_dir("llama"))


def test_tokens_and_stage_times_of_finished_requests(loaded):
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, max_model_len=256))
    engine.generate([[5, 6, 7], [8, 9, 10, 11, 12]], GREEDY)
    c = engine.counters
    assert (c.num_prompt_tokens, c.num_generation_tokens, c.num_prefix_cache_queries) == (8, 10, 8)
    left = engine.drain_timings()
    assert engine.drain_timings() == []
    assert sorted((t.num_prompt_tokens, t.num_output_tokens, t.finish_reason, t.imported) for t in left) == [
        (3, 5, "length", False), (5, 5, "length", False)]
    for t in left:
        assert t.arrival_s <= t.first_scheduled_s <= t.first_token_s <= t.finished_s
        assert t.queue_s >= 0 and t.prefill_s > 0 and t.decode_s > 0


def test_handoff_counts_prompt_compute_on_prefill_and_decode_only_on_decode(loaded):
    prefill = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, max_model_len=256))
    decode = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, max_model_len=256))
    rid = prefill.add_request([5, 6, 7, 8], GREEDY, prefill_only=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    decode.import_kv(prefill.export_kv(rid), GREEDY)
    while decode.has_unfinished_requests():
        decode.step()
    [p] = prefill.drain_timings()
    assert (p.finish_reason, p.num_output_tokens, p.decode_s) == ("prefilled", 1, None) and p.prefill_s > 0
    [d] = decode.drain_timings()
    assert (d.finish_reason, d.imported, d.num_output_tokens, d.prefill_s) == ("length", True, 4, None)
    assert d.decode_s > 0
    assert (prefill.counters.num_prompt_tokens, prefill.counters.num_generation_tokens) == (4, 1)
    assert (decode.counters.num_prompt_tokens, decode.counters.num_generation_tokens) == (0, 4)
    assert decode.counters.num_prefix_cache_queries == 0  # imported KV is never looked up


def test_preemptions_and_aborts_are_counted(loaded):
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=20, max_model_len=320))  # 320 token slots
    long = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    results = engine.generate([[5 + i] * n for i, n in enumerate((100, 120, 90, 110))], long)  # > 320 tokens
    assert engine.counters.num_preemptions == sum(r.num_preemptions for r in results) > 0
    engine.drain_timings()
    rid = engine.add_request([5, 6], GREEDY)
    engine.abort(rid)
    [t] = engine.drain_timings()
    assert (t.request_id, t.finish_reason, t.first_scheduled_s) == (rid, "abort", None)


def test_the_loop_publishes_counters_and_hands_over_timings(loaded):
    seen = []
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, max_model_len=256))
    loop = EngineLoop(engine, on_request_finished=seen.append).start()
    try:
        stream = loop.add_request([5, 6, 7], GREEDY)
        outs = list(stream)
        assert outs[-1].finished and outs[-1].times is not None and outs[-1].times.first_token_s is not None
        loop.call(lambda e: None)  # one more pass of the loop: the snapshot after the last step is out
        assert [t.finish_reason for t in seen] == ["length"]
        assert (loop.stats.num_prompt_tokens, loop.stats.num_generation_tokens) == (3, 5)
    finally:
        loop.stop()
