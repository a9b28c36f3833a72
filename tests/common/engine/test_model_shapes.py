"""The engine on the head layouts of released checkpoints, against stock ``transformers``.

The oracle tests run the tiny preset (4 heads of 32 over 2 KV heads). Released Llama, Qwen2/3 and Mistral models have
other layouts, and each reaches other branches of the engine's kernels (query groups of 3, 6 and 7, heads of 80,
96 and 128, a head size set apart from ``hidden_size / heads``, widths that are no multiple of a kernel's block).
Each case keeps a checkpoint's head layout with two layers and small widths, and asks of the engine what the oracle
asks: fp32 greedy output equal to stock ``generate`` (prompts over several blocks, chunked prefill, a batch of
them), bf16 decode logits within bf16 rounding of stock bf16.
"""

from __future__ import annotations

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.loader import load_model
from common.engine.sampling_params import SamplingParams
from tests.conftest import hf_greedy

# name: (architecture, config overrides); the head layout of the checkpoint named, narrower otherwise
SHAPES = {
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                   intermediate_size=1216)),  # groups of 7 heads of 64
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=384, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                                   intermediate_size=960)),  # groups of 6 heads of 128
    "llama-3.2-3b": ("llama", dict(hidden_size=384, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                                   intermediate_size=1000)),  # groups of 3; 1000: no multiple of 16
    "qwen3-4b": ("qwen3", dict(hidden_size=256, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               intermediate_size=640)),  # groups of 4 heads of 128, each q and k head RMS-normed
    "llama-2": ("llama", dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=8,
                              intermediate_size=1376)),  # no grouping
    "heads-of-96": ("llama", dict(hidden_size=384, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=1024)),
    "mistral-heads-of-80": ("mistral", dict(hidden_size=320, num_attention_heads=4, num_key_value_heads=4,
                                            intermediate_size=864, sliding_window=48)),
}
PROMPT_LENS = [1, 17, 33, 77, 150]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def build(tiny_model_dir, name: str) -> str:
    arch, overrides = SHAPES[name]
    return tiny_model_dir(arch, num_hidden_layers=2, vocab_size=4096, **overrides)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("name", list(SHAPES))
def test_fp32_greedy_equals_generate(name, tiny_model_dir, hf_reference):
    d = build(tiny_model_dir, name)
    engine = LLMEngine(load_model(d), EngineConfig(prefill_chunk_size=48, max_num_batched_tokens=128))
    batch = prompts(engine.vocab_size)
    results = engine.generate(batch, [SamplingParams(max_new_tokens=10, **GREEDY)] * len(batch))
    reference = hf_reference(d)
    for prompt, res in zip(batch, results):
        assert res.token_ids == hf_greedy(reference, prompt, 10), f"prompt of {len(prompt)} tokens"
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


@pytest.mark.parametrize("name", list(SHAPES))
def test_bf16_decode_logits_close_to_stock(name, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    d = build(tiny_model_dir, name)
    engine = LLMEngine(load_model(d, dtype="bfloat16"), EngineConfig())
    reference = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    for p in prompts(engine.vocab_size):
        engine.add_request(p, SamplingParams(max_new_tokens=20, **GREEDY))
    for _ in range(4):  # the prefill step, then decode steps
        engine.step()
    scheduled = engine.scheduler.schedule().scheduled
    assert scheduled and all(n == 1 for _, n in scheduled)
    batch = engine.runner.prepare(scheduled)
    logits = engine.runner.run(batch)
    with torch.no_grad():
        for row, request in zip(logits, batch.sampling_requests):
            stock = reference(torch.tensor([request.all_token_ids])).logits[0, -1].float()
            assert (row - stock).abs().max().item() < 0.15, f"prompt of {len(request.prompt_token_ids)} tokens"
