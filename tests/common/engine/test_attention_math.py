"""common/engine/attention_math.py against transformers' own eager attention of the models that need it."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.gpt_oss import modeling_gpt_oss

from common.engine.attention_math import LogitExtras, attend, sdpa

HQ, HKV, D = 6, 2, 16  # groups of 3


class _Module(torch.nn.Module):
    """What the eager functions read off the attention module."""

    def __init__(self, sinks: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_key_value_groups = HQ // HKV
        self.training = False
        if sinks is not None:
            self.sinks = torch.nn.Parameter(sinks)


def _inputs(queries: int, keys: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HQ, queries, D, generator=g) * 3  # logits of several units: the cap and sinks matter
    k = torch.randn(1, HKV, keys, D, generator=g) * 3
    v = torch.randn(1, HKV, keys, D, generator=g)
    return q, k, v


def _causal(queries: int, keys: int) -> torch.Tensor:
    """[Q, K] bool: the last Q positions of K keys, causal."""
    return torch.arange(keys)[None, :] <= torch.arange(keys - queries, keys)[:, None]


def _eager(module_kind, q, k, v, mask: torch.Tensor, **kwargs) -> torch.Tensor:
    """The eager function's output as [1, H, Q, D] (it returns [1, Q, H, D])."""
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)[None, None]
    out, _ = module_kind(q, k, v, additive, **kwargs)
    return out.transpose(1, 2)


@pytest.mark.parametrize("kind", ["softcap", "sinks"])
@pytest.mark.parametrize("queries,keys", [(1, 9), (5, 5), (4, 11)])
def test_grouped_and_folded_layouts_equal_the_models_eager_attention(kind, queries, keys):
    q, k, v = _inputs(queries, keys)
    mask = _causal(queries, keys)
    if kind == "softcap":
        extras = LogitExtras(softcap=2.0)
        want = _eager(lambda *a, **kw: modeling_gemma2.eager_attention_forward(_Module(), *a, **kw), q, k, v, mask,
                      dropout=0.0, scaling=0.25, softcap=2.0)  # fmt: skip
    else:
        sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(1))
        extras = LogitExtras(sinks=sinks)
        want = _eager(lambda *a, **kw: modeling_gpt_oss.eager_attention_forward(_Module(sinks), *a, **kw), q, k, v,
                      mask, dropout=0.0, scaling=0.25)  # fmt: skip
    grouped = attend(q, k, v, extras, scale=0.25, mask=mask)
    torch.testing.assert_close(grouped, want, rtol=1e-4, atol=1e-5)
    g = HQ // HKV  # the engine's decode layout: each KV head's g query heads folded into the query axis
    folded_q = q.view(1, HKV, g, queries, D).transpose(2, 3).reshape(1, HKV, queries * g, D)
    folded_mask = mask.repeat_interleave(g, dim=0)  # row i * g + j is query i
    folded = attend(folded_q, k, v, extras, scale=0.25, mask=folded_mask, folded=g)
    unfolded = folded.view(1, HKV, queries, g, D).transpose(2, 3).reshape(1, HQ, queries, D)
    torch.testing.assert_close(unfolded, want, rtol=1e-4, atol=1e-5)
    if queries == keys:  # whole prompts: is_causal instead of a mask
        torch.testing.assert_close(attend(q, k, v, extras, scale=0.25, is_causal=True), grouped, rtol=0, atol=0)


def test_without_extras_it_is_sdpa_itself():
    q, k, v = _inputs(4, 11)
    mask = _causal(4, 11)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    assert torch.equal(sdpa(q, k, v, None, attn_mask=mask, scale=0.25, enable_gqa=True), want)
    assert LogitExtras.of({"softcap": None, "s_aux": None, "position_ids": 1}) is None
    assert LogitExtras.of({"softcap": 30.0}) == LogitExtras(softcap=30.0)
