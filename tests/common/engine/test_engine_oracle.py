"""The correctness oracle: the engine's greedy output equals stock ``generate`` token for token.

16+ prompts of lengths 1..300 with different max_new_tokens are submitted together, on tiny Llama and
Qwen2 in fp32; again with chunked prefill, with a pool small enough to force preemption, after a KV
export → import into a second engine, and on a sliding-window Mistral. Every block must be back in the
pool afterwards.
"""

from __future__ import annotations

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.loader import load_model
from common.engine.sampling_params import SamplingParams
from tests.conftest import hf_greedy

PROMPT_LENS = [1, 2, 3, 5, 15, 16, 17, 31, 33, 64, 77, 100, 128, 200, 250, 300]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lens]


def max_tokens_for(i: int) -> int:
    return 4 + (i * 7) % 37  # 4..40, different per prompt


def make_engine(model_dir: str, **config) -> LLMEngine:
    return LLMEngine(load_model(model_dir), EngineConfig(**config))


def check_oracle(engine: LLMEngine, reference, prompts) -> list:
    params = [SamplingParams(max_new_tokens=max_tokens_for(i), **GREEDY) for i in range(len(prompts))]
    results = engine.generate(prompts, params)
    for i, (prompt, res) in enumerate(zip(prompts, results)):
        expected = hf_greedy(reference, prompt, max_tokens_for(i), eos_token_id=None)
        assert res.token_ids == expected, f"prompt {i} (len {len(prompt)}) differs from stock generate"
        assert res.finish_reason.value == "length"
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    assert not engine.has_unfinished_requests()
    return results


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_equals_generate(arch, tiny_model_dir, hf_reference):
    d = tiny_model_dir(arch)
    engine = make_engine(d)
    check_oracle(engine, hf_reference(d), make_prompts(engine.vocab_size))


@pytest.mark.parametrize("placement", ["lru", "contiguous"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_with_chunked_prefill(arch, placement, tiny_model_dir, hf_reference):
    d = tiny_model_dir(arch)
    engine = make_engine(d, prefill_chunk_size=24, max_num_batched_tokens=64, kv_block_placement=placement)
    check_oracle(engine, hf_reference(d), make_prompts(engine.vocab_size))


@pytest.mark.parametrize("placement", ["contiguous", "lru"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_with_preemption(arch, placement, tiny_model_dir, hf_reference):
    d = tiny_model_dir(arch)
    # 24 blocks of 16 = 384 tokens for 16 prompts of up to 300 + 40 tokens: decodes must preempt.
    engine = make_engine(d, num_kv_blocks=24, max_model_len=384, kv_block_placement=placement)
    results = check_oracle(engine, hf_reference(d), make_prompts(engine.vocab_size))
    assert sum(r.num_preemptions for r in results) > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_after_kv_export_import(arch, tiny_model_dir, hf_reference):
    d = tiny_model_dir(arch)
    prefill = make_engine(d, num_kv_blocks=256)
    decode = make_engine(d, num_kv_blocks=300)
    decode.block_pool.allocate(7)  # so the imported KV lands in other block ids than it left
    prompts = make_prompts(prefill.vocab_size, seed=1)
    ids = [
        prefill.add_request(p, SamplingParams(max_new_tokens=max_tokens_for(i), **GREEDY), prefill_only=True)
        for i, p in enumerate(prompts)
    ]
    first_tokens = {}
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            assert out.prefilled and not out.finished and len(out.new_token_ids) == 1
            first_tokens[out.request_id] = out.new_token_ids
    source_blocks = {}
    results = {}
    for i, rid in enumerate(ids):
        source_blocks[rid] = list(prefill._requests[rid].block_ids)
        handoff = prefill.export_kv(rid)
        assert handoff.output_token_ids == first_tokens[rid]
        decode.import_kv(handoff, SamplingParams(max_new_tokens=max_tokens_for(i), **GREEDY))
        assert decode._requests[rid].block_ids != source_blocks[rid]
        results[rid] = []
    assert prefill.block_pool.num_free_blocks == prefill.block_pool.num_blocks
    while decode.has_unfinished_requests():
        for out in decode.step():
            results[out.request_id] += out.new_token_ids
    reference = hf_reference(d)
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        assert results[rid] == hf_greedy(reference, prompt, max_tokens_for(i)), f"prompt {i}"
    assert decode.block_pool.num_free_blocks == decode.block_pool.num_blocks - 7


def test_sliding_window_equals_generate(tiny_model_dir, hf_reference):
    d = tiny_model_dir("mistral", sliding_window=24)
    engine = make_engine(d, prefill_chunk_size=40)
    prompts = make_prompts(engine.vocab_size, lens=[3, 20, 24, 25, 50, 90, 130, 47])
    check_oracle(engine, hf_reference(d), prompts)


def test_qwen2_sliding_window_equals_generate(tiny_model_dir, hf_reference):
    d = tiny_model_dir("qwen2", sliding_window=32, use_sliding_window=True, max_window_layers=2)
    engine = make_engine(d)
    prompts = make_prompts(engine.vocab_size, lens=[10, 31, 33, 70, 120])
    check_oracle(engine, hf_reference(d), prompts)


def test_rope_scaling_equals_generate(tiny_model_dir, hf_reference):
    d = tiny_model_dir("llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    engine = make_engine(d)
    check_oracle(engine, hf_reference(d), make_prompts(engine.vocab_size, lens=[7, 60, 140]))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_match_stock_forward(arch, tiny_model_dir, hf_reference):
    """Prefill (packed, mixed lengths) and a decode step give stock HF logits to 1e-4."""
    d = tiny_model_dir(arch)
    engine = make_engine(d)
    reference = hf_reference(d)
    prompts = make_prompts(engine.vocab_size, lens=[1, 9, 40, 130], seed=3)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=3, **GREEDY))
    for step in range(3):
        sched = engine.scheduler.schedule()
        batch = engine.runner.prepare(sched.scheduled)
        logits = engine.runner.run(batch)
        for row, request in zip(logits, batch.sampling_requests):
            with torch.no_grad():
                ref = reference(torch.tensor([request.all_token_ids])).logits[0, -1]
            assert (row - ref).abs().max().item() < 1e-4, f"step {step}"
        for request, n in sched.scheduled:
            request.num_computed_tokens += n
        for request, row in zip(batch.sampling_requests, logits):
            engine._append_token(request, int(row.argmax()), None)
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_bf16_logits_close_to_stock_bf16(tiny_model_dir):
    """bf16 runs the same path; it agrees with stock bf16 up to bf16 rounding (not bit-exact)."""
    from transformers import AutoModelForCausalLM

    d = tiny_model_dir("llama")
    engine = LLMEngine(load_model(d, dtype="bfloat16"), EngineConfig())
    assert engine.kv_spec.dtype == torch.bfloat16
    reference = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    prompts = make_prompts(engine.vocab_size, lens=[5, 50, 200], seed=4)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=2, **GREEDY))
    sched = engine.scheduler.schedule()
    for row, ref in next_logits_and_stock(engine, reference, sched.scheduled):
        assert (row - ref).abs().max().item() < 0.15
        assert int(row.argmax()) == int(ref.argmax())


def next_logits_and_stock(engine: LLMEngine, reference, scheduled) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run one scheduled step by hand: each sampling request's logits beside stock's for the same tokens."""
    batch = engine.runner.prepare(scheduled)
    logits = engine.runner.run(batch)
    with torch.no_grad():
        return [(row, reference(torch.tensor([r.all_token_ids])).logits[0, -1].float())
                for row, r in zip(logits, batch.sampling_requests)]  # fmt: skip


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "pytorch"])
def test_bf16_decode_logits_close_to_stock_bf16(tiny_model_dir, kernels):
    """Decode steps of a bf16 batch (the engine's CPU kernels: bf16 linear layers in its own packing where the CPU
    has AMX, AVX512-BF16 or AVX2, decode attention, RMSNorm; or the PyTorch paths) stay within bf16 rounding of
    stock bf16."""
    from transformers import AutoModelForCausalLM

    from common.engine import cpu_kernels
    from common.engine.cpu_linear import PackedLinear

    if kernels and not cpu_kernels.load():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    d = tiny_model_dir("llama")
    engine = LLMEngine(load_model(d, dtype="bfloat16"), EngineConfig(cpu_kernels=kernels))
    packed = [m for m in engine.loaded.model.modules() if isinstance(m, PackedLinear)]
    amx = "amx_bf16" in cpu_kernels.cpu_flags()
    own = kernels and bool(torch.ops.pdserve.bf16_amx_supported() if amx else torch.ops.pdserve.bf16_linear_supported())
    # without the kernel, a CPU where oneDNN has no bf16 packing (AVX2 only) keeps the stock layers
    assert all(m.own == own for m in packed) and (packed or not own)
    reference = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    for p in make_prompts(engine.vocab_size, lens=[5, 50, 200], seed=4):
        engine.add_request(p, SamplingParams(max_new_tokens=8, **GREEDY))
    for _ in range(5):  # the prefill step, then decode steps
        engine.step()
    sched = engine.scheduler.schedule()
    assert all(n == 1 for _, n in sched.scheduled)
    for row, ref in next_logits_and_stock(engine, reference, sched.scheduled):
        assert (row - ref).abs().max().item() < 0.15
