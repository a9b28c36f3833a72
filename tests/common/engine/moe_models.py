"""Small random MoE checkpoints of transformers' own classes for the engine's tests (the tiny Llama's tokenizer beside
them): Qwen3-MoE with a dense layer between two MoE layers, Mixtral, Qwen2-MoE with its shared expert, OLMoE,
GPT-OSS, GLM-4-MoE."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers

_COMMON = dict(vocab_size=4096, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
MOE_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                       mlp_only_layers=[1], intermediate_size=256)),  # fmt: skip
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                             intermediate_size=96)),  # fmt: skip
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=128)),  # fmt: skip
    # q/k norms over all the heads at once
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=64)),
    # transposed experts with biases and a clamped gate, sink logits, a window on the first and last layers
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=32, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=24,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"])),  # fmt: skip
    # GLM-4.5's layout: a dense first layer, routed experts beside a shared one, sigmoid routing with a correction
    # bias, half of each head rotated
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(head_dim=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      intermediate_size=256, first_k_dense_replace=1, n_group=1, topk_group=1)),  # fmt: skip
}


def build_moe(family: str, out: Path, tokenizer_dir: str) -> str:
    """The family's checkpoint written to ``out``; returns its path."""
    config_cls, model_cls, overrides = MOE_FAMILIES[family]
    return build_checkpoint(config_cls, model_cls, {**_COMMON, **overrides}, out, tokenizer_dir)


def build_checkpoint(config_cls: str, model_cls: str, settings: dict, out: Path, tokenizer_dir: str) -> str:
    """A random checkpoint of transformers' ``model_cls`` over ``config_cls(**settings)`` (seed 0), with the
    tokenizer files of ``tokenizer_dir``, written to ``out``; returns its path."""
    torch.manual_seed(0)
    getattr(transformers, model_cls)(getattr(transformers, config_cls)(**settings)).save_pretrained(out)
    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out)
    return str(out)
