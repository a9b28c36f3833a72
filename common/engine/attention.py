"""Paged attention over a packed batch, plugged into unmodified ``transformers`` models.

The model runs with ``input_ids`` of shape ``[1, T]`` (the new tokens of every scheduled sequence, packed
without padding), ``position_ids`` restarting per sequence, ``use_cache=False`` and an
:class:`AttentionMetadata` passed as the model kwarg ``pdserve_attn``; transformers forwards unknown kwargs
to the registered attention function unchanged. For every layer that function

1. writes the step's new K/V into the paged cache at ``slot_mapping``, then
2. for each :class:`AttentionGroup`, gathers the group's K/V by block table and runs one padded, masked
   ``scaled_dot_product_attention`` for all its sequences at once (no Python loop over sequences).

Sequences are grouped by shape: the *decode group* holds the sequences with one new token (packed first,
in order, so its output needs no scatter); the *prefill group* the rest (prompt chunks, recomputes),
padded to the longest chunk, unless every one is a whole prompt from position 0 (:func:`_fresh_attention`:
each prompt on its own K/V, by a varlen kernel on CUDA, the engine's flash attention on AVX2 or AVX-512 CPUs, or one
causal SDPA per prompt). Grouped-query heads
are handled without repeating K/V: the query heads that share a KV head are folded into the query-length
axis.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from common.engine import cpu_kernels
from common.engine.attention_math import LogitExtras, sdpa
from common.engine.kv_cache import PagedKVCache

log = logging.getLogger(__name__)
ATTENTION_NAME = "pdserve_paged"
METADATA_KWARG = "pdserve_attn"


@dataclass
class AttentionGroup:
    """Sequences attended in one SDPA call.

    ``token_index`` is ``None`` for the decode group: its queries are the packed tokens
    ``[token_start, token_start + B)``, one per sequence. Otherwise ``token_index`` [B, Q] maps each
    (sequence, query) to its packed token (padding → 0) and ``valid`` [B, Q] marks the real queries.

    ``first_block`` is set for a decode group of one sequence whose blocks are the consecutive ids from
    ``first_block`` on, with ``num_keys`` its length: its keys are then read in place
    (:meth:`PagedKVCache.contiguous`), no gather, no mask.

    ``block_table`` and ``seq_lens`` are set for a decode group when the engine's CPU kernel is loaded
    (:mod:`common.engine.cpu_kernels`): ``torch.ops.pdserve.paged_decode_attention`` then reads each
    sequence's keys in place from the paged cache, no gather (``gather_index`` is None), no mask, no padding.

    ``fresh_prompt`` is set for a prefill group of whole prompts, each computed from position 0 in this step
    (the usual work of a prefill worker): it counts them, and each attends causally to its own K/V in the step,
    no gather, no padding, no mask (:func:`_fresh_attention`). The prompts are the packed tokens from
    ``token_start`` on, their bounds relative to it in ``fresh_bounds`` [n + 1] (int32); ``num_keys`` is the
    longest. ``cpu_prefill_kernel``: on the CPU (bf16, fp32) they may attend by the engine's kernel
    (``torch.ops.pdserve.prefill_attention``; the engine checked that it runs here and was chosen). Any other
    prefill group then carries ``kernel_table`` and ``kernel_spans`` (``num_keys``: its most keys) for
    ``torch.ops.pdserve.paged_prefill_attention``, which reads its keys from the cache.
    """

    # what PagedKVCache.gather reads: the group's block table [B, nb], flattened (None on the CPU kernel)
    gather_index: torch.Tensor | None
    query_pos: torch.Tensor  # [B, Q] int64 absolute position of each query (padding → 0)
    token_start: int = 0
    token_index: torch.Tensor | None = None  # [B, Q] int64
    valid: torch.Tensor | None = None  # [B, Q] bool
    first_block: int | None = None
    num_keys: int = 0
    fresh_prompt: int = 0  # n whole prompts: packed tokens token_start + [fresh_bounds[i], fresh_bounds[i + 1])
    fresh_bounds: torch.Tensor | None = None  # [n + 1] int32 on the CPU
    cpu_prefill_kernel: bool = False
    # a prefill group of chunks continuing their sequences, on the CPU prefill kernel: its block table [B, nb] and
    # (packed index of the first new token, its position, new tokens) per sequence [B, 3], int64, contiguous
    kernel_table: torch.Tensor | None = None
    kernel_spans: torch.Tensor | None = None
    # a prefill group of several sequences: (packed index of its first new token, its first position, its new
    # tokens) per sequence, [B, 3] int64 on the CPU; each then attends by itself (_per_sequence_attention)
    seq_spans: torch.Tensor | None = None
    # decode group on the CPU kernel: block table [B, nb] and keys per sequence [B] (int64, contiguous)
    block_table: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    def mask(self, num_keys: int, sliding_window: int | None) -> torch.Tensor:
        """[B, 1, Q, K] bool: key k is visible to a query at position p iff k <= p (and p - k < window).

        Keys past a sequence's length are hidden by the same rule, since p < length for every real query;
        a padded query (p = 0) sees key 0 only, so no row is fully masked. Built once per step and window.
        """
        cached = self._masks.get(sliding_window)
        if cached is None:
            k = torch.arange(num_keys, device=self.query_pos.device)
            pos = self.query_pos.unsqueeze(-1)  # [B, Q, 1]
            visible = k <= pos
            if sliding_window is not None:
                visible &= k > pos - sliding_window
            cached = self._masks[sliding_window] = visible.unsqueeze(1)
        return cached


@dataclass
class AttentionMetadata:
    """Per-step inputs of the attention function, shared by all layers."""

    kv_cache: PagedKVCache
    write_index: torch.Tensor  # where PagedKVCache.write puts the K/V of the T packed tokens
    groups: list[AttentionGroup]
    on_layer_written: Callable[[int], None] | None = None  # called with the layer index after its K/V write

    def gather(self, layer: int, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_cache.gather(layer, group.gather_index, group.query_pos.shape[0])


def _in_place_attention(
    group: AttentionGroup,
    meta: AttentionMetadata,
    layer: int,
    q_tok: torch.Tensor,  # [1, Hq, D]: the one decode query, at position num_keys - 1
    scaling: float | None,
    sliding_window: int | None,
    extras: LogitExtras | None = None,
) -> torch.Tensor:
    """Attention of one decode query over its sequence's consecutive blocks, read in place: [1, 1, Hq, D].

    The keys are exactly the visible ones (``[first, num_keys)``), so no mask is needed."""
    n = group.num_keys
    first = 0 if sliding_window is None else max(0, n - sliding_window)
    k, v = meta.kv_cache.contiguous(layer, group.first_block, n)  # [1, Hkv, n, D]
    k, v = k[:, :, first:].to(q_tok.dtype), v[:, :, first:].to(q_tok.dtype)
    h_kv, d = k.shape[1], k.shape[3]
    h_q = q_tok.shape[1]
    q = q_tok.view(1, h_kv, h_q // h_kv, d)  # the query heads of each KV head on the query axis
    out = sdpa(q, k, v, extras, h_q // h_kv, scale=scaling)  # [1, Hkv, g, D]
    return out.reshape(1, 1, h_q, d)  # CUDA's memory-efficient kernel (fp32) returns it transposed: not a view


def _kernel_attention(
    group: AttentionGroup,
    meta: AttentionMetadata,
    layer: int,
    q_tok: torch.Tensor,  # [T, Hq, D]
    scaling: float | None,
    sliding_window: int | None,
    extras: LogitExtras | None = None,
) -> torch.Tensor:
    """The decode group's attention by the CPU kernel: [B, Hq, D] for the packed tokens
    ``[token_start, token_start + B)``; with a soft cap or sink logits where ``extras`` has them."""
    b = group.block_table.shape[0]
    q = q_tok[group.token_start : group.token_start + b]
    out = torch.empty(q.shape, dtype=q.dtype)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    torch.ops.pdserve.paged_decode_attention(out, q, meta.kv_cache.data, layer, group.block_table, group.seq_lens,
                                             scale, sliding_window or 0, *kernel_extras(extras))  # fmt: skip
    return out


def kernel_extras(extras: LogitExtras | None) -> tuple[float, torch.Tensor | None]:
    """``extras`` as the CPU attention kernels take them: the soft cap (0.0: none) and the sinks as a contiguous
    float [Hq] tensor (None: none; the fused GPT-OSS attention hands them over in float already)."""
    if extras is None:
        return 0.0, None
    sinks = extras.sinks
    if sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous() or sinks.requires_grad):
        sinks = sinks.detach().float().contiguous()
    return extras.softcap or 0.0, sinks


def _fresh_attention(
    group: AttentionGroup,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,
    out: torch.Tensor,  # [T, Hq, D], written
    scaling: float | None,
    sliding_window: int | None = None,
    extras: LogitExtras | None = None,
) -> None:
    """Whole prompts attending causally to their own K/V, on the step's tensors (no gather, no padding to the
    longest prompt, no mask): one varlen kernel call where one is installed for the device and dtype
    (:func:`varlen_kernel`) that computes the ``extras`` asked for (the CPU kernels do), else one ``is_causal`` SDPA
    per prompt (plain tensor ops with ``extras``). The caller checked that no prompt is longer than
    ``sliding_window`` unless a varlen kernel runs (which applies the window itself)."""
    own = slice(group.token_start, group.token_start + int(group.fresh_bounds[-1]))
    kernel = varlen_kernel(query, group.cpu_prefill_kernel, extras)
    if kernel is not None:
        # what the first call of each kind checks: the causal mask alone, or with a window that cuts a prompt, each
        # with the logit extras asked for
        windowed = sliding_window is not None and group.num_keys > sliding_window
        mode = _mode(windowed, extras)
        q, k, v = (t[0, :, own].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
        if not kernel.strided:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        bounds = group.fresh_bounds.to(query.device, non_blocking=True)
        window = sliding_window if windowed else None  # a window no prompt reaches is no window
        if mode in kernel.verified:
            kernel.into(out[own], q, k, v, bounds, group.num_keys, scaling, window, extras)
            return
        try:
            o = kernel(q, k, v, bounds, group.num_keys, scaling, window, extras)
        except Exception as exc:  # noqa: BLE001  (unsupported head size, GPU generation, ...: per-prompt SDPA)
            _drop_varlen(kernel, f"raised {exc!r}")
        else:
            if _verify_varlen(kernel, mode, o, group, query, key, value, scaling, sliding_window, extras):
                out[own] = o
                return
    _fresh_attention_sdpa(group, query, key, value, out, scaling, sliding_window, extras)


def _fresh_attention_sdpa(group, query, key, value, out, scaling, sliding_window, extras=None) -> None:
    bounds = group.fresh_bounds.tolist()
    gqa = key.shape[1] != query.shape[1]
    for a, b in zip(bounds, bounds[1:]):
        own = slice(group.token_start + a, group.token_start + b)
        q, k, v = query[:, :, own], key[:, :, own], value[:, :, own]
        if sliding_window is None or b - a <= sliding_window:
            o = sdpa(q, k, v, extras, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:  # only when checking a varlen kernel: the window as a mask
            mask = _causal_mask(0, b - a, sliding_window, q.device)
            o = sdpa(q, k, v, extras, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        out[own] = o[0].transpose(0, 1)


class VarlenKernel:
    """A variable-length attention kernel over packed prompts: ``(q [T, Hq, D], k [T, Hkv, D], v, bounds [n + 1]
    int32 on the device, longest, scale, sliding window) -> [T, Hq, D]``, each prompt causal over its own keys.
    ``strided``: q, k, v may be views with any token and head strides (unit stride in D), as the step made them.
    ``writes_into``: ``fn`` also takes ``out=``, a [T, Hq, D] view (unit stride in D) to write instead of a new
    tensor (the step's output rows: no copy of a 2,048-token prompt's 4 MB a layer). ``takes_extras``: ``fn`` also
    takes ``extras=`` (:class:`LogitExtras`: a soft cap, sink logits) and computes them."""

    def __init__(self, name: str, fn: Callable, strided: bool = False, writes_into: bool = False,
                 takes_extras: bool = False) -> None:  # fmt: skip
        self.name, self.fn, self.strided, self.writes_into = name, fn, strided, writes_into
        self.takes_extras = takes_extras
        # "causal", "window" (then "+softcap", "+sinks" where asked for): kinds of call whose output matched
        # per-prompt SDPA (or the plain-op attention of those extras)
        self.verified: set[str] = set()
        self.failed = ""

    def __call__(self, q, k, v, bounds, longest: int, scale: float | None, window: int | None,
                 extras: LogitExtras | None = None) -> torch.Tensor:  # fmt: skip
        return self.fn(q, k, v, bounds, longest, scale, window, **self._extras(extras))

    def into(self, out: torch.Tensor, q, k, v, bounds, longest: int, scale: float | None, window: int | None,
             extras: LogitExtras | None = None) -> None:  # fmt: skip
        """The output written into ``out``: in place where the kernel ``writes_into``, else copied there."""
        if self.writes_into:
            self.fn(q, k, v, bounds, longest, scale, window, out=out, **self._extras(extras))
        else:
            out.copy_(self.fn(q, k, v, bounds, longest, scale, window, **self._extras(extras)))

    def _extras(self, extras: LogitExtras | None) -> dict:
        if extras is None:
            return {}
        if not self.takes_extras:
            raise RuntimeError(f"varlen attention {self.name} computes no {extras}")
        return {"extras": extras}


_VARLEN: dict[str, VarlenKernel | None] = {}  # by device type and dtype; None: none usable


def _flash_attn_varlen() -> VarlenKernel | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001  (not installed, or built for another torch/CUDA)
        return None

    def run(q, k, v, bounds, longest, scale, window):
        return flash_attn_varlen_func(q, k, v, bounds, bounds, longest, longest, softmax_scale=scale, causal=True,
                                      window_size=(-1, -1) if window is None else (window - 1, 0))  # fmt: skip

    return VarlenKernel("flash_attn.flash_attn_varlen_func", run)


def _torch_varlen() -> VarlenKernel | None:
    """torch's varlen attention where it takes ``scale`` and ``window_size`` (torch 2.10 on; torch 2.9's took only
    ``is_causal``); without ``enable_gqa`` (before 2.12) the KV heads are repeated for their query heads."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if not {"scale", "window_size"} <= params.keys():
        log.info("torch %s's varlen_attn takes no scale or window: whole prompts attend one by one", torch.__version__)
        return None
    gqa = "enable_gqa" in params

    def run(q, k, v, bounds, longest, scale, window):
        group = q.shape[1] // k.shape[1]
        extra = {}
        if group > 1 and gqa:
            extra["enable_gqa"] = True
        elif group > 1:  # [tokens, heads, dim]: query head h reads KV head h // group
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return varlen_attn(q, k, v, bounds, bounds, longest, longest, scale=scale,
                           window_size=(-1, 0) if window is None else (window - 1, 0), **extra)  # fmt: skip

    return VarlenKernel("torch.nn.attention.varlen.varlen_attn", run)


def varlen_kernel(query: torch.Tensor, cpu_kernel: bool = False,
                  extras: LogitExtras | None = None) -> VarlenKernel | None:  # fmt: skip
    """The varlen kernel for ``query``'s device and dtype: flash-attn's when installed, else torch's (CUDA, fp16 or
    bf16 only); on the CPU in bf16 or fp32 the engine's own where ``cpu_kernel`` (:func:`cpu_prefill_kernel_chosen`);
    else None. With ``extras`` (a soft cap, sinks) only a kernel that computes them: the CPU kernel's."""
    if query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float32) and cpu_kernel:
        key = cpu_kernel_key(query.dtype)
        if key not in _VARLEN:
            _VARLEN[key] = _cpu_prefill_varlen()
        kernel = _VARLEN[key]
    elif query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16):
        return None
    else:
        key = f"{query.device.type}:{query.dtype}"
        if key not in _VARLEN:
            _VARLEN[key] = _flash_attn_varlen() or _torch_varlen()
        kernel = _VARLEN[key]
    return None if kernel is None or (extras is not None and not kernel.takes_extras) else kernel


def _cpu_prefill_varlen() -> VarlenKernel:
    def run(q, k, v, bounds, longest, scale, window, out=None, extras=None):
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype)
        torch.ops.pdserve.prefill_attention(out, q, k, v, bounds, q.shape[-1] ** -0.5 if scale is None else scale,
                                            window or 0, *kernel_extras(extras))  # fmt: skip
        return out

    return VarlenKernel("pdserve.prefill_attention", run, strided=True, writes_into=True, takes_extras=True)


def _mode(windowed: bool, extras: LogitExtras | None) -> str:
    """A kind of kernel call, checked once against the path it replaces: ``causal`` or ``window`` (a window that
    cuts a sequence), then ``+softcap``, ``+sinks`` for the logit extras asked for."""
    mode = "window" if windowed else "causal"
    if extras is not None:
        mode += "+softcap" * (extras.softcap is not None) + "+sinks" * (extras.sinks is not None)
    return mode


def cpu_prefill_kernel_chosen(choice: str, dtype: torch.dtype, head_dim: int | None = None,
                              extras: bool = False) -> bool:  # fmt: skip
    """Whether prefill groups attend by the engine's kernels (``torch.ops.pdserve.prefill_attention``,
    ``paged_prefill_attention``) for ``EngineConfig.prefill_attention`` ``choice``, on a CPU whose engine kernels
    loaded, in ``dtype``: ``kernel`` where the build has them (AVX2 and FMA, both dtypes in float; AVX-512, bf16
    there with AVX512-BF16), ``auto`` there too except bf16 on CPUs with AMX where the kernel has no AMX path for
    ``head_dim`` (``prefill_attention_amx``: head dims 32 to 256 by 32; torch's flash attention runs on AMX tiles
    there and beat the vdpbf16ps kernel) and the model asks for no logit ``extras`` (a soft cap, sinks: SDPA computes
    neither, the plain tensor ops that would read every prompt's whole score matrix several times), ``sdpa`` never.
    2,048 tokens of 16 heads of 64 over 8 KV heads in bf16: on a 2-core Zen 4 VM 29 ms a layer against SDPA's 71,
    on a 2-core Xeon with AMX ~12 against ~23, heads of 128 ~23 against ~30, on a 2-core Zen 3 VM (AVX2) ~70
    against ~95 (docs/benchmarks.md)."""
    if choice == "sdpa" or dtype not in (torch.bfloat16, torch.float32):
        return False
    if not torch.ops.pdserve.prefill_attention_supported(dtype):
        if choice == "kernel":
            log.warning("prefill_attention=kernel: this build has no %s kernel; prompts attend by SDPA", dtype)
        return False
    if choice == "kernel" or dtype != torch.bfloat16 or extras or "amx_bf16" not in cpu_kernels.cpu_flags():
        return True
    return head_dim is not None and torch.ops.pdserve.prefill_attention_amx(head_dim)


def cpu_prefill_dropped() -> bool:
    """Whether a CPU prefill kernel (whole prompts, or chunks continuing their sequences) failed its check in this
    process (those prompts attend by SDPA)."""
    return any(k.startswith("cpu") and v is None for k, v in _VARLEN.items())


def cpu_kernel_key(dtype: torch.dtype, paged: bool = False) -> str:
    """Where :data:`_VARLEN` keeps the CPU prefill kernel of ``dtype`` (whole prompts, or ``paged``: chunks reading
    the cache), each with its own first-call checks."""
    return f"cpu{'-paged' if paged else ''}:{dtype}"


def _verify_varlen(kernel: VarlenKernel, mode: str, got: torch.Tensor, group, query, key, value, scaling,
                   sliding_window, extras: LogitExtras | None = None) -> bool:  # fmt: skip
    """The kernel's first output of a kind (``mode``) against per-prompt SDPA (with ``extras``: the plain-op
    attention of attention_math.py, in float: see :func:`_reference_dtype`): kept when within the dtype's rounding
    (1e-2 relative to the largest output, at least 1e-2), else dropped for good with a warning."""
    dtype = _reference_dtype(query.dtype, extras)
    want = torch.empty_like(got, dtype=dtype)
    start = group.token_start
    relative = AttentionGroup(gather_index=None, query_pos=group.query_pos, fresh_prompt=group.fresh_prompt,
                              fresh_bounds=group.fresh_bounds, num_keys=group.num_keys)  # token_start 0
    _fresh_attention_sdpa(relative, *(t[:, :, start:].to(dtype) for t in (query, key, value)), want, scaling,
                          sliding_window, extras)  # fmt: skip
    return _check_first(kernel, mode, got, want, "per-prompt SDPA" if extras is None else "per-prompt plain ops")


def _reference_dtype(dtype: torch.dtype, extras: LogitExtras | None) -> torch.dtype:
    """The dtype a kernel's first call of a kind is checked in: its own, but float where a 16-bit model asks for
    logit extras. Their plain ops round every logit to 16 bits before the cap and the softmax (Gemma 2's eager
    attention in bf16: logits near a cap of 50 to steps of 0.25), far from what the kernels compute in float; a
    Gemma 2 family checkpoint's first 2,048-token prompt differed by 0.125 where the outputs reached ~5.5."""
    return torch.float32 if extras is not None and dtype in (torch.bfloat16, torch.float16) else dtype


def _check_first(kernel: VarlenKernel, mode: str, got: torch.Tensor, want: torch.Tensor, against: str) -> bool:
    """A kernel's first output of a kind against the path it replaces: ``mode`` verified when within the dtype's
    rounding (1e-2 relative to the largest output, at least 1e-2), else the kernel dropped for good."""
    diff = float((got.float() - want.float()).abs().max())
    tolerance = 1e-2 * max(1.0, float(want.float().abs().max()))
    if diff <= tolerance:
        kernel.verified.add(mode)
        return True
    _drop_varlen(kernel, f"max |difference| {diff:.3g} from {against} > {tolerance:.3g} ({mode})")
    return False


def _drop_varlen(kernel: VarlenKernel, why: str) -> None:
    kernel.failed = why
    log.warning("varlen attention %s dropped: %s; prompts attend by per-prompt SDPA", kernel.name, why)
    for k in [k for k, v in _VARLEN.items() if v is kernel]:
        _VARLEN[k] = None


def _causal_mask(start: int, n: int, sliding_window: int | None, device) -> torch.Tensor:
    """[n, start + n] bool for queries at positions start..start+n-1 over keys 0..start+n-1: key j visible to the
    query at position p iff j <= p (and p - j < window)."""
    pos = torch.arange(start, start + n, device=device)[:, None]
    j = torch.arange(start + n, device=device)[None, :]
    mask = j <= pos
    if sliding_window is not None:
        mask &= j > pos - sliding_window
    return mask


def _per_sequence_attention(
    group: AttentionGroup,
    q_tok: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [B, Hkv, K, D]: the group's gathered keys
    v: torch.Tensor,
    out: torch.Tensor,  # [T, Hq, D], written
    scaling: float | None,
    sliding_window: int | None,
    extras: LogitExtras | None = None,
) -> None:
    """A prefill group's sequences one by one, each over its own keys only (not padded to the group's longest
    chunk and context): one masked SDPA per sequence (key j visible to the query at position p iff j <= p, and
    p - j < window)."""
    gqa = k.shape[1] != q_tok.shape[1]
    for b, (offset, start, n) in enumerate(group.seq_spans.tolist()):
        keys = start + n
        q = q_tok[offset : offset + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        mask = _causal_mask(start, n, sliding_window, q.device)
        o = sdpa(q, k[b : b + 1, :, :keys].to(q.dtype), v[b : b + 1, :, :keys].to(q.dtype), extras, attn_mask=mask,
                 scale=scaling, enable_gqa=gqa)  # fmt: skip
        out[offset : offset + n] = o[0].transpose(0, 1)


def _group_attention(
    group: AttentionGroup,
    q_tok: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [B, Hkv, K, D]
    v: torch.Tensor,
    scaling: float | None,
    sliding_window: int | None,
    extras: LogitExtras | None = None,
) -> torch.Tensor:
    """Attention output of the group's queries: [B, Q, Hq, D]."""
    b, h_kv, num_keys, d = k.shape
    h_q = q_tok.shape[1]
    g = h_q // h_kv
    if group.token_index is None:
        q = q_tok[group.token_start : group.token_start + b].view(b, 1, h_kv, g, d)
    else:
        q = q_tok[group.token_index.reshape(-1)].view(b, -1, h_kv, g, d)
    num_q = q.shape[1]
    # fold the g query heads of each KV head into the query axis: [B, Hkv, Q*g, D]
    q = q.permute(0, 2, 1, 3, 4).reshape(b, h_kv, num_q * g, d)
    mask = group.mask(num_keys, sliding_window)  # [B, 1, Q, K]
    if num_q > 1 and g > 1:
        mask = mask.unsqueeze(3).expand(b, 1, num_q, g, num_keys).reshape(b, 1, num_q * g, num_keys)
    out = sdpa(q, k, v, extras, g, attn_mask=mask, scale=scaling)  # [B, Hkv, Q*g, D]
    return out.view(b, h_kv, num_q, g, d).permute(0, 2, 1, 3, 4).reshape(b, num_q, h_q, d)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D], RoPE applied
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered as ``pdserve_paged``; returns ([1, T, Hq, D], None)."""
    meta: AttentionMetadata | None = kwargs.get(METADATA_KWARG)
    if meta is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs the {METADATA_KWARG!r} model kwarg")
    layer = module.layer_idx
    # a soft cap or sinks: the decode kernel computes them, the prefill kernels do not (attention_math.py does)
    extras = LogitExtras.of(kwargs)
    q_tok = query[0].transpose(0, 1)  # [T, Hq, D]
    meta.kv_cache.write(layer, meta.write_index, key[0], value[0])
    if meta.on_layer_written is not None:
        meta.on_layer_written(layer)
    num_tokens, h_q, d = q_tok.shape
    if len(meta.groups) == 1 and meta.groups[0].token_index is None:  # decode only: no scatter
        group = meta.groups[0]
        if group.seq_lens is not None:
            return _kernel_attention(group, meta, layer, q_tok, scaling, sliding_window, extras).unsqueeze(0), None
        if group.first_block is not None:
            return _in_place_attention(group, meta, layer, q_tok, scaling, sliding_window, extras), None
        k, v = meta.gather(layer, group)
        out = _group_attention(group, q_tok, k.to(query.dtype), v.to(query.dtype), scaling, sliding_window, extras)
        return out.view(1, num_tokens, h_q, d), None
    out = torch.empty(num_tokens, h_q, d, dtype=query.dtype, device=query.device)
    for group in meta.groups:  # at most two: decode, prefill
        windowed = sliding_window is not None and group.num_keys > sliding_window  # a prompt past the window
        if group.fresh_prompt and (not windowed or varlen_kernel(query, group.cpu_prefill_kernel, extras) is not None):
            _fresh_attention(group, query, key, value, out, scaling, sliding_window, extras)
            continue
        if group.seq_lens is not None:
            out[group.token_start : group.token_start + group.seq_lens.shape[0]] = _kernel_attention(
                group, meta, layer, q_tok, scaling, sliding_window, extras
            )
            continue
        if group.kernel_spans is not None and _paged_prefill(group, meta, layer, q_tok, out, scaling, sliding_window,
                                                             extras):  # fmt: skip
            continue
        _gathered_attention(group, meta, layer, q_tok, out, scaling, sliding_window, extras)
    return out.unsqueeze(0), None


def _gathered_attention(group, meta, layer, q_tok, out, scaling, sliding_window, extras=None) -> None:
    """A group's keys gathered from the cache, then one sequence at a time (``seq_spans``) or all padded to one
    masked SDPA; its rows of ``out`` written."""
    k, v = meta.gather(layer, group)
    if group.seq_spans is not None:
        _per_sequence_attention(group, q_tok, k, v, out, scaling, sliding_window, extras)
        return
    o = _group_attention(group, q_tok, k.to(q_tok.dtype), v.to(q_tok.dtype), scaling, sliding_window, extras)
    if group.token_index is None:
        out[group.token_start : group.token_start + o.shape[0]] = o[:, 0]
    else:
        out[group.token_index[group.valid]] = o[group.valid]


def _paged_prefill(group, meta, layer, q_tok, out, scaling, sliding_window, extras=None) -> bool:
    """Prefill chunks that continue their sequences, by ``torch.ops.pdserve.paged_prefill_attention`` (keys read
    from the paged cache, no gather, no padding, no mask tensor; a soft cap and sinks where ``extras`` has them);
    False when that kernel was dropped. Its first call of each kind (causal, sliding window, each with its extras) is
    checked against the gathered path, as a varlen kernel's first call is, and the kernel dropped for good on a
    difference or an exception (the gathered result is then the output)."""
    key = cpu_kernel_key(q_tok.dtype, paged=True)
    if key not in _VARLEN:  # its state only (checks, failure): the op is called below
        _VARLEN[key] = VarlenKernel("pdserve.paged_prefill_attention", None)
    kernel = _VARLEN[key]
    if kernel is None:
        return False
    windowed = sliding_window is not None and group.num_keys > sliding_window
    mode, window = _mode(windowed, extras), sliding_window if windowed else 0
    scale = q_tok.shape[-1] ** -0.5 if scaling is None else scaling

    def run(into: torch.Tensor) -> None:
        torch.ops.pdserve.paged_prefill_attention(into, q_tok, meta.kv_cache.data, layer, group.kernel_table,
                                                  group.kernel_spans, scale, window,
                                                  *kernel_extras(extras))  # fmt: skip

    if mode in kernel.verified:
        run(out)
        return True
    try:
        run(out)
    except Exception as exc:  # noqa: BLE001  (a check of the kernel's own: the gathered path serves)
        _drop_varlen(kernel, f"raised {exc!r}")
        return False
    dtype = _reference_dtype(q_tok.dtype, extras)
    want = out.to(dtype, copy=True)  # the rows of other groups as they are
    _gathered_attention(group, meta, layer, q_tok.to(dtype), want, scaling, sliding_window, extras)
    if not _check_first(kernel, mode, out, want, "the gathered path"):
        out.copy_(want)
    return True


def register() -> str:
    """Register the attention function with transformers (idempotent); returns its name."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    return ATTENTION_NAME
