"""The engine on the families of checkpoints ``transformers`` ships, beyond Llama, Qwen2 and Mistral.

Each case is a two-layer random checkpoint of the family's own classes (the tokenizer of the tiny Llama beside
it). What the engine serves must give stock ``generate``'s greedy tokens in fp32 (prompts over several blocks,
chunked prefill, a batch); what it cannot compute as ``transformers`` does (common/engine/model_support.py) must
be refused when the engine is built, with the reason named: a refusal nobody sees fails this file. Gemma 2's soft
cap and GPT-OSS's sink logits are served by common/engine/attention_math.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers

import common.engine.attention as attention
from common.engine import cpu_kernels
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.loader import load_model
from common.engine.model_support import AttentionShape, UnsupportedModelError, check_model
from common.engine.sampling_params import SamplingParams
from tests.cli import pdserve
from tests.conftest import hf_greedy

VOCAB = 4096
BASE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)  # fmt: skip
TWO_TYPES = ["sliding_attention", "full_attention"]
# GPT-2's config names (used in place of BASE where given)
GPT2_STYLE = dict(vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=4, n_positions=512, bos_token_id=1, eos_token_id=2)

# name: (config class, causal-LM class, config overrides[, a gain on the q and k weights])
SERVED = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),  # q/k norms
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=32)),  # scaled embeddings, GeLU
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=32, sliding_window=48, layer_types=TWO_TYPES)),
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM",  # the last two layers reuse the K/V of earlier ones
                dict(head_dim=32, num_hidden_layers=4, num_kv_shared_layers=2, layer_types=TWO_TYPES * 2,
                     sliding_window=48, laurel_rank=8, altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4,
                     intermediate_size=[256] * 4, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),  # fused qkv and gate/up
    "phi": ("PhiConfig", "PhiForCausalLM", {}),  # partial rotary, parallel attention and MLP
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", GPT2_STYLE),  # learned absolute positions
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {**GPT2_STYLE, "multi_query": True}),  # 1 KV head
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {**GPT2_STYLE, "rotary_dim": 16}),  # interleaved partial rotary
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.25)),  # no num_key_value_heads of its own
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=256, word_embed_proj_dim=128)),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(sliding_window=48)),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(head_dim=32)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),  # layers without RoPE
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(head_dim=32, sliding_window=48)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=128)),  # fmt: skip
    # the experts below and above on the engine's packed kernels (common/engine/moe.py)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2)),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(head_dim=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      first_k_dense_replace=1, n_group=1, topk_group=1)),  # fmt: skip
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                     dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=64)),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM",
                    dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=64))),  # fmt: skip
    "qwen2_yarn": ("Qwen2Config", "Qwen2ForCausalLM",
                   dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128))),
    # logit extras, computed by the CPU kernels and common/engine/attention_math.py: a soft cap (q and k weights 8x:
    # logits large enough for it to change the output), sink logits
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=32, sliding_window=48, layer_types=TWO_TYPES, attn_logit_softcapping=2.0), 8.0),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=48,
                     layer_types=TWO_TYPES)),
}

# name: (config class, causal-LM class, config overrides, what the refusal must say)
REFUSED = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1,
                         kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                         n_group=1, topk_group=1),  # keys of 16 + 16, values of 16: latent attention's shapes
                    "keys [heads 4, size 32] and values [heads 4, size 16] do not fit one paged KV cache"),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}, "does not pass keyword arguments on"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(head_dim=32, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                        linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64),
                   "1 attention calls over layers [1] in a forward of its 2 layers"),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(layer_types=["conv", "full_attention"], block_ff_dim=256),
             "(layer_types ['conv', 'full_attention'])"),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(head_dim=32, num_local_experts=2, num_experts_per_tok=1, intermediate_size_mlp=256,
                    no_rope_layers=[1, 0], attention_chunk_size=64),
               "chunks of 64 tokens, which the engine does not compute; max_model_len 512 is longer"),
}
PROMPT_LENS = [1, 17, 77, 150]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir, tmp_path_factory):
    """``checkpoint(name, table)`` -> the directory of that family's random checkpoint, built once."""
    tokenizer_dir = Path(tiny_model_dir("llama"))
    built: dict[str, str] = {}

    def get(name: str, table: dict) -> str:
        if name not in built:
            config_cls, model_cls, overrides = table[name][:3]
            kwargs = overrides if "n_embd" in overrides else {**BASE, **overrides}
            config = getattr(transformers, config_cls)(**kwargs)
            torch.manual_seed(0)
            out = tmp_path_factory.mktemp(name)
            model = getattr(transformers, model_cls)(config).eval()
            if table is SERVED and len(table[name]) > 3:  # a gain on the attention logits
                with torch.no_grad():
                    for layer in model.model.layers:
                        layer.self_attn.q_proj.weight.mul_(table[name][3])
                        layer.self_attn.k_proj.weight.mul_(table[name][3])
            model.save_pretrained(out)
            for f in tokenizer_dir.iterdir():
                if f.name.startswith(("tokenizer", "special_tokens")):
                    shutil.copy(f, out)
            built[name] = str(out)
        return built[name]

    return get


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SERVED))
def test_fp32_greedy_equals_generate(name, checkpoint, hf_reference):
    d = checkpoint(name, SERVED)
    engine = LLMEngine(load_model(d), EngineConfig(prefill_chunk_size=48, max_num_batched_tokens=128))
    batch = prompts()
    results = engine.generate(batch, [GREEDY] * len(batch))
    reference = hf_reference(d)
    for prompt, result in zip(batch, results):
        assert result.token_ids == hf_greedy(reference, prompt, GREEDY.max_new_tokens), f"{len(prompt)} tokens"
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


# the engine's fused modules each family's layers run with the CPU kernels (common/engine/cpu_linear.py,
# fused_attention.py, moe.py; copies of the reference classes recognized by module_match.py). A family losing one
# runs slower without any other test noticing: its tokens stay stock's.
ROPE, MLP, NORM, EXPERTS, ROUTER = "RopeAttention", "FusedGatedMLP", "FusedRMSNorm", "PackedExperts", "PackedRouter"
SCALED = "FusedScaledRMSNorm"  # Gemma's x / rms(x) * (1 + w)
FUSED = {
    "qwen3": {ROPE, MLP, NORM},
    "llama3_rope": {ROPE, MLP, NORM},
    "phi3": {ROPE, MLP, NORM},  # its checkpoint's own q|k|v and gate|up layers
    "granite": {ROPE, MLP, NORM},  # copies of Llama's classes
    "gemma": {ROPE, MLP, SCALED},  # a GeLU MLP
    "gemma2": {ROPE, MLP, SCALED},  # a soft cap, passed on to the attention function
    "gemma3": {ROPE, MLP, SCALED},  # Gemma-style q/k norms
    "mixtral": {ROPE, NORM, EXPERTS, ROUTER},
    "qwen2_moe": {ROPE, MLP, NORM, EXPERTS, ROUTER},  # the shared expert a gated MLP
    "qwen3_moe": {ROPE, NORM, EXPERTS, ROUTER},
    "olmo2": {ROPE, MLP, SCALED},  # GPT-OSS's norms; q/k norms over all the heads at once
    "olmo3": {ROPE, MLP, SCALED},
    "olmoe": {ROPE, NORM, EXPERTS, ROUTER},  # q/k norms over all the heads at once
    "phimoe": {ROPE, EXPERTS},  # LayerNorm; a router of its own (sparsemixer)
    "glm4_moe": {ROPE, MLP, NORM, EXPERTS, ROUTER},  # half of each head rotated; sigmoid routing; shared experts
    "gpt_oss": {ROPE, EXPERTS, ROUTER, SCALED},  # experts: a clamped gate, biases; norms x / rms(x) * w, one rounding
}


@pytest.mark.parametrize("name", list(FUSED))
def test_each_family_runs_the_fused_modules_it_fits(name, checkpoint):
    if not cpu_kernels.load():
        pytest.skip("CPU kernels unavailable")
    engine = LLMEngine(load_model(checkpoint(name, SERVED)), EngineConfig(num_kv_blocks=32))
    kinds = {type(m).__name__ for m in engine.loaded.model.modules()}
    # a build without the fp32 linear kernel (plain x86-64, aarch64) packs no fp32 experts
    want = FUSED[name] if torch.ops.pdserve.fp32_linear_supported() else FUSED[name] - {EXPERTS}
    assert kinds & {ROPE, MLP, NORM, SCALED, EXPERTS, ROUTER} == want


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_the_engine_cannot_compute_is_refused_naming_why(name, checkpoint):
    with pytest.raises(UnsupportedModelError, match=f"model_type '{name}") as refused:
        LLMEngine(load_model(checkpoint(name, REFUSED)), EngineConfig(num_kv_blocks=32))
    assert REFUSED[name][3] in str(refused.value)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_logit_extras_change_stock_output_and_the_engine_follows_them(name, checkpoint, hf_reference, monkeypatch):
    """Gemma 2's soft cap and GPT-OSS's sinks, on every attention path a model with them takes (with the kernels:
    decode, whole prompts, chunks after cached ones, each prefill kind checked once against the plain ops; without
    them one stream's keys read in place, a padded decode group, per-prompt and gathered plain ops): the engine's
    tokens are stock's, and stock's own change without the extra (so a path that dropped it would fail here)."""
    d = checkpoint(name, SERVED)
    reference = hf_reference(d)
    batch = prompts()
    want = [hf_greedy(reference, p, GREEDY.max_new_tokens) for p in batch]
    extra = "+softcap" if name == "gemma2" else "+sinks"
    both = {f"causal{extra}", f"window{extra}"}  # within and past the window of 48, with the extra
    for kernels, chunk in ((True, 48), (True, None), (False, 48)):
        monkeypatch.setattr(attention, "_VARLEN", {})
        engine = LLMEngine(load_model(d), EngineConfig(prefill_chunk_size=chunk, max_num_batched_tokens=128,
                                                       cpu_kernels=kernels))  # fmt: skip
        loaded = kernels and cpu_kernels.load()
        prefill = loaded and torch.ops.pdserve.prefill_attention_supported(torch.float32)
        assert engine.runner.decode_kernel == loaded and engine.runner.prefill_kernel == prefill
        alone = [engine.generate([p], [GREEDY])[0].token_ids for p in batch]
        assert alone == want, f"kernels {kernels}, chunks of {chunk}"
        checked = {key: kernel.verified for key, kernel in attention._VARLEN.items() if kernel is not None}
        if prefill and chunk:  # whole prompts in chunks of 48 stay within the window; the chunks after go past it
            assert checked == {attention.cpu_kernel_key(torch.float32): {f"causal{extra}"},
                               attention.cpu_kernel_key(torch.float32, paged=True): both}, checked
        elif prefill:  # whole prompts of up to 150 tokens (and the one of 150 in two steps of 128 and 22)
            assert checked == {attention.cpu_kernel_key(torch.float32): both,
                               attention.cpu_kernel_key(torch.float32, paged=True): both}, checked
        else:
            assert not checked
    plain = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    for layer in plain.model.layers:
        if name == "gemma2":
            layer.self_attn.attn_logit_softcapping = None
        else:
            layer.self_attn.sinks.data.fill_(-1e4)  # no weight left for the sink column
    assert [hf_greedy(plain, p, GREEDY.max_new_tokens) for p in batch] != want


def test_chunked_attention_is_served_within_one_chunk(checkpoint, hf_reference):
    """Llama 4's chunked attention is causal attention while no sequence outgrows a chunk: ``max_model_len`` at the
    chunk size serves it, and its output is stock's."""
    d = checkpoint("llama4", REFUSED)
    engine = LLMEngine(load_model(d), EngineConfig(max_model_len=64, prefill_chunk_size=16))
    batch = [p[:40] for p in prompts()]
    results = engine.generate(batch, [GREEDY] * len(batch))
    for prompt, result in zip(batch, results):
        assert result.token_ids == hf_greedy(hf_reference(d), prompt, GREEDY.max_new_tokens)


def test_the_probe_leaves_the_model_as_it_found_it(checkpoint):
    loaded = load_model(checkpoint("qwen3", SERVED))
    before = loaded.model.config._attn_implementation
    assert check_model(loaded.model, max_model_len=512) == AttentionShape(2, 32, frozenset())
    assert loaded.model.config._attn_implementation == before
    loaded.model.model.layers[1].self_attn.k_proj.weight.data = torch.zeros(32, 128)  # one KV head in layer 1
    with pytest.raises(UnsupportedModelError, match="layer 1: keys .heads 1, size 32. .* of 2 heads of 32"):
        check_model(loaded.model, max_model_len=512)
    assert loaded.model.config._attn_implementation == before  # restored after a refusal too


def test_pdserve_run_refuses_in_one_line_and_exit_2(checkpoint):
    proc = pdserve("run", "--model", checkpoint("lfm2", REFUSED), "--prompt", "hi", check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pdserve run: error:")]
    assert len(errors) == 1 and "model_type 'lfm2'" in errors[0] and "convolutional" in errors[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "gemma2", "gpt_bigcode", "gemma3n"])
def test_disaggregated_output_equals_stock_generate(name, checkpoint, hf_reference):
    """Prefill on an engine laid out for prefill, the KV exported, imported into another laid out for decode (other
    block ids), decoding to the end: the fused Qwen3, Gemma 2's plain attention, GPT-BigCode's single KV head, and
    Gemma 3n's layers that reuse others' K/V, each against stock ``generate``."""
    d = checkpoint(name, SERVED)
    prefill = LLMEngine(load_model(d), EngineConfig(num_kv_blocks=128, weight_layout="prefill"))
    decode = LLMEngine(load_model(d), EngineConfig(num_kv_blocks=160))
    decode.block_pool.allocate(7)
    batch = prompts()
    ids = [prefill.add_request(p, GREEDY, prefill_only=True) for p in batch]
    while prefill.has_unfinished_requests():
        prefill.step()
    results = {}
    for rid in ids:
        decode.import_kv(prefill.export_kv(rid), GREEDY)
        results[rid] = []
    while decode.has_unfinished_requests():
        for out in decode.step():
            results[out.request_id] += out.new_token_ids
    reference = hf_reference(d)
    for rid, prompt in zip(ids, batch):
        assert results[rid] == hf_greedy(reference, prompt, GREEDY.max_new_tokens), f"{len(prompt)} tokens"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "gemma2", "gpt_oss", "gpt_bigcode", "gemma3n", "gemma", "gemma3",
                                  "qwen3_moe", "mixtral", "olmo2", "olmo3", "olmoe"])  # fmt: skip
def test_bf16_decode_logits_within_bf16_rounding_of_stock(name, checkpoint, monkeypatch):
    """A decode step of two sequences in bf16: each row's logits as far from stock fp32's as stock bf16's are (2x:
    summation orders differ), on the fused modules (Qwen3), plain-op attention (Gemma 2, GPT-OSS), one KV head
    (GPT-BigCode), reused K/V (Gemma 3n), Gemma's norms and GeLU MLP in the engine's kernels (Gemma, Gemma 3) and
    packed experts (Qwen3-MoE, Mixtral), OLMo's float angles (OLMo 2, 3, OLMoE). Measured: 0.4-2.2% of the
    largest logit apart from stock bf16's. The prefill kernels, where they serve, pass their first checks (with a
    soft cap or sinks against the plain ops in float: in bf16 those round every logit first)."""
    monkeypatch.setattr(attention, "_VARLEN", {})
    d = checkpoint(name, SERVED)
    engine = LLMEngine(load_model(d, dtype="bfloat16"), EngineConfig(prefill_chunk_size=48))
    stock = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    exact = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    for p in prompts()[1:3]:
        engine.add_request(p, GREEDY)
    for _ in range(3):  # the prefill steps, then a decode step
        engine.step()
    scheduled = engine.scheduler.schedule().scheduled
    assert len(scheduled) == 2 and all(n == 1 for _, n in scheduled)
    batch = engine.runner.prepare(scheduled)
    logits = engine.runner.run(batch)
    with torch.no_grad():
        for row, request in zip(logits, batch.sampling_requests):
            ids = torch.tensor([request.all_token_ids])
            truth, rounded = exact(ids).logits[0, -1], stock(ids).logits[0, -1].float()
            assert (row - truth).abs().max().item() <= 2 * (rounded - truth).abs().max().item() + 1e-3
    assert not attention.cpu_prefill_dropped(), {k: v and v.failed for k, v in attention._VARLEN.items()}
