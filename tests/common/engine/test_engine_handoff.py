"""The decode side of the hand-off (reserve → write layer by layer → admit) and layer-wise KV streaming."""

from __future__ import annotations

import time

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine, NoFreeBlocksError
from common.engine.loader import load_model
from common.engine.sampling_params import SamplingParams
from tests.common.engine.test_engine_oracle import GREEDY, make_prompts, max_tokens_for
from tests.conftest import hf_greedy


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen2")


def prefill_streaming(model_dir, prompts, params):
    """Prefill every prompt with a layer sink; returns (streamed {rid: {layer: (k, v)}}, handoffs by rid)."""
    streamed: dict[str, dict[int, tuple]] = {}
    order: list[tuple[str, int]] = []

    def sink(rid, layer, k, v):
        order.append((rid, layer))
        streamed.setdefault(rid, {})[layer] = (k, v)

    engine = LLMEngine(load_model(model_dir), EngineConfig(num_kv_blocks=300, max_num_batched_tokens=256,
                                                           prefill_chunk_size=128), kv_layer_sink=sink)
    ids = [engine.add_request(p, sp, prefill_only=True) for p, sp in zip(prompts, params)]
    while engine.has_unfinished_requests():
        engine.step()
    for rid in ids:  # each request's layers arrive once each, in order
        layers = [layer for r, layer in order if r == rid]
        assert layers == list(range(engine.kv_spec.num_layers))
    full = {rid: engine.export_kv(rid) for rid in ids[:2]}  # with KV: must equal what was streamed
    light = {rid: engine.export_kv(rid, with_kv=False) for rid in ids[2:]}
    for rid, handoff in full.items():
        for layer, (k, v) in enumerate(handoff.layers):
            assert torch.equal(k, streamed[rid][layer][0]) and torch.equal(v, streamed[rid][layer][1])
    assert all(h.layers == [] for h in light.values())
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    return ids, streamed, {**full, **light}


def decode_from_stream(model_dir, ids, streamed, handoffs, params, chunk_blocks=3):
    engine = LLMEngine(load_model(model_dir), EngineConfig(num_kv_blocks=400))
    engine.block_pool.allocate(5)  # different block ids than the sender's
    out = {}
    for rid, sp in zip(ids, params):
        h = handoffs[rid]
        engine.reserve_kv(rid, h.num_kv_tokens, lease_s=30)
        for layer in reversed(range(engine.kv_spec.num_layers)):  # any order, in chunks of blocks
            k, v = streamed[rid][layer]
            for first in range(0, k.shape[0], chunk_blocks):
                engine.write_kv(rid, layer, first, k[first : first + chunk_blocks], v[first : first + chunk_blocks])
        engine.admit_reserved(rid, h.prompt_token_ids, h.output_token_ids, sp, h.generator_state)
        out[rid] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 5
    return out


def test_streamed_layers_continue_greedy_exactly(model_dir, hf_reference):
    prompts = make_prompts(4096, lens=[1, 16, 17, 100, 250, 300], seed=11)
    params = [SamplingParams(max_new_tokens=max_tokens_for(i), **GREEDY) for i in range(len(prompts))]
    ids, streamed, handoffs = prefill_streaming(model_dir, prompts, params)
    out = decode_from_stream(model_dir, ids, streamed, handoffs, params)
    reference = hf_reference(model_dir)
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        assert out[rid] == hf_greedy(reference, prompt, max_tokens_for(i)), f"prompt {i}"


def test_seeded_sampling_continues_across_the_handoff(model_dir):
    prompts = make_prompts(4096, lens=[20, 80, 150], seed=12)
    params = [SamplingParams(max_new_tokens=30, temperature=0.8, top_k=40, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    single = LLMEngine(load_model(model_dir), EngineConfig(num_kv_blocks=300)).generate(prompts, params)
    ids, streamed, handoffs = prefill_streaming(model_dir, prompts, params)
    out = decode_from_stream(model_dir, ids, streamed, handoffs, params)
    assert [out[rid] for rid in ids] == [r.token_ids for r in single]


def test_a_sampling_state_of_another_device_kind_still_admits(model_dir, caplog):
    """A CUDA prefill worker's generator state (16 bytes: seed and offset) cannot set a CPU generator (5,056 bytes),
    nor the reverse: the request is admitted, generates from its seed, and its blocks come back."""
    prompt = make_prompts(4096, lens=[40], seed=13)[0]
    sp = SamplingParams(max_new_tokens=8, temperature=0.8, seed=7, ignore_eos=True)
    ids, streamed, handoffs = prefill_streaming(model_dir, [prompt], [sp])
    handoffs[ids[0]].generator_state = torch.zeros(16, dtype=torch.uint8)
    with caplog.at_level("WARNING", logger="common.engine.disagg"):
        out = decode_from_stream(model_dir, ids, streamed, handoffs, [sp])  # and its blocks freed (checked there)
    assert len(out[ids[0]]) == 8 and "sampling goes on from the request's seed" in caplog.text


def test_staged_layers_reach_the_sink_in_order_as_their_copies_complete(model_dir):
    """On CUDA a streamed layer is staged to the host (an event per copy): the sink gets the layers whose copies
    completed, in the order staged (never one past a copy still running), and every one at the step's end."""

    class Copy:  # a torch.cuda.Event's two calls
        def __init__(self):
            self.done, self.waited = False, False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = self.done = True

    got = []
    engine = LLMEngine(load_model(model_dir), EngineConfig(num_kv_blocks=200),
                       kv_layer_sink=lambda rid, layer, k, v: got.append((rid, layer)))  # fmt: skip
    copies = [Copy() for _ in range(4)]
    for i, copy in enumerate(copies):
        engine._staged.append((f"r{i % 2}", i // 2, None, None, copy))
    copies[1].done = copies[3].done = True
    engine._deliver_staged(wait=False)
    assert got == []  # the first copy still runs
    copies[0].done = True
    engine._deliver_staged(wait=False)
    assert got == [("r0", 0), ("r1", 0)]
    engine._deliver_staged(wait=True)
    assert got == [("r0", 0), ("r1", 0), ("r0", 1), ("r1", 1)] and copies[2].waited and not engine._staged


@pytest.fixture
def engine(model_dir):
    return LLMEngine(load_model(model_dir), EngineConfig(num_kv_blocks=200))


def test_reservation_lease_expires_and_frees_blocks(engine):
    blocks = engine.reserve_kv("r1", 40, lease_s=0.05)
    assert len(blocks) == 3 and engine.block_pool.num_used_blocks == 3
    time.sleep(0.1)
    engine.step()
    assert engine.block_pool.num_used_blocks == 0
    k = torch.zeros(1, *engine.kv_spec.block_shape(1)[1:])
    with pytest.raises(ValueError, match="no KV reservation"):
        engine.write_kv("r1", 0, 0, k, k)


def test_reservation_errors_are_clear_and_leak_nothing(engine):
    engine.reserve_kv("r1", 20, lease_s=10)
    with pytest.raises(ValueError, match="already has a KV reservation"):
        engine.reserve_kv("r1", 20, lease_s=10)
    k = torch.zeros(2, *engine.kv_spec.block_shape(1)[1:])
    with pytest.raises(ValueError, match=r"blocks \[1, 3\) are outside the 2 reserved"):
        engine.write_kv("r1", 0, 1, k, k)
    with pytest.raises(ValueError, match="layer 9"):
        engine.write_kv("r1", 9, 0, k, k)
    with pytest.raises(ValueError, match="reserved 20 tokens of KV but has only 5"):
        engine.admit_reserved("r1", [1, 2, 3, 4], [5], SamplingParams(**GREEDY))
    engine.reserve_kv("r2", 2000, lease_s=10)  # 125 blocks
    with pytest.raises(NoFreeBlocksError):
        engine.reserve_kv("r3", 2000, lease_s=10)
    assert "r3" not in engine.reservations and engine.release_kv("r2")
    with pytest.raises(ValueError, match="2048 tokens of KV leave no room"):
        engine.reserve_kv("r4", 2048, lease_s=10)
    assert engine.abort("r1")  # abort releases a reservation too
    assert not engine.release_kv("r1")
    assert engine.block_pool.num_used_blocks == 0


def test_a_held_reservation_keeps_its_blocks_under_its_key_and_frees_the_request_id(engine):
    blocks = engine.reserve_kv("r1", 40, lease_s=10)
    assert engine.hold_kv("r1", "r1#held-1")  # (a NIXL block sender may still write them)
    again = engine.reserve_kv("r1", 40, lease_s=10)  # the retry of the request
    assert set(again).isdisjoint(blocks) and engine.block_pool.num_used_blocks == 6
    with pytest.raises(ValueError, match="'r1#held-1' already has a KV reservation"):
        engine.hold_kv("r1", "r1#held-1")
    assert engine.release_kv("r1#held-1") and engine.block_pool.num_used_blocks == 3
    assert not engine.hold_kv("r9", "r9#held-1")
    assert engine.release_kv("r1") and engine.block_pool.num_used_blocks == 0


def test_text_continues_across_the_handoff_without_repeats(model_dir):
    """Sender reports the first token and its text; the receiver (report_imported=False) the rest."""
    prompts = ["The class statement", "def f(x):\n    return", "héllo wörld 日本語"]
    sp = SamplingParams(max_new_tokens=25, stop=("ing",), **GREEDY)
    single = LLMEngine(load_model(model_dir), EngineConfig(num_kv_blocks=130)).generate(prompts, sp)
    prefill = LLMEngine(load_model(model_dir), EngineConfig(num_kv_blocks=130))
    decode = LLMEngine(load_model(model_dir), EngineConfig(num_kv_blocks=130))
    for prompt, expected in zip(prompts, single):
        rid = prefill.add_request(prompt, sp, prefill_only=True)
        (first,) = prefill.step()
        tokens, text = list(first.new_token_ids), first.new_text
        if not first.finished:
            handoff = prefill.export_kv(rid)
            decode.reserve_kv(rid, handoff.num_kv_tokens, lease_s=10)
            for layer, (k, v) in enumerate(handoff.layers):
                decode.write_kv(rid, layer, 0, k, v)
            decode.admit_reserved(rid, handoff.prompt_token_ids, handoff.output_token_ids, sp, report_imported=False)
            while decode.has_unfinished_requests():
                for out in decode.step():
                    tokens += out.new_token_ids
                    text += out.new_text
        assert tokens == expected.token_ids
        assert text == expected.text
