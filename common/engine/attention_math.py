"""Attention in plain tensor ops, for what ``scaled_dot_product_attention`` cannot compute.

Two model families ask their attention function for more than SDPA takes (common/engine/model_support.py finds
them): Gemma 2 caps its logits softly (``softcap``: ``cap * tanh(logits / cap)`` before the mask), GPT-OSS adds a
learned sink logit per query head to each softmax (``s_aux``: a column that takes probability and gives no value).
:func:`attend` computes attention as ``transformers``' own eager functions for those models do, op for op
(``gemma2.eager_attention_forward``, ``gpt_oss.eager_attention_forward``), on the shapes the paged attention
function hands SDPA; SDPA itself runs whenever neither is asked for. The engine's CPU attention kernels compute
both (decode: ``paged_decode_attention``; prefill: ``prefill_attention``, ``paged_prefill_attention``, whose first
call of each kind is checked against :func:`attend`); other devices' varlen kernels compute neither, so there such
a model's attention takes these paths.

Query layouts (``q`` [B, H, Q, D], ``k``/``v`` [B, Hk, K, D]):

- *grouped* (``H`` query heads over ``Hk`` KV heads, query head ``h`` reading KV head ``h // (H / Hk)``), as SDPA
  with ``enable_gqa``;
- *folded* (``H == Hk``, the ``g`` query heads of each KV head folded into the query axis: row ``i * g + j`` is
  query ``i`` of head ``kv * g + j``), as the engine's decode and padded groups call SDPA. ``folded`` is ``g``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LogitExtras:
    """What a layer's attention adds to its logits: a soft cap, sink logits [Hq] (either may be None)."""

    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @classmethod
    def of(cls, kwargs: dict) -> LogitExtras | None:
        """The extras among an attention function's keyword arguments, or None when there are none."""
        softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
        return None if softcap is None and sinks is None else cls(softcap, sinks)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: LogitExtras | None, folded: int = 1,
         **kwargs) -> torch.Tensor:  # fmt: skip
    """``F.scaled_dot_product_attention(q, k, v, **kwargs)`` (``attn_mask``, ``is_causal``, ``scale``,
    ``enable_gqa``), or :func:`attend` with ``extras`` where there are any."""
    if extras is None:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return attend(q, k, v, extras, scale=kwargs.get("scale"), mask=kwargs.get("attn_mask"),
                  is_causal=kwargs.get("is_causal", False), folded=folded)  # fmt: skip


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: LogitExtras, *, scale: float | None,
           mask: torch.Tensor | None = None, is_causal: bool = False, folded: int = 1) -> torch.Tensor:  # fmt: skip
    """Attention output [B, H, Q, D] with ``extras`` (see the module doc for the layouts); ``mask`` bool, True
    where a key is visible, broadcast over [B, H, Q, K]; ``is_causal``: query ``i`` sees keys ``0..i`` (Q == K)."""
    if q.shape[1] != k.shape[1]:  # repeat_kv, as the eager functions do
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = torch.matmul(q, k.transpose(2, 3)) * scale
    if extras.softcap is not None:
        logits = torch.tanh(logits / extras.softcap) * extras.softcap
    if is_causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    if extras.sinks is None:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        sinks = _sink_column(extras.sinks, q.shape, folded).to(logits.dtype).expand(*logits.shape[:-1], 1)
        combined = torch.cat([logits, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs, v)


def _sink_column(sinks: torch.Tensor, q_shape: torch.Size, folded: int) -> torch.Tensor:
    """Each query row's sink logit, [1, H, Q or 1, 1]: per head, or per (KV head, row) when ``folded``."""
    if folded == 1:
        return sinks.reshape(1, -1, 1, 1)
    heads, rows = q_shape[1], q_shape[2]
    return sinks.reshape(heads, folded).repeat(1, rows // folded).reshape(1, heads, rows, 1)
