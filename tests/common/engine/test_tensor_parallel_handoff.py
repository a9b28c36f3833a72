"""The disaggregated KV hand-off across tensor-parallel layouts: a two-rank engine (gloo, CPU) prefills for a
one-process engine and decodes what one prefilled, through export_kv → import_kv and through reserve → write
in chunks → admit; greedy fp32 output equals stock ``generate`` token for token. The hand-off carries every KV
head whatever the layout: what two ranks export equals what one process exports."""

from __future__ import annotations

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.loader import load_model
from common.engine.sampling_params import SamplingParams
from common.engine.tp_launcher import launch_engine
from tests.common.engine.test_engine_oracle import GREEDY
from tests.conftest import hf_greedy

STARTUP_TIMEOUT_S = 120.0  # a follower that fails ends the driver's next collective within this
MAX_TOKENS = 12
CONFIG = EngineConfig(num_kv_blocks=64, block_size=4, max_model_len=128, num_threads=1)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")  # 4 query heads, 2 KV heads: one KV head per rank


@pytest.fixture(scope="module")
def tp_engine(model_dir):
    engine = launch_engine(model_dir, CONFIG, tensor_parallel_size=2, startup_timeout_s=STARTUP_TIMEOUT_S)
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def one_engine(model_dir):
    return LLMEngine(load_model(model_dir), CONFIG)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(4, 4000, (n,), generator=g).tolist() for n in (41, 38, 43, 39)]


def _params() -> SamplingParams:
    return SamplingParams(max_new_tokens=MAX_TOKENS, **GREEDY)


def _prefill(engine: LLMEngine, prompt: list[int]):
    """Prefill ``prompt`` (prefill_only) and export it; returns (the first token, the hand-off)."""
    rid = engine.add_request(prompt, _params(), prefill_only=True)
    first: list[int] = []
    prefilled = False
    while not prefilled:
        for out in engine.step():
            assert out.request_id == rid and not out.finished
            first += out.new_token_ids
            prefilled = out.prefilled
    assert len(first) == 1
    handoff = engine.export_kv(rid)
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    return first, handoff


def _decode(engine: LLMEngine, rid: str) -> list[int]:
    """Step ``engine`` until ``rid`` finishes; every token it reports (the imported ones first)."""
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            tokens += out.new_token_ids
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    return tokens


def test_handoff_spec_has_every_kv_head(tp_engine, one_engine):
    assert tp_engine.kv_spec.num_kv_heads == 1 and one_engine.kv_spec.num_kv_heads == 2
    assert tp_engine.handoff_spec == one_engine.handoff_spec == one_engine.kv_spec
    assert tp_engine.handoff_spec.num_kv_heads == 2


def test_two_rank_prefill_one_process_decode(tp_engine, one_engine, model_dir, hf_reference, prompts):
    prompt = prompts[0]
    first, handoff = _prefill(tp_engine, prompt)
    assert handoff.spec == one_engine.kv_spec and handoff.layers[0][0].shape == (11, 4, 2, 32)
    rid = one_engine.import_kv(handoff, _params())
    tokens = _decode(one_engine, rid)
    assert tokens[:1] == first
    assert tokens == hf_greedy(hf_reference(model_dir), prompt, MAX_TOKENS)


def test_one_process_prefill_two_rank_decode(tp_engine, one_engine, model_dir, hf_reference, prompts):
    prompt = prompts[1]
    first, handoff = _prefill(one_engine, prompt)
    rid = tp_engine.import_kv(handoff, _params())
    tokens = _decode(tp_engine, rid)
    assert tokens[:1] == first
    assert tokens == hf_greedy(hf_reference(model_dir), prompt, MAX_TOKENS)


def test_two_rank_reserve_write_in_chunks_admit(tp_engine, one_engine, model_dir, hf_reference, prompts):
    """The KV lands in two chunks of blocks (block 0..2, then the rest), last layer first, into block ids other
    than the sender's (a reservation holds the first ones)."""
    prompt = prompts[2]
    first, handoff = _prefill(one_engine, prompt)
    tp_engine.reserve_kv("pad", 9, lease_s=60)  # 3 blocks
    blocks = tp_engine.reserve_kv("r", handoff.num_kv_tokens, lease_s=60)
    assert len(blocks) == handoff.num_blocks and min(blocks) >= 3
    for layer in reversed(range(tp_engine.kv_spec.num_layers)):
        k, v = handoff.layers[layer]
        tp_engine.write_kv("r", layer, 0, k[:3], v[:3])
        tp_engine.write_kv("r", layer, 3, k[3:], v[3:])
    assert tp_engine.release_kv("pad")
    tp_engine.admit_reserved("r", handoff.prompt_token_ids, handoff.output_token_ids, _params(),
                             handoff.generator_state)
    tokens = _decode(tp_engine, "r")
    assert tokens[:1] == first
    assert tokens == hf_greedy(hf_reference(model_dir), prompt, MAX_TOKENS)


def test_write_kv_refuses_local_heads(tp_engine):
    """A chunk with one rank's heads only is refused before anything is sent; the engine keeps working."""
    tp_engine.reserve_kv("r", 10, lease_s=60)
    k = torch.zeros(tp_engine.kv_spec.block_shape(3))  # 1 head, not 2
    with pytest.raises(ValueError, match="do not fit"):
        tp_engine.write_kv("r", 0, 0, k, k)
    assert tp_engine.release_kv("r")


def test_two_rank_export_equals_one_process_export(tp_engine, one_engine, prompts):
    prompt = prompts[3]
    tp_first, tp_handoff = _prefill(tp_engine, prompt)
    one_first, one_handoff = _prefill(one_engine, prompt)
    assert tp_first == one_first and tp_handoff.output_token_ids == one_handoff.output_token_ids
    assert tp_handoff.spec == one_handoff.spec and tp_handoff.num_kv_tokens == one_handoff.num_kv_tokens == 39
    assert len(tp_handoff.layers) == len(one_handoff.layers) == one_engine.kv_spec.num_layers
    for layer, ((k2, v2), (k1, v1)) in enumerate(zip(tp_handoff.layers, one_handoff.layers)):
        assert k2.shape == k1.shape == (10, 4, 2, 32), layer
        assert torch.allclose(k2, k1, atol=1e-5) and torch.allclose(v2, v1, atol=1e-5), f"layer {layer}"
    # and it goes back into the two-rank engine as it came out: a round trip of the canonical format
    rid = tp_engine.import_kv(tp_handoff, _params(), request_id="again")
    assert _decode(tp_engine, rid)[:1] == tp_first
