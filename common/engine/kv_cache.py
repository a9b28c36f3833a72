"""The paged KV cache: K/V tensors of every layer, addressed by block id.

Layout per layer and for K and V alike: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (token-major,
so the new tokens of a step are written with one ``index_copy_`` on a flat ``[num_slots, H, D]`` view).
A *slot* is ``block_id * block_size + offset``. Which block belongs to whom is the
:class:`~common.engine.block_pool.BlockPool`'s business; this module only moves bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


class PagedKVCache:
    """K/V storage for ``num_blocks`` blocks of every layer."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu") -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (spec.num_layers, *spec.block_shape(num_blocks))
        # Zeroed, not empty: masked-out slots (block tails, padding) still enter the attention matmuls, and
        # uninitialised memory may hold NaN bit patterns, which a zero attention weight does not cancel.
        self.k = torch.zeros(shape, dtype=spec.dtype, device=device)  # [L, N, bs, H, D]
        self.v = torch.zeros(shape, dtype=spec.dtype, device=device)
        flat = (spec.num_layers, num_blocks * spec.block_size, spec.num_kv_heads, spec.head_dim)
        self._k_flat = self.k.view(flat)  # [L, N*bs, H, D]
        self._v_flat = self.v.view(flat)

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the K/V of new tokens. ``slot_mapping``: [T] int64; ``key``/``value``: [T, H, D]."""
        self._k_flat[layer].index_copy_(0, slot_mapping, key.to(self.spec.dtype))
        self._v_flat[layer].index_copy_(0, slot_mapping, value.to(self.spec.dtype))

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the blocks in ``block_table`` ([B, nb] int64), as [B, nb * bs, H, D] each (a copy)."""
        b, nb = block_table.shape
        k = self.k[layer].index_select(0, block_table.reshape(-1))  # [B*nb, bs, H, D]
        v = self.v[layer].index_select(0, block_table.reshape(-1))
        seq = nb * self.spec.block_size
        return k.view(b, seq, self.spec.num_kv_heads, self.spec.head_dim), v.view(
            b, seq, self.spec.num_kv_heads, self.spec.head_dim
        )

    def read_blocks(self, layer: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one layer's blocks, [n, bs, H, D] each, in ``block_ids`` order."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        return self.k[layer].index_select(0, idx), self.v[layer].index_select(0, idx)

    def write_blocks(self, layer: int, block_ids: list[int], key: torch.Tensor, value: torch.Tensor) -> None:
        """Overwrite one layer's blocks with ``key``/``value`` ([n, bs, H, D] each, n == len(block_ids))."""
        expected = (len(block_ids), *self.spec.block_shape(1)[1:])
        if tuple(key.shape) != expected or tuple(value.shape) != expected:
            raise ValueError(f"KV blocks of shape {tuple(key.shape)}/{tuple(value.shape)} do not fit {expected}")
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        self.k[layer].index_copy_(0, idx, key.to(device=self.k.device, dtype=self.spec.dtype))
        self.v[layer].index_copy_(0, idx, value.to(device=self.k.device, dtype=self.spec.dtype))
