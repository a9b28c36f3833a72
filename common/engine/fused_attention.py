"""Llama-, Qwen2/3-, Mistral- and Gemma-style attention over the fused q/k/v product, the rotary embedding one kernel
call.

transformers' attention module projects q, k and v (here three slices of one fused product, see
:mod:`common.engine.cpu_linear`), then rotates q and k with ``apply_rotary_pos_emb``: fourteen small operators a
layer. :class:`RopeAttention` computes the fused product, rotates its query and key columns in place with
``torch.ops.pdserve.rotary_`` (transformers' roundings, so the same numbers) and hands views of it to the
registered attention function, as the module it replaces would. Qwen3's RMSNorm of each query and key head
(``q_norm``, ``k_norm``, between the projection and RoPE; Gemma 3's Gemma-style one) runs on those columns first,
written back in place. Gemma 2's soft cap goes to the attention function as its module passes it.

:func:`fuse_rope_attention` swaps it in only where the module is one of the classes whose forward it repeats,
its q/k/v are one fused product, and the kernel gives exactly what the module's own ``apply_rotary_pos_emb``
gives on a random input.
"""

from __future__ import annotations

import logging
import sys

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from common.engine.cpu_linear import _GEMMA_STYLE_NORMS, _LLAMA_STYLE_NORMS, _WEIGHTED_NORMS, LinearSlice, PackedLinear
from common.engine.module_match import same_forward

log = logging.getLogger(__name__)

# attention modules whose forward RopeAttention repeats (projections, half-split RoPE, interface, o_proj), and
# the ``sliding_window`` each passes to the attention function: none (Llama), the module's (Qwen2: per layer),
# the config's (Mistral). A class whose forward repeats one of these (module_match.py: Qwen3-MoE's, Mixtral's,
# Granite's ...) passes what it passes.
_ROPE_ATTENTIONS = {
    "LlamaAttention": lambda module: {},
    "Qwen2Attention": lambda module: {"sliding_window": module.sliding_window},
    "Qwen3Attention": lambda module: {"sliding_window": module.sliding_window},
    "MistralAttention": lambda module: {"sliding_window": getattr(module.config, "sliding_window", None)},
    # one q|k|v layer in the checkpoint
    "Phi3Attention": lambda module: {"sliding_window": getattr(module.config, "sliding_window", None)},
    # Gemma 2: no head norms, a soft cap of the logits (attention_math.py computes it); Gemma 3: Gemma-style head
    # norms (x / rms(x) * (1 + w)) after the heads are transposed (the same numbers: each head's row on its own)
    "Gemma2Attention": lambda module: {"sliding_window": module.sliding_window,
                                       "softcap": module.attn_logit_softcapping},
    "Gemma3Attention": lambda module: {"sliding_window": module.sliding_window},
    # GPT-OSS: Llama's with biases, a window on some layers and a sink logit per query head (its rotary embedding
    # gives each angle once: the kernel takes cos and sin of half a head, common/engine/csrc/rotary.cpp)
    # (the sinks in float once, as the CPU kernels take them; the plain-op path rounds them back exactly)
    "GptOssAttention": lambda module: {"sliding_window": module.sliding_window,
                                       "s_aux": module.sinks.detach().float().contiguous()},
    # OLMo 2 and 3: q and k normed over all their heads at once (OLMo 3: a window on some layers)
    "Olmo2Attention": lambda module: {},
    "Olmo3Attention": lambda module: {"sliding_window": module.sliding_window},
    # OLMoE: OLMo 2's, its q, k and v clipped where the config says (then not fused)
    "OlmoeAttention": lambda module: {"sliding_window": getattr(module.config, "sliding_window", None)},
    # GLM-4-MoE (GLM-4.5): Qwen3's per-head q/k norms where use_qk_norm, a partial rotary (the first half of each
    # head rotated: rotary_'s rotary_dim)
    "Glm4MoeAttention": lambda module: {},
}
# the references whose q/k norms take all the heads' columns at once, not each head's
_WHOLE_WIDTH_NORMS = ("Olmo2Attention", "Olmo3Attention", "OlmoeAttention")
_REFERENCES = ("llama.LlamaAttention", "qwen2.Qwen2Attention", "qwen3.Qwen3Attention", "mistral.MistralAttention",
               "phi3.Phi3Attention", "gemma2.Gemma2Attention", "gemma3.Gemma3Attention", "gpt_oss.GptOssAttention",
               "olmo2.Olmo2Attention", "olmo3.Olmo3Attention", "olmoe.OlmoeAttention", "glm4_moe.Glm4MoeAttention")


class RopeAttention(torch.nn.Module):
    """Stands where a Llama/Qwen2/Qwen3/Mistral/Phi-3/Gemma 2/Gemma 3 attention module stood; keeps it for its
    settings, its output projection and Qwen3's (Gemma 3's) per-head norms. ``qkv``: the packed layer computing
    q|k|v (a FusedLinear's, or Phi-3's own ``qkv_proj``)."""

    def __init__(self, attention: torch.nn.Module, qkv: PackedLinear, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, rotary_dim: int = 0) -> None:  # fmt: skip
        super().__init__()
        self.rotary_dim = rotary_dim  # > 0: only each head's first rotary_dim features rotate (GLM-4-MoE's)
        self.inner = attention
        self._qkv = (qkv,)  # not a submodule: the attention module it replaces registers the layer already
        self.layer_idx = attention.layer_idx
        self.heads = (num_q_heads, num_kv_heads, head_dim)
        self.splits = [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        # what the attention function gets besides the module's own settings (a constant of the layer)
        reference = same_forward(type(attention), _REFERENCES)
        self.extra = _ROPE_ATTENTIONS[reference](attention)
        self.eager = getattr(sys.modules[type(attention).__module__], "eager_attention_forward", None)
        # Qwen3: each query and key head RMS-normed before RoPE (query columns first, then key columns); OLMo 2 and
        # 3: all the query columns at once, then all the key columns
        self.head_norms = ((attention.q_norm, 0, num_q_heads), (attention.k_norm, self.splits[0], num_kv_heads)) \
            if hasattr(attention, "q_norm") else ()  # fmt: skip
        self.whole_width = reference in _WHOLE_WIDTH_NORMS

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, cache=None, **kwargs):  # fmt: skip
        inner = self.inner
        shape = hidden_states.shape[:-1]
        q, k, v = self.project(hidden_states, position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(inner.config._attn_implementation, self.eager)
        out, weights = interface(inner, q, k, v, attention_mask, dropout=0.0, scaling=inner.scaling, **self.extra,
                                 **kwargs)  # fmt: skip
        return inner.o_proj(out.reshape(*shape, -1).contiguous()), weights

    def project(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]):
        """The rotated query and key and the value, [batch, heads, tokens, head size] views of one product."""
        shape = hidden_states.shape[:-1]
        qkv = self._qkv[0](hidden_states)  # a fresh tensor: normed and rotated in place
        d = self.heads[2]
        for norm, start, heads in self.head_norms:
            cols = qkv[..., start : start + heads * d]
            cols.copy_(norm(cols) if self.whole_width else norm(cols.view(*shape, heads, d)).view(*shape, heads * d))
        cos, sin = position_embeddings
        torch.ops.pdserve.rotary_(qkv, cos, sin, *self.heads, self.rotary_dim)
        return [part.view(*shape, -1, d).transpose(1, 2) for part in qkv.split(self.splits, dim=-1)]


def fuse_rope_attention(model: torch.nn.Module) -> int:
    """Replace each fitting attention module of ``model`` (see the module doc) by a :class:`RopeAttention`;
    returns how many. Needs the engine's CPU kernels (the caller checked that they loaded) and q/k/v fused by
    :func:`common.engine.cpu_linear.pack_linear_layers`."""
    done = 0
    checked: dict[str, bool] = {}
    for parent in list(model.modules()):
        if isinstance(parent, RopeAttention):  # a model fused before (engines may share one): its module stays
            continue
        for name, child in list(parent.named_children()):
            fitting = _fitting(child)
            if fitting is None:
                continue
            product, heads = fitting
            dtype = product.dtype
            angles, width = _angles(model, dtype)
            key = f"{type(child).__module__}:{dtype}:{angles}:{width}:{heads}"
            if key not in checked:
                checked[key] = _rotation(sys.modules[type(child).__module__], dtype, *heads, angles=angles,
                                         width=width)  # fmt: skip
                if checked[key] is None:
                    log.warning("keeping %s: the rotary kernel differs from its apply_rotary_pos_emb",
                                type(child).__name__)
            if checked[key] is not None:
                setattr(parent, name, RopeAttention(child, product, *heads, rotary_dim=checked[key]))
                done += 1
    return done


def _fitting(module: torch.nn.Module) -> tuple[PackedLinear, tuple[int, int, int]] | None:
    """(the packed q|k|v layer, (query heads, KV heads, head size)) if ``module`` can become a RopeAttention."""
    reference = same_forward(type(module), _REFERENCES)
    if reference is None:
        return None
    config = module.config
    head_dim = module.head_dim
    if reference == "OlmoeAttention" and getattr(config, "clip_qkv", None) is not None:
        return None
    if reference == "Phi3Attention":
        product, q_heads = module.qkv_proj, config.num_attention_heads
        kv_heads = getattr(module, "num_key_value_heads", None)
        if type(product) is not PackedLinear or not isinstance(kv_heads, int) or head_dim % 2 \
                or product.out_features != (q_heads + 2 * kv_heads) * head_dim \
                or getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):  # fmt: skip
            return None
        return product, (q_heads, kv_heads, head_dim)
    parts = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    if not all(isinstance(p, LinearSlice) for p in parts):
        return None
    fused = parts[0]._fused[0]
    if any(p._fused[0] is not fused for p in parts) or [p.index for p in parts] != [0, 1, 2] \
            or len(fused.bounds) != 3:  # fmt: skip
        return None
    norms = [getattr(module, n, None) for n in ("q_norm", "k_norm")]
    widths = [p.out_features for p in parts[:2]] if reference in _WHOLE_WIDTH_NORMS else [head_dim, head_dim]
    if norms != [None, None] and not all(_head_norm(n, w) for n, w in zip(norms, widths)):
        return None
    if head_dim % 2 or getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        return None
    q, k = parts[0].out_features, parts[1].out_features
    if q % head_dim or k % head_dim or parts[2].out_features != k:
        return None
    return fused.linear, (q // head_dim, k // head_dim, head_dim)


_HEAD_NORMS = (*_LLAMA_STYLE_NORMS, *_GEMMA_STYLE_NORMS, *_WEIGHTED_NORMS)


def _head_norm(norm: torch.nn.Module | None, width: int) -> bool:
    """Whether ``norm`` is an RMSNorm over ``width`` features (one head's, or all the heads' of OLMo 2 and 3):
    Llama-style (the engine's FusedRMSNorm, or the class it replaces), Gemma-style or of one rounding
    (FusedScaledRMSNorm, or the classes it replaces)."""
    if type(norm).__name__ == "FusedScaledRMSNorm":
        weight = norm.scale
    elif type(norm).__name__ == "FusedRMSNorm" or same_forward(type(norm), _HEAD_NORMS) is not None:
        weight = getattr(norm, "weight", None)
    else:
        return False
    return isinstance(weight, torch.Tensor) and weight.shape == (width,)


def _angles(model: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.dtype, int | None]:
    """The dtype and width of the cos and sin ``model``'s rotary embedding hands its layers for hidden states of
    ``dtype``: that dtype (most families), or float32 (OLMo 2's and 3's, whose rotation computes in float); a head's
    width (Llama's), half of it (GPT-OSS's angles once, GLM-4-MoE's partial rotary), or None where not found."""
    rotary = next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    if rotary is None:
        return dtype, None
    try:
        with torch.inference_mode():
            cos = rotary(torch.zeros(1, 1, 1, dtype=dtype), torch.zeros(1, 1, dtype=torch.long))[0]
    except (TypeError, RuntimeError, ValueError):  # another signature: the model's dtype, which the check then tests
        return dtype, None
    return cos.dtype, int(cos.shape[-1])


def _kernel_matches(modeling, dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int,
                    angles: torch.dtype | None = None) -> bool:  # fmt: skip
    """Whether the kernel rotates as ``modeling.apply_rotary_pos_emb`` does in some form (:func:`_rotation`)."""
    return _rotation(modeling, dtype, num_q_heads, num_kv_heads, head_dim, angles) is not None


def _rotation(modeling, dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int,
              angles: torch.dtype | None = None, width: int | None = None) -> int | None:  # fmt: skip
    """The ``rotary_dim`` with which the kernel rotates a random q/k exactly as ``modeling.apply_rotary_pos_emb``
    does (v untouched), or None where no form does. The forms, for the cos and sin ``width`` the model's rotary
    embedding gives (None: unknown, every form tried): each angle twice over a whole head (Llama's; 0), each once
    over a whole head (GPT-OSS's, half a head wide; 0), each twice over the head's first ``width`` features
    (GLM-4-MoE's partial rotary; ``width``). The model's own function fails on a width it does not take. Angles in
    ``angles`` (default: ``dtype``)."""
    apply = getattr(modeling, "apply_rotary_pos_emb", None)
    if apply is None:
        return None
    g = torch.Generator().manual_seed(0)
    tokens, splits = 5, [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = torch.randn(1, tokens, sum(splits), generator=g).to(dtype)
    half = torch.randn(1, tokens, head_dim // 2, generator=g) * 10

    def heads(t: torch.Tensor) -> list[torch.Tensor]:
        return [p.view(1, tokens, -1, head_dim).transpose(1, 2) for p in t.split(splits, dim=-1)]

    q, k, v = heads(qkv)
    forms = [(torch.cat((half, half), dim=-1), 0), (half, 0)]
    if width is not None and 0 < width < head_dim and width % 2 == 0:
        forms.append((torch.cat((half[..., : width // 2], half[..., : width // 2]), dim=-1), width))
    for turns, rotary_dim in forms:
        if width is not None and turns.shape[-1] != width:
            continue
        cos, sin = turns.cos().to(angles or dtype), turns.sin().to(angles or dtype)
        with torch.inference_mode():
            try:
                want_q, want_k = apply(q, k, cos, sin)
            except RuntimeError:  # not this width
                continue
            got = qkv.clone()
            torch.ops.pdserve.rotary_(got, cos, sin, num_q_heads, num_kv_heads, head_dim, rotary_dim)
        got_q, got_k, got_v = heads(got)
        if torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(got_v, v):
            return rotary_dim
    return None
