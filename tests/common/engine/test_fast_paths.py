"""The engine's CPU fast paths keep stock ``generate``'s output: fused sibling projections, RMSNorms and gated
MLPs, decode attention by the engine's CPU kernel (read in place from the paged cache) or, without it, a lone
stream's attention read in place from consecutive blocks, a whole prompt attending to its own K/V
(``is_causal``), with and without a sliding window; each path is shown to be taken, and refused where its
condition fails (blocks out of order, a prompt continuing a cached prefix)."""

from __future__ import annotations

import pytest
import torch

import common.engine.attention as attention
from common.engine import cpu_kernels
from common.engine.config import EngineConfig
from common.engine.cpu_linear import FusedGatedMLP, FusedLinear, FusedRMSNorm, LinearSlice
from common.engine.engine import LLMEngine
from common.engine.fused_attention import RopeAttention
from common.engine.loader import load_model
from common.engine.sampling_params import SamplingParams
from tests.common.engine.test_engine_oracle import GREEDY, make_engine, make_prompts
from tests.conftest import hf_greedy


@pytest.fixture
def path_counts(monkeypatch):
    """How many layer calls took the kernel's or the in-place decode path and the fresh-prompt path."""
    counts = {"in_place": 0, "kernel": 0, "fresh_prompt": 0}
    in_place = attention._in_place_attention
    kernel = attention._kernel_attention

    def counted(*args, **kwargs):
        counts["in_place"] += 1
        return in_place(*args, **kwargs)

    def counted_kernel(*args, **kwargs):
        counts["kernel"] += 1
        return kernel(*args, **kwargs)

    fresh = attention._fresh_attention

    def counted_fresh(*args, **kwargs):  # whole prompts by per-prompt SDPA or the CPU prefill kernel
        counts["fresh_prompt"] += 1
        return fresh(*args, **kwargs)

    monkeypatch.setattr(attention, "_in_place_attention", counted)
    monkeypatch.setattr(attention, "_kernel_attention", counted_kernel)
    monkeypatch.setattr(attention, "_fresh_attention", counted_fresh)
    return counts


def decode_path(kernel: bool) -> str:
    """The decode path an engine built with ``cpu_kernels=kernel`` takes for a lone stream."""
    if kernel and not cpu_kernels.load():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    return "kernel" if kernel else "in_place"


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "pytorch"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_layers_one_stream_at_a_time(arch, kernel, tiny_model_dir, hf_reference, path_counts):
    path = decode_path(kernel)
    d = tiny_model_dir(arch)
    engine = make_engine(d, cpu_kernels=kernel)
    modules = list(engine.loaded.model.modules())
    layers = engine.kv_spec.num_layers
    assert sum(isinstance(m, FusedLinear) for m in modules) == 2 * layers  # q/k/v and gate/up of every layer
    # with the kernels, each MLP is one FusedGatedMLP (gate/up product, pdserve::silu_mul, down) without slices
    assert sum(isinstance(m, FusedGatedMLP) for m in modules) == (layers if kernel else 0)
    assert sum(isinstance(m, LinearSlice) for m in modules) == (3 if kernel else 5) * layers
    # and each attention one RopeAttention (the q/k/v product rotated in place by pdserve::rotary_)
    assert sum(isinstance(m, RopeAttention) for m in modules) == (layers if kernel else 0)
    assert sum(isinstance(m, FusedRMSNorm) for m in modules) == (4 if arch == "qwen3" else 2) * layers + 1
    assert all(m.kernel == kernel for m in modules if isinstance(m, FusedRMSNorm))  # pdserve::rms_norm or F.rms_norm
    reference = hf_reference(d)
    prompts = make_prompts(engine.vocab_size, lens=[1, 17, 70], seed=5)
    results = [engine.generate([p], SamplingParams(max_new_tokens=20, **GREEDY))[0] for p in prompts]
    # the prompts of 17 and 70 tokens in one step each, from position 0; a 1-token prompt is decode-shaped
    assert path_counts["fresh_prompt"] == 2 * layers
    # every other step of a lone stream; with the kernels the first (the 1-token prompt's) twice: the flat
    # forward's one check against the model's own
    assert path_counts[path] == (20 + 19 + 19 + kernel) * layers
    for prompt, result in zip(prompts, results):  # (stock generate's own causal SDPA calls come after counting)
        assert result.token_ids == hf_greedy(reference, prompt, 20)


def test_in_place_decode_takes_attention_outputs_of_any_layout(tiny_model_dir, hf_reference, path_counts,
                                                               monkeypatch):
    """CUDA's memory-efficient SDPA kernel (fp32's) returns its output as [B, M, H, D] memory transposed to
    [B, H, M, D]: the in-place decode path must merge the query heads of each KV head by reshape, as a view of that
    layout fails. Here SDPA hands back every output in that layout."""
    d = tiny_model_dir("llama")
    engine = make_engine(d, cpu_kernels=False)
    prompt = make_prompts(engine.vocab_size, lens=[9], seed=8)[0]
    want = hf_greedy(hf_reference(d), prompt, 12)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def transposed(*args, **kwargs):
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", transposed)
    result = engine.generate([prompt], SamplingParams(max_new_tokens=12, **GREEDY))[0]
    assert path_counts["in_place"] == 11 * engine.kv_spec.num_layers
    assert result.token_ids == want


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "pytorch"])
def test_sliding_window_on_the_fast_paths(kernel, tiny_model_dir, hf_reference, path_counts):
    """Window 24: a 20-token prompt takes the causal path, a 50-token one the masked one (or, on the engine's CPU
    prefill kernel, the causal path too: the kernel applies the window); decoding past the window reads only its
    last 24 keys in place."""
    path = decode_path(kernel)
    d = tiny_model_dir("mistral", sliding_window=24)
    engine = make_engine(d, cpu_kernels=kernel)
    reference = hf_reference(d)
    layers = engine.kv_spec.num_layers
    prompts = make_prompts(engine.vocab_size, lens=[20, 50], seed=6)
    results = []
    windowed = layers if engine.runner.prefill_kernel else 0
    # with the kernels the first prompt's step runs twice (the flat forward's one check against the model's own)
    for prompt, fresh in zip(prompts, ((1 + kernel) * layers, windowed)):
        before = path_counts["fresh_prompt"]
        results.append(engine.generate([prompt], SamplingParams(max_new_tokens=30, **GREEDY))[0])
        assert path_counts["fresh_prompt"] - before == fresh
    assert path_counts[path] == 2 * 29 * layers
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(reference, prompt, 30)


def test_fast_paths_refused_when_their_condition_fails(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), block_size=4, cpu_kernels=False)
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


def test_kernel_decode_group_carries_its_table_and_lengths(tiny_model_dir):
    """With the kernel, every decode group (alone or beside a prefill group) carries what the kernel reads,
    whatever the order of its blocks."""
    decode_path(True)
    engine = make_engine(tiny_model_dir("llama"), block_size=4)
    engine.add_request(list(range(10, 30)), SamplingParams(max_new_tokens=8, **GREEDY))
    ((request, n),) = engine.scheduler.schedule().scheduled
    request.num_computed_tokens = 13
    request.block_ids[1], request.block_ids[2] = request.block_ids[2], request.block_ids[1]
    group = engine.runner.prepare([(request, 1)]).attn.groups[0]
    assert group.first_block is None
    assert group.block_table.tolist() == [request.block_ids[:4]] and group.seq_lens.tolist() == [14]
    # a second sequence in prefill: the decode group comes first, then the prefill one
    engine.add_request(list(range(40, 50)), SamplingParams(max_new_tokens=2, **GREEDY))
    prefill, k = next((r, k) for r, k in engine.scheduler.schedule().scheduled if r is not request)
    groups = engine.runner.prepare([(request, 1), (prefill, k)]).attn.groups
    assert groups[0].block_table.tolist() == [request.block_ids[:4]] and groups[0].seq_lens.tolist() == [14]
    assert groups[1].seq_lens is None


def test_a_second_engine_on_the_same_loaded_model_fuses_nothing_twice(tiny_model_dir, hf_reference):
    """Engines may share a loaded model (tests do): the second finds the attention already a RopeAttention and
    leaves it, and both give stock generate's tokens."""
    decode_path(True)
    d = tiny_model_dir("llama")
    loaded = load_model(d)
    engines = [LLMEngine(loaded, EngineConfig()) for _ in range(2)]
    modules = list(loaded.model.modules())
    assert sum(isinstance(m, RopeAttention) for m in modules) == engines[0].kv_spec.num_layers
    assert not any(isinstance(m.inner, RopeAttention) for m in modules if isinstance(m, RopeAttention))
    prompt = make_prompts(engines[0].vocab_size, lens=[9], seed=3)[0]
    expected = hf_greedy(hf_reference(d), prompt, 8)
    for engine in engines:
        assert engine.generate([prompt], SamplingParams(max_new_tokens=8, **GREEDY))[0].token_ids == expected
