"""Whether the engine computes a model as stock ``transformers`` does: a probe of its attention, run once per engine.

The engine runs any ``transformers`` causal LM through its registered attention function
(:mod:`common.engine.attention`), keeping each layer's keys and values in its paged cache and nothing else
between steps. That is the model's own computation only when

1. every decoder layer attends through ``transformers``' attention interface, once a forward (a recurrent,
   convolutional or linear-attention layer carries state from token to token that the cache does not hold:
   Jamba, Bamba, LFM2, Qwen3-Next);
2. the function receives the engine's metadata (StableLM's attention drops extra keyword arguments);
3. its keys and values fit one paged cache: one head size for keys and values (multi-head latent attention,
   DeepSeek-V2/V3, has keys of one size and values of another), the same KV heads in every layer. The cache is
   sized by what the probe sees, not by config names a family may not use (GPT-BigCode's single KV head is
   ``multi_query``, not ``num_key_value_heads``);
4. it asks for no attention the engine does not compute: bidirectional attention, a mask other than causal,
   chunked attention over prompts longer than a chunk (Llama 4), or options it does not know. A soft cap on the
   logits (Gemma 2's ``softcap``) and sink logits (GPT-OSS's ``s_aux``) it computes in its CPU attention kernels,
   elsewhere in plain tensor ops (:mod:`common.engine.attention_math`).

:func:`check_model` runs the model's forward once on a few tokens with a probe registered as its attention
function (no cache touched; the probe returns zeros), raises :class:`UnsupportedModelError` naming the first
condition that fails, and otherwise returns an :class:`AttentionShape`: the KV heads and head size each layer
caches, and the logit extras the model asks for (on AMX CPUs the engine's bf16 prefill kernel then takes such a
model's prompts by default, as SDPA computes no extras). An error
beats serving output that silently differs from the model's: the engine's oracle (greedy output equal to stock
``generate``) holds for what passes; tests/common/engine/test_architectures.py runs it on tiny checkpoints of
twenty-three more families and checks the refusals.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from common.engine.attention import METADATA_KWARG
from common.engine.loader import ModelLoadError

PROBE_NAME = "pdserve_probe"
PROBE_TOKENS = 4
_PROBING = threading.Lock()  # one probe at a time: they share PROBE_NAME in transformers' registry

# keyword arguments models pass to the attention function that do not change what it computes (values of None
# and False are ignored too: an unused option)
_HARMLESS = frozenset({METADATA_KWARG, "position_ids", "use_cache", "output_attentions", "output_router_logits",
                       "cache_position", "position_embeddings", "is_causal"})  # fmt: skip
# the ones the CPU attention kernels and common/engine/attention_math.py (LogitExtras) compute
_EXTRAS = frozenset({"softcap", "s_aux"})


class UnsupportedModelError(ModelLoadError):
    """The engine would not compute this model as ``transformers`` does; the message says why."""


@dataclass(frozen=True)
class AttentionShape:
    """What every layer of a model hands its attention function, as the probe saw it."""

    num_kv_heads: int  # per layer (this rank's share under tensor parallelism)
    head_dim: int  # of keys and values alike
    extras: frozenset[str]  # logit extras asked for: "softcap", "s_aux" (common/engine/attention_math.py)


@dataclass
class _Call:
    layer: int | None
    query: tuple[int, ...]  # [B, Hq, T, D]
    key: tuple[int, ...]  # [B, Hkv, T, Dk]
    value: tuple[int, ...]  # [B, Hkv, T, Dv]
    mask: torch.Tensor | None
    extra: dict[str, object] = field(default_factory=dict)  # keyword arguments past the named ones


def check_model(model: torch.nn.Module, max_model_len: int) -> AttentionShape:
    """Raise :class:`UnsupportedModelError` unless the engine computes ``model`` as ``transformers`` does (see the
    module doc); return what its layers attend with. ``max_model_len``: the engine's longest sequence."""
    config = model.config.get_text_config()
    name = getattr(config, "model_type", type(model).__name__)
    _check_chunked(config, name, max_model_len)
    calls = _probe(model)
    num_layers = int(config.num_hidden_layers)
    layers = [c.layer for c in calls]
    if None in layers or sorted(layers) != list(range(num_layers)):
        attended = sorted({x for x in layers if x is not None})
        types = getattr(config, "layer_types", None)
        raise UnsupportedModelError(
            f"model_type {name!r}: {len(calls)} attention calls over layers {attended} in a forward of its "
            f"{num_layers} layers{f' (layer_types {types})' if types else ''}; the engine keeps only attention "
            "keys and values between steps, so a layer without them (recurrent, convolutional, linear attention) "
            "or attending twice cannot be served"
        )
    first = calls[0]
    shape = AttentionShape(first.key[1], first.key[-1], frozenset(
        key for call in calls for key, value in call.extra.items() if key in _EXTRAS and value is not None))
    for call in calls:
        _check_call(call, name, shape.num_kv_heads, shape.head_dim)
    return shape


def _probe(model: torch.nn.Module) -> list[_Call]:
    """The attention calls of one forward of ``model`` over PROBE_TOKENS tokens, in order."""
    calls: list[_Call] = []

    def probe(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs):
        calls.append(_Call(getattr(module, "layer_idx", None), tuple(query.shape), tuple(key.shape),
                           tuple(value.shape), attention_mask, kwargs))  # fmt: skip
        b, h, t, _ = query.shape
        return query.new_zeros(b, t, h, value.shape[-1]), None

    before = model.config._attn_implementation
    device = next(model.parameters()).device
    ids = torch.arange(1, PROBE_TOKENS + 1, device=device)[None]
    with _PROBING:
        AttentionInterface.register(PROBE_NAME, probe)
        model.set_attn_implementation(PROBE_NAME)
        _forward(model, ids, before)
    return calls


def _forward(model: torch.nn.Module, ids: torch.Tensor, restore: str) -> None:
    """One forward of ``model`` over ``ids`` with the probe as its attention; ``restore`` its attention after."""
    try:
        with torch.inference_mode():
            model(input_ids=ids, position_ids=ids - 1, use_cache=False, logits_to_keep=1,
                  **{METADATA_KWARG: PROBE_NAME})  # fmt: skip
    except Exception as exc:  # noqa: BLE001  (it would fail the same way at the engine's first step)
        name = getattr(model.config.get_text_config(), "model_type", type(model).__name__)
        raise UnsupportedModelError(f"model_type {name!r}: its forward fails with an attention function of its "
                                    f"own registered ({type(exc).__name__}: {exc})") from exc
    finally:
        model.set_attn_implementation(restore)


def _check_call(call: _Call, name: str, num_kv_heads: int, head_dim: int) -> None:
    where = f"model_type {name!r}, layer {call.layer}"
    if METADATA_KWARG not in call.extra:
        raise UnsupportedModelError(f"{where}: its attention module does not pass keyword arguments on to the "
                                    "attention function, and the engine's paged attention needs its metadata")
    for key, value in call.extra.items():
        if key == "is_causal" and value is False:
            what = " (bidirectional attention)"
        elif value is None or value is False or key in _HARMLESS or key in _EXTRAS:
            continue
        else:
            what = ""
        raise UnsupportedModelError(f"{where}: the model asks its attention for {key}={_short(value)}{what}, "
                                    "which the engine's attention does not compute")
    _, kv_heads, _, k_dim = call.key
    v_dim = call.value[-1]
    if kv_heads != num_kv_heads or k_dim != head_dim or v_dim != head_dim or call.value[1] != kv_heads:
        raise UnsupportedModelError(
            f"{where}: keys [heads {kv_heads}, size {k_dim}] and values [heads {call.value[1]}, size {v_dim}] do "
            f"not fit one paged KV cache of {num_kv_heads} heads of {head_dim} (the first layer's keys); "
            "multi-head latent attention (keys and values of different sizes) and layers of different KV shapes "
            "are not supported"
        )
    if call.mask is not None and not _causal(call.mask):
        raise UnsupportedModelError(f"{where}: the model masks its attention other than causally (a mask of shape "
                                    f"{list(call.mask.shape)}); the engine's attention is causal")


def _check_chunked(config, name: str, max_model_len: int) -> None:
    """Chunked attention (each token sees only the keys of its own chunk) equals causal attention while no
    sequence is longer than a chunk."""
    chunk = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None) or []
    if chunk and "chunked_attention" in types and max_model_len > chunk:
        raise UnsupportedModelError(
            f"model_type {name!r}: its layers of chunked attention see keys only within chunks of {chunk} tokens, "
            f"which the engine does not compute; max_model_len {max_model_len} is longer (--max-model-len {chunk} "
            "or less serves it: attention within one chunk is causal attention)"
        )


def _causal(mask: torch.Tensor) -> bool:
    """Whether ``mask`` (bool: True visible; float: 0 visible) over PROBE_TOKENS queries and keys is causal."""
    visible = mask if mask.dtype == torch.bool else mask == 0
    causal = torch.ones(PROBE_TOKENS, PROBE_TOKENS, dtype=torch.bool, device=mask.device).tril()
    return visible.shape[-2:] == causal.shape and bool((visible == causal).all())


def _short(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return repr(value)
