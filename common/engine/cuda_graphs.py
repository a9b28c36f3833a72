"""Decode steps replayed from CUDA graphs (``EngineConfig.cuda_graphs``).

A decode step of a small batch on a GPU is bound by its kernel launches (a few hundred a step, each a Python
call through transformers and torch), not by the arithmetic. :class:`DecodeGraphs` records the model's forward of
a decode step once per shape and replays it: one launch from Python, the kernels back to back.

A graph replays fixed shapes at fixed addresses, so every decode step is put into a *bucket*:

- the batch padded to the next of 1, 2, 4, 8, then multiples of 8 (up to ``max_batch``); a padding row is
  token 0 at position 0 whose K/V go to the *scratch block*, a block of the cache that the block pool never
  hands out, and whose keys are the scratch block's;
- the block table padded to the next of 1, 2, 3, 4, 6, 8, 12, 16, ... blocks (powers of two and their 1.5x, up
  to the blocks of ``max_model_len``) with the scratch block; the attention is the path every device has (the
  blocks gathered, one masked SDPA: :mod:`common.engine.attention`), and the mask hides every key past a
  sequence's position, so the padding changes what a real row attends to in nothing, and its numbers at most by
  rounding (a padded batch may take other matmul kernels); it costs reading up to 1.5x the keys.

The step's inputs (token, position, slot, block table) are copied into static tensors that the graph reads; the
metadata (write and gather indices, mask) is computed inside the graph from them. A bucket's graph is captured
the first time a step needs it, after an eager run of the same forward on the same inputs (the warm-up); its
first replay must give that eager run's logits (tokens equal, values within rounding), else the graphs are
switched off with a warning and the engine goes on without them. Graphs share one memory pool; a replay's
logits are valid until the next replay (the engine samples them first).

Not with tensor parallelism (the engine keeps the graphs off there), nor for a step that streams a prompt's
KV layer by layer (such steps run eagerly). On the CPU (``capture=False``) the same static-shape path runs
eagerly: no graph, the same buffers, padding and buckets, which the tests compare with the usual path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from common.engine.attention import AttentionGroup, AttentionMetadata
from common.engine.kv_cache import PagedKVCache

log = logging.getLogger(__name__)

# (input_ids [1, B], position_ids [1, B], attention metadata, logits_index [B]) -> logits [1, B, V]
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and always including ``max_batch``."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


def block_buckets(max_blocks: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and 1.5 times them), up to and always including ``max_blocks``."""
    sizes, p = [1, 2], 2
    while sizes[-1] < max_blocks:
        sizes += [p + p // 2, 2 * p]
        p *= 2
    return [n for n in sizes if n < max_blocks] + [max_blocks]


def _bucket(sizes: list[int], n: int) -> int:
    return next(s for s in sizes if s >= n)


class DecodeGraphs:
    """The decode steps of one model runner, by bucket (see the module doc)."""

    def __init__(self, forward: Forward, kv_cache: PagedKVCache, *, max_batch: int, max_blocks: int,
                 scratch_block: int, capture: bool) -> None:  # fmt: skip
        """``forward``: the runner's forward pass; ``scratch_block``: a block id of ``kv_cache`` that no request
        owns; ``capture``: record CUDA graphs (the cache's device must be CUDA), else run the same path eagerly."""
        device = kv_cache.data.device
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the KV cache is on {device}")
        if not 0 <= scratch_block < kv_cache.num_blocks:
            raise ValueError(f"scratch block {scratch_block} is not a block of the cache")
        self.forward = forward
        self.kv_cache = kv_cache
        self.capture = capture
        self.batch_sizes = batch_buckets(max_batch)
        self.block_counts = block_buckets(max_blocks)
        self.scratch_block = scratch_block
        b, nb = self.batch_sizes[-1], self.block_counts[-1]
        long = dict(dtype=torch.long, device=device)
        # the static inputs every graph reads (a bucket reads the first rows and columns)
        self.input_ids = torch.zeros(b, **long)
        self.positions = torch.zeros(b, **long)
        self.slots = torch.full((b,), scratch_block * kv_cache.spec.block_size, **long)
        self.block_table = torch.full((b, nb), scratch_block, **long)
        self.rows = torch.arange(b, **long)  # logits of every row, padding included
        self.enabled = True
        self.disabled_because = ""
        self.num_captured = 0
        self.num_steps = 0  # decode steps run through this path
        self._steps: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def fits(self, batch: int, blocks: int) -> bool:
        """Whether a decode step of ``batch`` sequences over at most ``blocks`` blocks each can run here."""
        return self.enabled and batch <= self.batch_sizes[-1] and blocks <= self.block_counts[-1]

    def run(self, token_ids: list[int], positions: list[int], slots: list[int],
            tables: list[list[int]]) -> torch.Tensor:  # fmt: skip
        """Logits [B, V] (the model's dtype) of one decode step: sequence i's new token ``token_ids[i]`` at
        ``positions[i]``, its K/V written at slot ``slots[i]``, its blocks ``tables[i]`` (at least
        ``positions[i] // block_size + 1`` of them). Valid until the next call."""
        b = len(token_ids)
        nb = max(len(t) for t in tables)
        key = (_bucket(self.batch_sizes, b), _bucket(self.block_counts, nb))
        bc, nc = key
        pad = bc - b
        scratch = self.scratch_block
        rows = torch.tensor([token_ids + [0] * pad, positions + [0] * pad,
                             slots + [scratch * self.kv_cache.spec.block_size] * pad], dtype=torch.long)  # fmt: skip
        table = torch.tensor([t[:nc] + [scratch] * (nc - len(t[:nc])) for t in tables] + [[scratch] * nc] * pad,
                             dtype=torch.long)  # fmt: skip
        self.input_ids[:bc].copy_(rows[0])
        self.positions[:bc].copy_(rows[1])
        self.slots[:bc].copy_(rows[2])
        self.block_table[:bc, :nc].copy_(table)
        self.num_steps += 1
        step = self._steps.get(key)
        return (step() if step is not None else self._first_run(key))[:b]

    def _forward(self, bc: int, nc: int) -> torch.Tensor:
        """The bucket's forward over the static inputs: logits [bc, V]. What a graph records."""
        kv = self.kv_cache
        positions = self.positions[:bc]
        group = AttentionGroup(gather_index=kv.gather_index(self.block_table[:bc, :nc]),
                               query_pos=positions.unsqueeze(1))  # fmt: skip
        attn = AttentionMetadata(kv_cache=kv, write_index=kv.write_index(self.slots[:bc]), groups=[group])
        return self.forward(self.input_ids[:bc].unsqueeze(0), positions.unsqueeze(0), attn, self.rows[:bc])[0]

    def _first_run(self, key: tuple[int, int]) -> torch.Tensor:
        """The first step of a bucket: records its graph and checks the graph's first replay against an eager
        forward of the same inputs; returns the logits."""
        bc, nc = key
        try:
            eager, replay = self._record(bc, nc)
        except Exception as exc:  # noqa: BLE001  (any failure to record: go on without graphs)
            self._disable(f"capturing the decode step of batch {bc} over {nc} blocks failed: {exc!r}")
            return self._forward(bc, nc)
        out = replay()
        differs = self._differs(eager, out)
        if differs:
            self._disable(f"the graph of batch {bc} over {nc} blocks gives other logits than the eager forward "
                          f"({differs})")  # fmt: skip
            return eager
        self._steps[key] = replay
        self.num_captured += self.capture
        return out

    def _record(self, bc: int, nc: int) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        """(the eager logits of the current inputs, a function that runs the bucket's step and returns its
        logits): a CUDA graph's replay, or (``capture=False``) the eager forward itself."""
        if self.capture:
            return self._capture(bc, nc)
        return self._forward(bc, nc).clone(), lambda: self._forward(bc, nc)

    def _capture(self, bc: int, nc: int) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        """(the eager logits of the current inputs, a replay function returning the graph's static logits)."""
        device = self.kv_cache.data.device
        with torch.cuda.device(device):
            # warm-up on the engine's own stream (lazy initialisation, kernel choice; the gather buffer it may grow
            # stays the eager steps' buffer, on their stream), then the capture, on torch.cuda.graph's stream
            eager = self._forward(bc, nc).clone()
            kv = self.kv_cache
            kept, kv._gather_buf = kv._gather_buf, kv.data.new_empty(0)  # the graph's gather buffer: its pool's
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    static = self._forward(bc, nc)
            finally:
                kv._gather_buf = kept

        def replay() -> torch.Tensor:
            with torch.cuda.device(device):
                graph.replay()
            return static

        return eager, replay

    @staticmethod
    def _differs(eager: torch.Tensor, replayed: torch.Tensor) -> str:
        """Why the replay's logits are not the eager ones ('' when they agree: equal greedy tokens, values
        within a rounding of the model's dtype)."""
        if not torch.equal(eager.argmax(-1), replayed.argmax(-1)):
            return "different greedy tokens"
        diff = float((eager.float() - replayed.float()).abs().max())
        scale = max(1.0, float(eager.float().abs().max()))
        tolerance = 8 * torch.finfo(eager.dtype).eps * scale
        return "" if diff <= tolerance else f"max |difference| {diff:.3g} > {tolerance:.3g}"

    def _disable(self, why: str) -> None:
        log.warning("CUDA graphs off: %s; decode steps run eagerly", why)
        self.enabled = False
        self.disabled_because = why
        self._steps.clear()

    def stats(self) -> dict:
        """What the graphs did: on or off (and why), graphs captured, steps replayed."""
        return {"enabled": self.enabled, "capture": self.capture, "captured": self.num_captured,
                "steps": self.num_steps, "buckets": len(self._steps), "disabled_because": self.disabled_because}
