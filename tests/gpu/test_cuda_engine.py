"""The engine on a CUDA device; every test is marked ``gpu`` and skips without one (tests/conftest.py).

- bf16: first-step logits within bf16 tolerance of stock bf16 (twice stock's own error against fp32, + 1e-2),
  and greedy output equal to stock ``generate`` in bf16 up to the first divergence, which must fall on a near-tie
  of stock's logits (the two tokens within twice that tolerance: what rounding can flip, and nothing else);
- fp32: logits to 1e-4 and greedy output token for token equal to stock ``generate``;
- the disaggregated path: a prefill engine streams each layer's KV through the wire format (staged in pinned host
  memory) into a decode engine's reserved blocks; the result equals one engine's output exactly;
- the staging itself: CUDA KV lands in pinned host memory, bit-exact, in a buffer of its own per call;
- NIXL block writes from one CUDA cache into another (VRAM registered with NIXL), each layer read only after the
  kernels that wrote it ran (where NIXL is installed).
"""

from __future__ import annotations

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.loader import load_model
from common.engine.sampling_params import SamplingParams
from common.kv_transfer.staging import to_host
from common.kv_transfer.wire import TransferAssembler, decode_chunk, iter_layer_chunks
from tests.common.engine.test_engine_oracle import GREEDY, make_prompts, max_tokens_for

CUDA = "cuda"
BF16_ATOL = 1e-2


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def stock_model(model_dir: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(CUDA).eval()


@torch.inference_mode()
def stock_last_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens], device=CUDA)).logits[0, -1].float()


@torch.inference_mode()
def stock_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=CUDA)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=model.generation_config.pad_token_id)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def engine_first_step_logits(engine: LLMEngine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The engine's logits for each prompt's first token, all prompts in one packed step (then aborted)."""
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=1, **GREEDY)) for p in prompts]
    sched = engine.scheduler.schedule()
    assert len(sched.scheduled) == len(prompts), "the prompts must fit one step"
    batch = engine.runner.prepare(sched.scheduled)
    logits = engine.runner.run(batch)
    rows = {r.request_id: row for r, row in zip(batch.sampling_requests, logits)}
    for rid in ids:
        engine.abort(rid)
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    return [rows[rid] for rid in ids]


@pytest.mark.gpu
def test_bf16_logits_and_greedy_agree_with_stock_bf16_up_to_rounding(model_dir):
    engine = LLMEngine(load_model(model_dir, dtype="bfloat16", device=CUDA), EngineConfig(num_kv_blocks=400))
    assert engine.kv_cache.data.is_cuda and engine.kv_spec.dtype == torch.bfloat16
    stock, fp32 = stock_model(model_dir, torch.bfloat16), stock_model(model_dir, torch.float32)
    prompts = make_prompts(engine.vocab_size, lens=[5, 60, 200, 400], seed=21)

    rows = engine_first_step_logits(engine, prompts)
    stock_rows = [stock_last_logits(stock, p) for p in prompts]
    stock_err = max(float((s - stock_last_logits(fp32, p)).abs().max()) for s, p in zip(stock_rows, prompts))
    tol = 2 * stock_err + BF16_ATOL
    diff = max(float((row - s).abs().max()) for row, s in zip(rows, stock_rows))
    assert diff <= tol, f"first-step logits differ from stock bf16 by {diff} (tolerance {tol})"

    results = engine.generate(prompts, SamplingParams(max_new_tokens=64, **GREEDY))
    agreeing = 0
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        expected = stock_greedy(stock, prompt, 64)
        n = min(len(expected), len(result.token_ids))  # stock stops at EOS, the engine ignores it
        first = next((j for j in range(n) if expected[j] != result.token_ids[j]), None)
        if first is None:
            agreeing += n
            continue
        agreeing += first
        logits = stock_last_logits(stock, prompt + expected[:first])
        gap = abs(float(logits[expected[first]] - logits[result.token_ids[first]]))
        assert gap <= 2 * tol, (f"prompt {i} diverges from stock at token {first}, where stock's logits separate the "
                                f"two tokens by {gap} > 2 x {tol}: not a rounding near-tie")  # fmt: skip
    assert agreeing > 0
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


@pytest.mark.gpu
def test_fp32_greedy_equals_stock_generate_token_for_token(model_dir):
    engine = LLMEngine(load_model(model_dir, dtype="float32", device=CUDA), EngineConfig(num_kv_blocks=600))
    stock = stock_model(model_dir, torch.float32)
    prompts = make_prompts(engine.vocab_size)  # 16 prompts of 1..300 tokens
    for i, (row, prompt) in enumerate(zip(engine_first_step_logits(engine, prompts), prompts)):
        assert float((row - stock_last_logits(stock, prompt)).abs().max()) < 1e-4, f"prompt {i}"
    params = [SamplingParams(max_new_tokens=max_tokens_for(i), **GREEDY) for i in range(len(prompts))]
    for i, (prompt, result) in enumerate(zip(prompts, engine.generate(prompts, params))):
        assert result.token_ids == stock_greedy(stock, prompt, max_tokens_for(i)), f"prompt {i} (len {len(prompt)})"
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


@pytest.mark.gpu
def test_fp32_lone_streams_read_their_consecutive_blocks_in_place(model_dir, monkeypatch):
    """One stream at a time in fp32: its decode steps read its consecutive blocks in place, where CUDA's
    memory-efficient SDPA kernel returns a transposed output; tokens equal stock generate's."""
    import common.engine.attention as attention

    calls = []
    in_place = attention._in_place_attention
    monkeypatch.setattr(attention, "_in_place_attention", lambda *a, **k: calls.append(1) or in_place(*a, **k))
    engine = LLMEngine(load_model(model_dir, dtype="float32", device=CUDA), EngineConfig(num_kv_blocks=200))
    stock = stock_model(model_dir, torch.float32)
    for prompt in make_prompts(engine.vocab_size, lens=[7, 50, 130], seed=31):
        result = engine.generate([prompt], SamplingParams(max_new_tokens=20, **GREEDY))[0]
        assert result.token_ids == stock_greedy(stock, prompt, 20)
    assert calls


@pytest.mark.gpu
def test_spilled_blocks_leave_the_device():
    """Blocks evicted to the KV spill tiers are copied to host memory (Redis takes them as bytes) and load back."""
    from common.engine.kv_cache import KVCacheSpec, PagedKVCache

    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    cache = PagedKVCache(spec, 8, device=CUDA)
    cache.data.normal_()
    kv = cache.copy_block(3)
    assert kv.device.type == "cpu" and torch.equal(kv, cache.data[:, :, :, 3].cpu())
    cache.load_block(5, kv)
    assert torch.equal(cache.data[:, :, :, 5], cache.data[:, :, :, 3])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_streamed_over_the_wire_between_two_cuda_engines_continues_exactly(model_dir, dtype):
    prompts = make_prompts(4096, lens=[1, 16, 17, 100, 250, 300], seed=11)
    params = [SamplingParams(max_new_tokens=max_tokens_for(i), **GREEDY) for i in range(len(prompts))]
    single = LLMEngine(load_model(model_dir, dtype=dtype, device=CUDA), EngineConfig(num_kv_blocks=300))
    expected = [r.token_ids for r in single.generate(prompts, params)]

    chunks: dict[str, list[bytes]] = {}

    def sink(rid: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:  # what a KV sender does with a layer
        assert k.device.type == "cpu" and k.is_pinned() and v.is_pinned()  # staged off the GPU as computed
        sent = chunks.setdefault(rid, [])
        sent.extend(bytes(c) for c in iter_layer_chunks(rid, layer, k, v, 64 << 10, first_seq=len(sent)))

    prefill = LLMEngine(load_model(model_dir, dtype=dtype, device=CUDA), EngineConfig(num_kv_blocks=300),
                        kv_layer_sink=sink)  # fmt: skip
    ids = [prefill.add_request(p, sp, prefill_only=True) for p, sp in zip(prompts, params)]
    while prefill.has_unfinished_requests():
        prefill.step()
    handoffs = {rid: prefill.export_kv(rid, with_kv=False) for rid in ids}  # the KV already left, layer by layer
    assert prefill.block_pool.num_free_blocks == prefill.block_pool.num_blocks

    decode = LLMEngine(load_model(model_dir, dtype=dtype, device=CUDA), EngineConfig(num_kv_blocks=400))
    decode.block_pool.allocate(5)  # other block ids than the sender's
    out: dict[str, list[int]] = {}
    for rid, sp in zip(ids, params):
        h = handoffs[rid]
        blocks = decode.reserve_kv(rid, h.num_kv_tokens, lease_s=30)
        assembler = TransferAssembler(rid, decode.kv_spec.num_layers, len(blocks), decode.kv_spec,
                                      lambda layer, first, k, v, rid=rid: decode.write_kv(rid, layer, first, k, v))
        for chunk in reversed(chunks[rid]):  # any order
            assembler.feed(chunk)
        assert assembler.complete
        decode.admit_reserved(rid, h.prompt_token_ids, h.output_token_ids, sp, h.generator_state)
        out[rid] = []
    while decode.has_unfinished_requests():
        for o in decode.step():
            out[o.request_id] += o.new_token_ids
    assert [out[rid] for rid in ids] == expected
    assert decode.block_pool.num_free_blocks == decode.block_pool.num_blocks - 5


@pytest.mark.gpu
def test_to_host_stages_cuda_kv_in_pinned_memory_bit_exact():
    g = torch.Generator(device=CUDA).manual_seed(0)
    k, v = (torch.randn(3, 2, 16, 8, device=CUDA, generator=g, dtype=torch.bfloat16) for _ in range(2))
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [3, 16, 2, 8], not contiguous: as read from a head-major cache
    hk, hv = to_host(k, v)
    assert hk.device.type == "cpu" and hk.is_pinned() and hv.is_pinned() and hk.is_contiguous()
    assert torch.equal(hk, k.cpu()) and torch.equal(hv, v.cpu())
    k2, v2 = k + 1, v + 1
    to_host(k2, v2)  # a second staging must not reuse the memory the first one's tensors still hold
    assert torch.equal(hk, k.cpu()) and torch.equal(hv, v.cpu())
    (chunk,) = iter_layer_chunks("r", 0, k, v, 1 << 20, last=True)
    _, dk, dv = decode_chunk(bytes(chunk))
    assert torch.equal(dk, k.cpu()) and torch.equal(dv, v.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_steps_equal_the_eager_engine(model_dir, dtype):
    """Decode steps replayed from CUDA graphs (batches and contexts across buckets, one prompt added a step): the
    graphs were captured and stayed on; fp32 tokens are the eager engine's and stock generate's, bf16 ones agree
    with the eager engine's (up to a first divergence per prompt) on at least 80% of the tokens."""
    from tests.common.engine.test_cuda_graphs import generate_staggered

    prompts = make_prompts(4096, lens=[5, 40, 90, 1, 17, 33, 3, 60, 8, 24, 50], seed=5)
    new_tokens = [40 - (i * 3) % 17 for i in range(len(prompts))]
    results = {}
    for graphs in (False, True):
        engine = LLMEngine(load_model(model_dir, dtype=dtype, device=CUDA),
                           EngineConfig(num_kv_blocks=300, max_num_seqs=12, prefix_caching=False, cuda_graphs=graphs))
        results[graphs] = generate_staggered(engine, prompts, new_tokens)
        if graphs:
            stats = engine.runner.graphs.stats()
            assert stats["enabled"] and stats["capture"], stats
            assert stats["captured"] >= 4 and stats["steps"] >= 30, stats  # 6 shapes with the buckets of 2026-12
    if dtype == "float32":
        assert results[True] == results[False]
        stock = stock_model(model_dir, torch.float32)
        for i, prompt in enumerate(prompts):
            assert results[True][i] == stock_greedy(stock, prompt, new_tokens[i]), f"prompt {i}"
    else:  # a padded batch may pick other bf16 matmul kernels: rounding may flip a near-tie, and nothing more
        agree = sum(next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                    for x, y in zip(results[True], results[False]))  # fmt: skip
        assert agree >= 0.8 * sum(new_tokens), (agree, sum(new_tokens))


@pytest.mark.gpu
def test_prompts_of_one_step_through_the_varlen_kernel(model_dir):
    """In bf16, a step of whole prompts goes to the installed varlen kernel (flash-attn's or torch's), which passed
    its check against per-prompt SDPA; the tokens agree with one-prompt-at-a-time steps (no varlen call)."""
    from common.engine.attention import varlen_kernel

    kernel = varlen_kernel(torch.empty(1, device=CUDA, dtype=torch.bfloat16))
    if kernel is None:
        pytest.skip("no varlen attention kernel installed for CUDA bf16")
    engine = LLMEngine(load_model(model_dir, dtype="bfloat16", device=CUDA), EngineConfig(num_kv_blocks=400))
    prompts = make_prompts(engine.vocab_size, lens=[5, 60, 200, 400, 33], seed=23)
    together = [r.token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=16, **GREEDY))]
    assert "causal" in kernel.verified and not kernel.failed, kernel.failed
    alone = [engine.generate([p], SamplingParams(max_new_tokens=16, **GREEDY))[0].token_ids for p in prompts]
    agree = sum(next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(together, alone))
    assert agree >= 0.8 * 16 * len(prompts), (agree, together, alone)


@pytest.mark.gpu
def test_nixl_block_writes_move_cuda_blocks_once_their_kernels_ran():
    from common.engine.kv_cache import KVCacheSpec, PagedKVCache
    from common.kv_transfer import nixl, nixl_blocks

    if nixl.nixl_api() is None:
        pytest.skip(nixl.unavailable_reason())
    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    src, dst = PagedKVCache(spec, 64, device=CUDA), PagedKVCache(spec, 64, device=CUDA)
    receiver = nixl.NixlKVReceiver(kv_cache=dst)
    sender = nixl_blocks.NixlBlockSender(receiver.metadata, src)
    src_ids, dst_ids = [3, 4, 5, 9], [10, 11, 30, 31]
    try:
        receiver.expect("req", spec.num_layers, len(dst_ids), spec, lambda *args: None, deadline_s=60.0)
        assert receiver.offer_blocks("req", dst_ids)
        sender.claim("req", dst_ids, spec.num_layers)
        big = torch.randn(4096, 4096, device=CUDA)
        for layer in range(spec.num_layers):
            for _ in range(4):
                big = big @ big / 64  # the stream is busy: the layer's KV below is written late
            src.data[layer, :, :, src_ids] = torch.randn(2, 2, len(src_ids), 16, 64, device=CUDA, dtype=spec.dtype)
            sender.send_blocks("req", layer, src_ids)  # as the engine does, right after queueing the layer
        assert sender.finish("req", timeout_s=60.0).ok and receiver.wait("req", timeout_s=5.0).ok
        landed, sent = dst.data[:, :, :, dst_ids], src.data[:, :, :, src_ids]
        assert torch.equal(landed.view(torch.int16), sent.view(torch.int16))
    finally:
        sender.close()
        receiver.close()
