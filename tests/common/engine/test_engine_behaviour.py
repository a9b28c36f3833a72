"""Engine behaviour beyond greedy equality: sampling, stops, aborts, limits, bad input, the hand-off."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.loader import load_model
from common.engine.sampling_params import SamplingParams
from tests.common.engine.test_engine_oracle import GREEDY, make_prompts
from tests.conftest import hf_greedy


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(model_dir)


@pytest.fixture
def engine(loaded):
    return LLMEngine(loaded, EngineConfig(num_kv_blocks=512))


def run_one(engine: LLMEngine, prompt, **sampling):
    return engine.generate([prompt], SamplingParams(**sampling))[0]


def assert_pool_empty(engine: LLMEngine) -> None:
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    assert not engine.has_unfinished_requests()
    assert engine._requests == {}


def test_seeded_sampling_reproducible_whatever_the_batch(engine):
    prompts = make_prompts(engine.vocab_size, lens=[12, 40, 7, 90], seed=5)
    sp = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = run_one(engine, prompts[0], **dataclasses.asdict(sp))
    others = [SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True) for n in (5, 30, 11)]
    batched = engine.generate([prompts[1], prompts[2], prompts[0], prompts[3]], [others[0], others[1], sp, others[2]])
    assert batched[2].token_ids == alone.token_ids
    other_seed = run_one(engine, prompts[0], **dataclasses.asdict(dataclasses.replace(sp, seed=99)))
    assert other_seed.token_ids != alone.token_ids
    assert_pool_empty(engine)


def test_seeded_sampling_survives_preemption(loaded):
    prompts = make_prompts(loaded.config.vocab_size, lens=[100, 120, 90, 110], seed=6)
    params = [SamplingParams(max_new_tokens=60, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)]
    roomy = LLMEngine(loaded, EngineConfig(num_kv_blocks=512)).generate(prompts, params)
    tight_engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=20, max_model_len=320))
    tight = tight_engine.generate(prompts, params)
    assert sum(r.num_preemptions for r in tight) > 0
    assert [r.token_ids for r in tight] == [r.token_ids for r in roomy]
    assert_pool_empty(tight_engine)


def test_top_k_1_and_tiny_temperature_equal_greedy(engine):
    prompts = make_prompts(engine.vocab_size, lens=[5, 50, 130], seed=7)
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=20, **GREEDY))
    top_k1 = engine.generate(prompts, SamplingParams(max_new_tokens=20, temperature=1.0, top_k=1, ignore_eos=True))
    cold = engine.generate(prompts, SamplingParams(max_new_tokens=20, temperature=1e-6, ignore_eos=True))
    assert [r.token_ids for r in top_k1] == [r.token_ids for r in greedy]
    assert [r.token_ids for r in cold] == [r.token_ids for r in greedy]


def test_text_is_the_decoded_tokens(engine):
    res = run_one(engine, "The class statement", max_new_tokens=40, **GREEDY)
    assert len(res.token_ids) == 40
    assert res.text == engine.tokenizer.decode(res.token_ids, skip_special_tokens=True)
    assert res.prompt_token_ids == engine.tokenizer("The class statement")["input_ids"]


def test_stop_string_ends_output_before_it(engine):
    full = run_one(engine, "The class statement", max_new_tokens=40, **GREEDY)
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert len(stop) == 3 and stop in full.text
    res = run_one(engine, "The class statement", max_new_tokens=40, stop=(stop,), **GREEDY)
    assert res.finish_reason.value == "stop"
    assert res.text == full.text[: full.text.index(stop)]
    assert res.token_ids == full.token_ids[: len(res.token_ids)]
    assert len(res.token_ids) < 40


def test_stop_token_id_is_returned_but_not_decoded(engine):
    full = run_one(engine, [10, 20, 30], max_new_tokens=10, **GREEDY)
    stop_id = full.token_ids[3]
    res = run_one(engine, [10, 20, 30], max_new_tokens=10, stop_token_ids=(stop_id,), **GREEDY)
    first = full.token_ids.index(stop_id)
    assert res.token_ids == full.token_ids[: first + 1]
    assert res.finish_reason.value == "stop"
    assert res.text == engine.tokenizer.decode(full.token_ids[:first], skip_special_tokens=True)


def test_eos_ends_generation_like_generate(loaded, hf_reference, model_dir):
    prompt = [11, 22, 33, 44]
    greedy = hf_greedy(hf_reference(model_dir), prompt, 12)
    eos = greedy[5]
    engine = LLMEngine(dataclasses.replace(loaded, eos_token_ids=(eos,)), EngineConfig(num_kv_blocks=128))
    res = run_one(engine, prompt, max_new_tokens=12, temperature=0.0)
    assert res.token_ids == hf_greedy(hf_reference(model_dir), prompt, 12, eos_token_id=eos)
    assert res.token_ids[-1] == eos and res.finish_reason.value == "stop"
    ignored = run_one(engine, prompt, max_new_tokens=12, temperature=0.0, ignore_eos=True)
    assert ignored.token_ids == greedy and ignored.finish_reason.value == "length"


def test_generation_stops_at_the_context_length(loaded):
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=16, max_model_len=50))
    res = run_one(engine, list(range(5, 50)), max_new_tokens=20, **GREEDY)
    assert len(res.token_ids) == 5 and res.finish_reason.value == "length"
    assert_pool_empty(engine)


def test_logprobs_are_log_softmax_of_the_model(engine, hf_reference, model_dir):
    prompt = [5, 6, 7, 8, 9]
    res = run_one(engine, prompt, max_new_tokens=3, logprobs=3, **GREEDY)
    assert len(res.logprobs) == 3
    with torch.no_grad():
        logits = hf_reference(model_dir)(torch.tensor([prompt])).logits[0, -1]
    expected = torch.log_softmax(logits, -1)
    first = res.logprobs[0]
    assert first.token_id == res.token_ids[0] == int(expected.argmax())
    assert abs(first.logprob - float(expected.max())) < 1e-4
    top = torch.topk(expected, 3)
    assert first.top_token_ids == top.indices.tolist()
    assert first.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)


def test_abort_frees_blocks_of_running_and_waiting_requests(loaded):
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=512, max_num_seqs=2))
    prompts = make_prompts(engine.vocab_size, lens=[30, 40, 50, 60], seed=8)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=50, **GREEDY)) for p in prompts]
    for _ in range(3):
        engine.step()
    assert engine.num_requests_running == 2 and engine.num_requests_waiting == 2
    assert engine.block_pool.num_used_blocks > 0
    assert engine.abort(ids[0]) and engine.abort(ids[3])
    assert not engine.abort(ids[0]) and not engine.abort("no-such-request")
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {ids[1], ids[2]}
    assert_pool_empty(engine)


def test_abort_of_a_prefilled_request_frees_its_blocks(engine):
    rid = engine.add_request([1, 2, 3, 4, 5] * 10, SamplingParams(max_new_tokens=5, **GREEDY), prefill_only=True)
    outs = engine.step()
    assert outs[0].prefilled and engine.block_pool.num_used_blocks == 4
    assert engine.abort(rid)
    assert_pool_empty(engine)


def test_prefill_only_request_that_ends_at_its_first_token_frees_blocks(engine):
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=1, **GREEDY), prefill_only=True)
    (out,) = engine.step()
    assert out.finished and not out.prefilled and out.finish_reason.value == "length"
    assert_pool_empty(engine)


def test_import_refuses_kv_of_another_model(engine, tiny_model_dir):
    other = LLMEngine(load_model(tiny_model_dir("llama", seed=1)), EngineConfig(num_kv_blocks=128))
    rid = other.add_request([1, 2, 3, 4], SamplingParams(max_new_tokens=5, **GREEDY), prefill_only=True)
    other.step()
    handoff = other.export_kv(rid)
    with pytest.raises(ValueError, match="model"):
        engine.import_kv(handoff, SamplingParams(max_new_tokens=5, **GREEDY))
    assert_pool_empty(engine)
    with pytest.raises(ValueError, match="no exportable KV"):
        other.export_kv(rid)


@pytest.mark.parametrize(
    "prompt, sampling, message",
    [
        ([], {}, "prompt is empty"),
        ("", {}, "prompt is empty"),
        (list(range(2048)), {}, "2048 tokens"),
        ([1, 2], {"temperature": -0.5}, "-0.5"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
        ([1, 2], {"top_p": 1.5}, "1.5"),
        ([1, 2], {"max_new_tokens": 0}, "max_new_tokens"),
        ([1, 2], {"stop_token_ids": (99999,)}, "99999"),
        ([1, 99999], {}, "99999"),
    ],
)
def test_bad_input_names_the_value(engine, prompt, sampling, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, SamplingParams(**sampling) if sampling else None)
    assert_pool_empty(engine)


def test_duplicate_request_id_is_refused(engine):
    engine.add_request([1, 2], request_id="a")
    with pytest.raises(ValueError, match="'a'"):
        engine.add_request([3, 4], request_id="a")


def test_generate_fails_clearly_when_prefilled_requests_hold_the_pool(loaded):
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=130))
    engine.add_request(list(range(4, 2000)), SamplingParams(max_new_tokens=5, **GREEDY), prefill_only=True)
    while not engine.step():
        pass
    with pytest.raises(RuntimeError, match="awaiting export_kv"):
        engine.generate([list(range(300, 496))], SamplingParams(max_new_tokens=5, **GREEDY))  # no shared prefix
