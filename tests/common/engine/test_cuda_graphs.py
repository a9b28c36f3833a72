"""Decode steps through :class:`common.engine.cuda_graphs.DecodeGraphs`, here on the CPU where its static-shape path
runs eagerly (no graph: the same padded batches, block tables, scratch block and buckets a GPU's graphs replay):
stock ``generate``'s tokens for batches and contexts across buckets, sliding windows included; padding rows write
only the scratch block; a graph whose replay differs from the eager forward, or that cannot be recorded, turns the
graphs off and the step's tokens stay right; steps that stream a prompt's KV per layer stay eager. The CUDA
capture itself is tested in ``tests/gpu/test_cuda_engine.py`` (marked gpu)."""

from __future__ import annotations

import logging

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.cuda_graphs import DecodeGraphs, batch_buckets, block_buckets
from common.engine.engine import LLMEngine
from common.engine.loader import load_model
from common.engine.sampling_params import SamplingParams
from tests.common.engine.test_engine_oracle import GREEDY, make_prompts
from tests.conftest import hf_greedy


def engine_for(model_dir: str, **config) -> LLMEngine:
    return LLMEngine(load_model(model_dir), EngineConfig(prefix_caching=False, cuda_graphs=True, **config))


def generate_staggered(engine: LLMEngine, prompts: list[list[int]], new_tokens: list[int]) -> list[list[int]]:
    """One prompt added a step (the batch grows and shrinks across buckets); greedy tokens of each."""
    pending = list(enumerate(prompts))
    results: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while pending or engine.has_unfinished_requests():
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens[i], **GREEDY), request_id=str(i))
        for out in engine.step():
            results[out.request_id] += out.new_token_ids
    return [results[str(i)] for i in range(len(prompts))]


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert block_buckets(1) == [1]
    assert block_buckets(5) == [1, 2, 3, 4, 5]
    assert block_buckets(128) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]
    assert block_buckets(100) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100]


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {"sliding_window": 24}),
                                            ("mistral", {"sliding_window": 24})],
                         ids=["llama", "qwen2-window", "mistral-window"])  # fmt: skip
def test_stock_generate_tokens_across_buckets(arch, overrides, tiny_model_dir, hf_reference):
    d = tiny_model_dir(arch, **overrides)
    engine = engine_for(d, max_num_seqs=12, max_num_batched_tokens=128)
    assert engine.kv_cache.num_blocks == engine.block_pool.num_blocks + 1  # the scratch block
    prompts = make_prompts(engine.vocab_size, lens=[5, 40, 90, 1, 17, 33, 3, 60, 8, 24, 50], seed=5)
    new_tokens = [30 - (i * 3) % 17 for i in range(len(prompts))]
    got = generate_staggered(engine, prompts, new_tokens)
    stats = engine.runner.graphs.stats()
    assert stats["enabled"] and not stats["capture"] and stats["captured"] == 0
    assert stats["steps"] >= 20 and stats["buckets"] >= 6, stats
    reference = hf_reference(d)
    for i, prompt in enumerate(prompts):
        assert got[i] == hf_greedy(reference, prompt, new_tokens[i]), f"prompt {i}"


def test_padding_rows_write_only_the_scratch_block(tiny_model_dir):
    engine = engine_for(tiny_model_dir("llama"), max_num_seqs=8)
    prompts = make_prompts(engine.vocab_size, lens=[20, 7, 33], seed=2)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=6, **GREEDY))
    engine.step()  # the prompts
    scratch = engine.runner.graphs.scratch_block
    owned = sorted({b for r in engine._requests.values() for b in r.block_ids})
    before = engine.kv_cache.data.clone()
    engine.step()  # a decode step of 3 sequences, padded to 4
    assert engine.runner.graphs.num_steps == 1
    changed = (engine.kv_cache.data != before).flatten(4).any(-1)  # [L, 2, H, blocks]
    touched = sorted(torch.nonzero(changed.any(0).any(0).any(0)).flatten().tolist())
    assert scratch in touched and set(touched) - {scratch} <= set(owned)


def test_a_differing_graph_turns_the_graphs_off(tiny_model_dir, hf_reference, caplog):
    d = tiny_model_dir("llama")
    engine = engine_for(d)
    graphs = engine.runner.graphs

    def perturbed(bc, nc):
        eager, replay = DecodeGraphs._record(graphs, bc, nc)
        return eager, lambda: replay() + 1e-3 * torch.arange(eager.shape[-1], dtype=eager.dtype)

    graphs._record = perturbed
    prompts = make_prompts(engine.vocab_size, lens=[12, 30], seed=4)
    with caplog.at_level(logging.WARNING, logger="common.engine.cuda_graphs"):
        got = [r.token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=12, **GREEDY))]
    assert not graphs.enabled and "other logits than the eager forward" in graphs.disabled_because
    assert graphs.num_steps == 1 and "CUDA graphs off" in caplog.text
    reference = hf_reference(d)
    assert got == [hf_greedy(reference, p, 12) for p in prompts]


def test_a_graph_that_cannot_be_recorded_turns_the_graphs_off(tiny_model_dir, hf_reference):
    d = tiny_model_dir("llama")
    engine = engine_for(d)
    graphs = engine.runner.graphs

    def failing(bc, nc):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs._record = failing
    prompt = make_prompts(engine.vocab_size, lens=[21], seed=6)[0]
    got = engine.generate([prompt], SamplingParams(max_new_tokens=10, **GREEDY))[0].token_ids
    assert not graphs.enabled and "not permitted" in graphs.disabled_because
    assert got == hf_greedy(hf_reference(d), prompt, 10)


def test_steps_that_stream_a_prompts_kv_stay_eager(tiny_model_dir):
    engine = engine_for(tiny_model_dir("llama"))
    engine.add_request(make_prompts(engine.vocab_size, lens=[10], seed=1)[0], SamplingParams(max_new_tokens=5))
    engine.step()
    sched = engine.scheduler.schedule()
    assert engine.runner.prepare(sched.scheduled).graph_step is not None
    eager = engine.runner.prepare(sched.scheduled, graphs=False)
    assert eager.graph_step is None and eager.attn is not None


def test_capture_needs_a_cuda_device(tiny_model_dir):
    engine = engine_for(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(engine.runner.forward, engine.kv_cache, max_batch=4, max_blocks=8,
                     scratch_block=engine.block_pool.num_blocks, capture=True)  # fmt: skip
    assert LLMEngine(load_model(tiny_model_dir("llama")), EngineConfig()).runner.graphs is None  # off by default


# operators that read a device tensor's value on the host (or size their output by it): a CUDA graph cannot record
# them (the stream would have to synchronize mid-capture); lift_fresh: a tensor made from Python data in the
# forward (a host-to-device copy on CUDA)
_HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
               "unique_dim", "lift_fresh"}  # fmt: skip


def test_the_recorded_forward_never_reads_a_tensor_on_the_host(tiny_model_dir):
    """What a graph records (static inputs → metadata → the model's own forward with stock modules, as on CUDA)
    makes none of the operator calls that cannot be captured, whatever the bucket."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []
            self.calls: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.add(func.overloadpacket.__name__)
            if func.overloadpacket.__name__ in _HOST_READS:
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    for arch, overrides in (("llama", {}), ("qwen2", {"sliding_window": 24})):
        engine = engine_for(tiny_model_dir(arch, **overrides), cpu_kernels=False, cpu_packed_linear=False,
                            max_num_seqs=8)  # fmt: skip
        assert engine.runner.flat is None  # the model's own forward, as on a GPU
        for p in make_prompts(engine.vocab_size, lens=[20, 7, 40], seed=2):
            engine.add_request(p, SamplingParams(max_new_tokens=4, **GREEDY))
        engine.step()
        engine.step()  # one decode step: the static inputs hold a real batch
        graphs = engine.runner.graphs
        assert graphs.num_steps == 1
        for bucket in ((4, 3), (8, 4), (1, 1)):
            with torch.inference_mode(), Watch() as watch:
                logits = graphs._forward(*bucket)
            assert logits.shape == (bucket[0], engine.vocab_size)
            assert watch.seen == [], (arch, bucket, watch.seen)
            assert {"index_copy_", "index_select", "linear", "mul", "add"} <= watch.calls, sorted(watch.calls)
    # the watch sees what it looks for: the eager path's per-step metadata is built from host data
    with torch.inference_mode(), Watch() as watch:
        torch.tensor([1, 2]).nonzero()
    assert "aten.lift_fresh.default" in watch.seen and "aten.nonzero.default" in watch.seen
