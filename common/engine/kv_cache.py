"""The paged KV cache: K/V tensors of every layer, addressed by block id.

Layout: one tensor ``[num_layers, 2 (K, V), num_kv_heads, num_blocks, block_size, head_dim]``. Heads are
outside blocks so that gathering a batch's blocks yields, per head, contiguous ``[tokens, head_dim]``
matrices: attention then runs on ``[B, H, L, D]`` tensors whose inner matrices are contiguous (measured
~2x faster for decode-shaped SDPA on the CPU than token-major ``[B, L, H, D]``). K and V of a layer are
gathered and written with one indexing op each way.

A *slot* is ``block_id * block_size + offset``. Which block belongs to whom is the
:class:`~common.engine.block_pool.BlockPool`'s business; this module only moves bytes. Index tensors are
built once per step (:meth:`write_index`, :meth:`gather_index`) and used by every layer.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

import torch

# PDSERVE_KV_HUGE_PAGES=0 keeps 4 KiB pages (a fragmented machine compacts memory at the first fault-in: a
# slower start); tests and benchmarks switch it off to compare
HUGE_PAGES = os.environ.get("PDSERVE_KV_HUGE_PAGES", "1") != "0"
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back the whole 2 MiB pages inside a CPU tensor's memory with transparent huge pages
    (``madvise(MADV_HUGEPAGE)``; honoured where ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or
    ``always``; with ``never`` the advice is accepted and changes nothing). Call it before the memory is first
    written. True when ``madvise`` accepted it."""
    if not HUGE_PAGES or t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    lo, hi = -(-start // _HUGE_PAGE) * _HUGE_PAGE, end // _HUGE_PAGE * _HUGE_PAGE
    if hi <= lo:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the cache; two engines can exchange KV blocks only if their specs are equal."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def block_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """Shape of ``num_blocks`` blocks of one layer's K (or V) as exchanged between engines."""
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


class PagedKVCache:
    """K/V storage for ``num_blocks`` blocks of every layer."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu") -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        h, bs, d = spec.num_kv_heads, spec.block_size, spec.head_dim
        # Zeroed, not empty: masked-out slots (block tails, padding) still enter the attention matmuls, and
        # uninitialised memory may hold NaN bit patterns, which a zero attention weight does not cancel. On the
        # CPU the memory is first asked for huge pages (before the zeroing touches it): a sequence's blocks lie
        # anywhere in the cache, and with 4 KiB pages nearly every block read missed the TLB.
        self.data = torch.empty((spec.num_layers, 2, h, num_blocks, bs, d), dtype=spec.dtype, device=device)
        self.huge_pages = advise_huge_pages(self.data)
        self.data.zero_()
        self._by_block = self.data.view(spec.num_layers, 2 * h * num_blocks, bs, d)
        self._by_slot = self.data.view(spec.num_layers, 2 * h * num_blocks * bs, d)
        self.write_kernel = False  # write() by pdserve::write_kv_ (CPU caches of engines whose kernels loaded)
        # offset of (K|V, head) planes, in blocks: [2*H]
        self._plane = torch.arange(2 * h, device=device) * num_blocks
        # Reused output of gather(): a fresh tensor of tens of MB per layer and step would be a fresh mmap
        # each time (glibc), paying page faults on every step (measured: 4x slower decode at 32 sequences).
        self._gather_buf = torch.empty(0, dtype=spec.dtype, device=device)

    # -- per-step index building ----------------------------------------------------------------------------

    def write_index(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Flat indices [2*H*T] where the K and V of T new tokens (at ``slot_mapping`` [T]) go."""
        bs = self.spec.block_size
        return ((self._plane * bs)[:, None] + slot_mapping[None, :]).reshape(-1)

    def gather_index(self, block_table: torch.Tensor) -> torch.Tensor:
        """Flat block indices [2*H*B*nb] that :meth:`gather` reads for ``block_table`` [B, nb]."""
        return (self._plane[:, None] + block_table.reshape(1, -1)).reshape(-1)

    # -- per-layer data movement ----------------------------------------------------------------------------

    def write(self, layer: int, write_index: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the K/V of new tokens: ``key``/``value`` [H, T, D] (head-major). With :attr:`write_kernel` (set
        by an engine whose CPU kernels loaded) rows in the cache's dtype go by ``pdserve::write_kv_``, straight
        from where they lie."""
        same = key.dtype == value.dtype == self.spec.dtype
        if self.write_kernel and same and key.stride(-1) == value.stride(-1) == 1:
            torch.ops.pdserve.write_kv_(self._by_slot[layer], write_index, key, value)
            return
        src = torch.stack((key, value)).to(self.spec.dtype)  # [2, H, T, D]
        self._by_slot[layer].index_copy_(0, write_index, src.view(-1, self.spec.head_dim))

    def gather(
        self, layer: int, gather_index: torch.Tensor, batch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``batch`` sequences' blocks: [B, H, nb*bs, D] each (inner matrices contiguous).

        The result is a view of a buffer that the next call overwrites: use it before gathering again.
        """
        h, bs, d = self.spec.num_kv_heads, self.spec.block_size, self.spec.head_dim
        n = gather_index.numel()
        if self._gather_buf.numel() < n * bs * d:
            self._gather_buf = torch.empty(n * bs * d, dtype=self.spec.dtype, device=self.data.device)
        kv = self._gather_buf[: n * bs * d].view(n, bs, d)
        torch.index_select(self._by_block[layer], 0, gather_index, out=kv)  # [2*H*B*nb, bs, D]
        kv = kv.view(2, h, batch, -1, d).transpose(1, 2)  # [2, B, H, L, D]
        return kv[0], kv[1]

    def contiguous(self, layer: int, first_block: int, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first ``num_keys`` slots of the consecutive blocks from ``first_block`` on, read in
        place: views [1, H, num_keys, D] (a head's keys are one contiguous run of the cache)."""
        bs = self.spec.block_size
        nb = -(-num_keys // bs)
        kv = self.data[layer, :, :, first_block : first_block + nb]  # [2, H, nb, bs, D]
        kv = kv.flatten(2, 3)[:, :, :num_keys]  # [2, H, num_keys, D]
        return kv[0].unsqueeze(0), kv[1].unsqueeze(0)

    # -- one block across all layers, for the spill tiers of the prefix cache ---------------------------------

    def copy_block(self, block_id: int) -> torch.Tensor:
        """A copy of one block's K and V in every layer, in host memory (the spill tiers keep it there, Redis takes
        it as bytes): [L, 2, H, bs, D]."""
        block = self.data[:, :, :, block_id]
        return block.clone() if block.device.type == "cpu" else block.cpu()

    def load_block(self, block_id: int, kv: torch.Tensor) -> None:
        """Overwrite one block in every layer with ``kv`` [L, 2, H, bs, D] (from :meth:`copy_block`)."""
        self.data[:, :, :, block_id].copy_(kv)

    # -- whole blocks, for the hand-off between engines -----------------------------------------------------

    def read_blocks(self, layer: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one layer's blocks as [n, bs, H, D] each (token-major), in ``block_ids`` order."""
        runs = _runs(block_ids)
        if len(runs) <= _MAX_RUNS:  # a few runs of consecutive blocks: one strided copy each, no gather
            kv = self.data.new_empty((2, *self.spec.block_shape(len(block_ids))))  # [2, n, bs, H, D]
            for pos, first, n in runs:
                kv[:, pos : pos + n].copy_(self.data[layer, :, :, first : first + n].permute(0, 2, 3, 1, 4))
            return kv[0], kv[1]
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        kv = self.data[layer].index_select(2, idx)  # [2, H, n, bs, D]
        kv = kv.permute(0, 2, 3, 1, 4).contiguous()  # [2, n, bs, H, D]
        return kv[0], kv[1]

    def write_blocks(self, layer: int, block_ids: list[int], key: torch.Tensor, value: torch.Tensor) -> None:
        """Overwrite one layer's blocks with ``key``/``value`` ([n, bs, H, D] each, n == len(block_ids))."""
        expected = self.spec.block_shape(len(block_ids))
        if tuple(key.shape) != expected or tuple(value.shape) != expected:
            raise ValueError(f"KV blocks of shape {tuple(key.shape)}/{tuple(value.shape)} do not fit {expected}")
        dev, dtype = self.data.device, self.spec.dtype
        key, value = key.to(device=dev, dtype=dtype), value.to(device=dev, dtype=dtype)
        runs = _runs(block_ids)
        if len(runs) <= _MAX_RUNS:  # a few runs of consecutive blocks: one strided copy each (~4x index_copy_)
            for pos, first, n in runs:
                self.data[layer, 0, :, first : first + n].copy_(key[pos : pos + n].permute(2, 0, 1, 3))
                self.data[layer, 1, :, first : first + n].copy_(value[pos : pos + n].permute(2, 0, 1, 3))
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=dev)
        for plane, src in ((0, key), (1, value)):  # per head: ~4x faster than one index_copy_ of a permuted src
            for h in range(self.spec.num_kv_heads):
                self.data[layer, plane, h].index_copy_(0, idx, src[:, :, h, :])


_MAX_RUNS = 16  # past this many runs of consecutive blocks, one gather beats per-run copies


def _runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ascending ids as (position in block_ids, first id, length); stops counting
    once there are more than _MAX_RUNS (the caller then gathers instead)."""
    runs: list[tuple[int, int, int]] = []
    pos = 0
    while pos < len(block_ids) and len(runs) <= _MAX_RUNS:
        first = block_ids[pos]
        n = 1
        while pos + n < len(block_ids) and block_ids[pos + n] == first + n:
            n += 1
        runs.append((pos, first, n))
        pos += n
    return runs
