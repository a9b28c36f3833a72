"""A Llama, Qwen2, Qwen3, Mistral, Phi-3 or Granite model (or a Qwen2/3-MoE, Mixtral, OLMoE, Gemma, Gemma 2, Gemma 3,
GPT-OSS, OLMo 2 or OLMo 3 one) run by the engine as one loop over its layers, without the module tree.

Once :mod:`common.engine.cpu_linear` and :mod:`common.engine.fused_attention` have swapped in the engine's
fused modules, a decoder layer is six operator calls (the q/k/v product, the rotary kernel, the paged attention,
the output projection, the gated MLP, and twice a residual addition with the RMSNorm after it as one kernel
call). transformers' module tree around them (``nn.Module.__call__`` per module, decorators, keyword handling,
mask construction, output dataclasses) cost ~1 ms of Python a step on this machine's 60M model (8 layers):
12-15% of a single stream's decode step, 4-5% of sixteen streams'. :class:`FlatForward` computes every value as
the module tree does, in the same roundings (the fused addition and norm give bit for bit an addition and the
norm's own kernel; after the last layer, only the kept rows are added), so its logits are bit for bit the
model's own; the model runner checks that once on the first step that samples
(:meth:`common.engine.model_runner.ModelRunner.run`) and keeps the model's forward if not.

:meth:`FlatForward.of` accepts only the module layout it repeats: a ``LlamaForCausalLM`` (Qwen2, Qwen3, Mistral,
Phi-3 with its residual dropouts idle, Granite with its embedding, residual and logit multipliers, and the MoE
families above) whose every decoder layer holds :class:`~common.engine.cpu_linear.FusedRMSNorm` norms,
a :class:`~common.engine.fused_attention.RopeAttention` and a :class:`~common.engine.cpu_linear.FusedGatedMLP` (or
a MoE block over :class:`~common.engine.moe.PackedExperts`),
the engine's paged attention registered, no hooks, and no process group (tensor parallelism runs the model's
own forward). The Gemma families, GPT-OSS and OLMo (:data:`_OWN_LOOP_LAYOUTS`) take a loop of their own: the
embedding module's scaling, :class:`~common.engine.cpu_linear.FusedScaledRMSNorm` norms (Gemma 2 and 3: also
around the MLP and after the attention, each sublayer's output normed before its residual addition), Gemma 3's
rotation by layer type, Gemma 2's soft caps (the attention's through the paged attention, the final logits' as
its causal-LM forward computes them), GPT-OSS's layer (Llama's over norms of one rounding, its MLP's router scores
dropped as its layer drops them), OLMo 2's and 3's (a norm after the attention and after the MLP, none before;
OLMo 3 rotates by layer type). On a 2-core Zen 4 VM (fp32, the 60M shape, 4 alternations in one process): one
stream 1.20x the module tree's speed (Gemma), 1.12x (Gemma 2), 1.17x (Gemma 3); 16 streams 1.16x, 0.97x, 1.14x.
"""

from __future__ import annotations

import torch

from common.engine.attention import ATTENTION_NAME, METADATA_KWARG, AttentionMetadata, paged_attention
from common.engine.cpu_linear import FusedGatedMLP, FusedRMSNorm, FusedScaledRMSNorm
from common.engine.fused_attention import RopeAttention
from common.engine.moe import PackedExperts, PackedRouter

# the causal-LM classes whose forward FlatForward repeats, with their inner model and decoder layer classes
_LAYOUTS = {
    "LlamaForCausalLM": ("LlamaModel", "LlamaDecoderLayer"),
    "Qwen2ForCausalLM": ("Qwen2Model", "Qwen2DecoderLayer"),
    "Qwen3ForCausalLM": ("Qwen3Model", "Qwen3DecoderLayer"),
    "MistralForCausalLM": ("MistralModel", "MistralDecoderLayer"),
    # Phi-3: Llama's layer with a dropout on each sublayer's output (idle in eval); its q|k|v and gate|up layers
    # are one layer each in the checkpoint
    "Phi3ForCausalLM": ("Phi3Model", "Phi3DecoderLayer"),
    # Granite: Llama's layer, each sublayer's output times residual_multiplier before its residual addition, the
    # embeddings times embedding_multiplier, the logits divided by logits_scaling
    "GraniteForCausalLM": ("GraniteModel", "GraniteDecoderLayer"),
    # MoE: the same layer, its MLP a sparse block over the engine's packed experts (common/engine/moe.py) where it
    # is not a dense one
    "Qwen3MoeForCausalLM": ("Qwen3MoeModel", "Qwen3MoeDecoderLayer"),
    "Qwen2MoeForCausalLM": ("Qwen2MoeModel", "Qwen2MoeDecoderLayer"),
    "MixtralForCausalLM": ("MixtralModel", "MixtralDecoderLayer"),
    "OlmoeForCausalLM": ("OlmoeModel", "OlmoeDecoderLayer"),
    # GLM-4-MoE: a dense gated MLP in its first layers, then a block of routed experts and shared ones
    "Glm4MoeForCausalLM": ("Glm4MoeModel", "Glm4MoeDecoderLayer"),
}
# the MoE blocks of those families: routing, the experts and (Qwen2-MoE) the shared expert, one tensor out
_MOE_BLOCKS = frozenset({"Qwen3MoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "MixtralSparseMoeBlock",
                         "OlmoeSparseMoeBlock", "Glm4MoeMoE"})
# Gemma's: scaled embeddings, Gemma-style norms (FusedScaledRMSNorm), a GeLU gated MLP; Gemma 2 and 3 also norm
# each sublayer's output before its residual addition ("sandwich" norms) and may cap the logits softly; Gemma 3
# rotates by its layer type's rotary embedding. GPT-OSS takes the same loop: Llama's layer over norms of one rounding
# (FusedScaledRMSNorm), its MLP a router over packed experts returning (output, router scores)
_OWN_LOOP_LAYOUTS = {
    "GemmaForCausalLM": ("GemmaModel", "GemmaDecoderLayer", "GemmaTextScaledWordEmbedding"),
    "Gemma2ForCausalLM": ("Gemma2Model", "Gemma2DecoderLayer", "Gemma2TextScaledWordEmbedding"),
    "Gemma3ForCausalLM": ("Gemma3TextModel", "Gemma3DecoderLayer", "Gemma3TextScaledWordEmbedding"),
    "GptOssForCausalLM": ("GptOssModel", "GptOssDecoderLayer", "Embedding"),
    # OLMo 2 and 3: no norm before the attention or the MLP, one after each (OLMo 3 rotates by layer type)
    "Olmo2ForCausalLM": ("Olmo2Model", "Olmo2DecoderLayer", "Embedding"),
    "Olmo3ForCausalLM": ("Olmo3Model", "Olmo3DecoderLayer", "Embedding"),
}
_POST_NORM_LAYOUTS = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")
_ROTATION_BY_TYPE = ("Gemma3ForCausalLM", "Olmo3ForCausalLM")
_SANDWICH_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


class FlatForward:
    """Calls the model's fused modules' ``forward`` directly, layer by layer (see the module doc)."""

    def __init__(self, model: torch.nn.Module) -> None:
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        layers = inner.layers[: inner.config.num_hidden_layers]
        # (OLMo 2 and 3: no norm before the attention)
        self.layers = [(getattr(layer, "input_layernorm", None), layer.self_attn, layer.post_attention_layernorm,
                        layer.mlp) for layer in layers]  # fmt: skip
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self.verified = False  # set by the model runner once the logits equalled the model's own
        self.own_loop = type(model).__name__ in _OWN_LOOP_LAYOUTS  # Gemma's families, GPT-OSS, OLMo: _own_loop
        # Gemma 2/3: each layer's norms before and after its MLP (OLMo 2 and 3: only after)
        self.sandwich = [tuple(getattr(layer, n, None) for n in _SANDWICH_NORMS) for layer in layers] \
            if self.own_loop and hasattr(layers[0], _SANDWICH_NORMS[1]) else None  # fmt: skip
        # Gemma 3, OLMo 3: each layer's rotary embedding by its type
        self.layer_types = list(inner.config.layer_types) if type(model).__name__ in _ROTATION_BY_TYPE else None
        self.softcap = getattr(model.config, "final_logit_softcapping", None) if self.own_loop else None
        self.mlp_tuple = type(model).__name__ == "GptOssForCausalLM"  # GptOssMLP: (output, router scores)
        granite = type(model).__name__ == "GraniteForCausalLM"
        self.embedding_multiplier = inner.embedding_multiplier if granite else None
        self.residual_multipliers = [layer.residual_multiplier for layer in layers] if granite else None
        self.logits_scaling = model.config.logits_scaling if granite else None

    @classmethod
    def of(cls, model: torch.nn.Module) -> FlatForward | None:
        """A FlatForward over ``model``, or None when its layout is not the one this repeats."""
        own_loop = type(model).__name__ in _OWN_LOOP_LAYOUTS
        names = (_OWN_LOOP_LAYOUTS if own_loop else _LAYOUTS).get(type(model).__name__)
        inner = getattr(model, "model", None)
        if names is None or type(inner).__name__ != names[0]:
            return None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return None
        if getattr(inner.config, "_attn_implementation", None) != ATTENTION_NAME:
            return None
        norm = FusedScaledRMSNorm if own_loop else FusedRMSNorm
        embedding = names[2] if own_loop else "Embedding"
        if type(inner.embed_tokens).__name__ != embedding or type(inner.norm) is not norm:
            return None
        if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
            return None
        if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
            return None
        for layer in inner.layers[: inner.config.num_hidden_layers]:
            if type(layer).__name__ != names[1]:
                return None
            norms = [getattr(layer, "input_layernorm", None), layer.post_attention_layernorm]
            if type(model).__name__ in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
                norms += [getattr(layer, n, None) for n in _SANDWICH_NORMS]
            elif type(model).__name__ in _POST_NORM_LAYOUTS:
                norms = [layer.post_attention_layernorm, getattr(layer, _SANDWICH_NORMS[1], None)]
            if not (all(type(n) is norm for n in norms) and type(layer.self_attn) is RopeAttention
                    and (_own_loop_mlp(layer.mlp) if own_loop else _fused_mlp(layer.mlp))):  # fmt: skip
                return None
            dropouts = [getattr(layer, n, None) for n in ("resid_attn_dropout", "resid_mlp_dropout")]  # Phi-3's
            if any(d is not None and (type(d) is not torch.nn.Dropout or d.training and d.p > 0) for d in dropouts):
                return None
        return cls(model)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn: AttentionMetadata,
                 logits_index: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Logits [1, S, V] (the model's dtype) of the packed tokens at ``logits_index`` [S] (S > 0)."""
        if self.own_loop:
            return self._own_loop(input_ids, position_ids, attn, logits_index)
        x = self.embed.forward(input_ids)  # a fresh tensor: the layers add into it in place (add_forward)
        if self.embedding_multiplier is not None:  # Granite (a fresh tensor too)
            x = x * self.embedding_multiplier
        position_embeddings = self.rotary.forward(x, position_ids)
        meta = {METADATA_KWARG: attn}
        shape = x.shape[:-1]
        layers, scales = self.layers, self.residual_multipliers
        h = layers[0][0].forward(x)
        for i, (_, attention, post_norm, mlp) in enumerate(layers):
            q, k, v = attention.project(h, position_embeddings)
            inner = attention.inner
            out, _ = paged_attention(inner, q, k, v, None, dropout=0.0, scaling=inner.scaling, **attention.extra,
                                     **meta)  # fmt: skip
            out = inner.o_proj.forward(out.reshape(*shape, -1).contiguous())
            if scales is not None:  # Granite: the sublayer's output scaled, rounded, then added
                out = out * scales[i]
            # each residual addition and the norm after it as one call (FusedRMSNorm.add_forward)
            x, h = post_norm.add_forward(x, out)
            m = mlp.forward(h)
            if scales is not None:
                m = m * scales[i]
            if i + 1 < len(layers):
                x, h = layers[i + 1][0].add_forward(x, m)
        # after the last layer only the kept rows are needed: added and normed alone (norms work per row)
        logits = self.lm_head.forward(self.norm.forward(x[:, logits_index, :] + m[:, logits_index, :]))
        return logits if self.logits_scaling is None else logits / self.logits_scaling  # Granite's

    def _own_loop(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn: AttentionMetadata,
               logits_index: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The loop of the Gemma families, GPT-OSS and OLMo 2/3 (:data:`_OWN_LOOP_LAYOUTS`): the additions as their
        decoder layers write them."""
        x = self.embed.forward(input_ids)  # scaled by the embedding module itself
        if self.layer_types is None:
            shared = self.rotary.forward(x, position_ids)
            rotations = [shared] * len(self.layers)
        else:
            by_type = {t: self.rotary.forward(x, position_ids, t) for t in set(self.layer_types)}
            rotations = [by_type[t] for t in self.layer_types]
        meta = {METADATA_KWARG: attn}
        shape = x.shape[:-1]
        for i, (in_norm, attention, post_norm, mlp) in enumerate(self.layers):
            q, k, v = attention.project(x if in_norm is None else in_norm.forward(x), rotations[i])
            inner = attention.inner
            out, _ = paged_attention(inner, q, k, v, None, dropout=0.0, scaling=inner.scaling, **attention.extra,
                                     **meta)  # fmt: skip
            out = inner.o_proj.forward(out.reshape(*shape, -1).contiguous())
            if self.sandwich is None:  # Gemma, GPT-OSS: Llama's layer
                x = x + out
                m = mlp.forward(post_norm.forward(x))
                x = x + (m[0] if self.mlp_tuple else m)
            else:
                pre_mlp, post_mlp = self.sandwich[i]
                x = x + post_norm.forward(out)
                x = x + post_mlp.forward(mlp.forward(x if pre_mlp is None else pre_mlp.forward(x)))
        logits = self.lm_head.forward(self.norm.forward(x[:, logits_index, :]))  # norms work per row
        if self.softcap is not None:  # as Gemma 2's and 3's causal-LM forward
            logits = logits / self.softcap
            logits = torch.tanh(logits)
            logits = logits * self.softcap
        return logits


def _own_loop_mlp(mlp: torch.nn.Module) -> bool:
    """A FusedGatedMLP, or GPT-OSS's MLP over its packed router and experts."""
    if type(mlp) is FusedGatedMLP:
        return True
    return type(mlp).__name__ == "GptOssMLP" and type(getattr(mlp, "experts", None)) is PackedExperts \
        and type(getattr(mlp, "router", None)) is PackedRouter  # fmt: skip


def _fused_mlp(mlp: torch.nn.Module) -> bool:
    """A FusedGatedMLP, or a MoE block of :data:`_MOE_BLOCKS` whose experts run packed (and whose shared expert,
    if any, is a FusedGatedMLP)."""
    if type(mlp) is FusedGatedMLP:
        return True
    shared = getattr(mlp, "shared_expert", None) or getattr(mlp, "shared_experts", None)  # GLM-4-MoE's: plural
    return (type(mlp).__name__ in _MOE_BLOCKS and type(getattr(mlp, "experts", None)) is PackedExperts
            and (shared is None or type(shared) is FusedGatedMLP))  # fmt: skip
