"""Continuous batching: which requests run in the next step, and how many of their tokens.

Each step (:meth:`Scheduler.schedule`):

1. Running requests, oldest first, each get their next chunk (1 token when decoding; a prompt or
   recompute chunk of at most ``prefill_chunk_size`` tokens), while the step's token budget lasts. A request
   whose chunk needs KV blocks that are not free preempts the newest running requests (their blocks are
   freed and they go back to the front of the waiting queue, to be recomputed), or itself when it is the
   newest.
2. If nothing was preempted, waiting requests are admitted in order while the budget, ``max_num_seqs`` and
   free blocks (above a small watermark, unless nothing runs) allow. With prefix caching, an admitted request
   first takes the cached blocks of its longest named prefix (at least its last token is always computed:
   its logits are needed) and only the rest is computed.

After each step :meth:`Scheduler.name_computed_blocks` names a request's newly completed blocks, so later
requests can reuse them (see :mod:`common.engine.prefix_cache`).

The oldest running request is never preempted by a newer one, so the engine always makes progress as long
as one request of ``max_model_len`` tokens fits the pool (checked when the engine is built).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.engine.block_pool import BlockPool
from common.engine.prefix_cache import block_hashes
from common.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num new tokens)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_chunk_size: int,
        watermark_blocks: int = 0,
        prefix_caching: bool = False,
    ) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk_size = prefill_chunk_size
        self.watermark_blocks = watermark_blocks
        self.prefix_caching = prefix_caching
        # names -> blocks loaded from the prefix cache's spill tiers (set by LLMEngine.attach_kv_tiers)
        self.tier_loader: Callable[[Sequence[bytes]], list[int]] | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # -- queue membership -------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def remove(self, request: Request, *, free_blocks: bool = True) -> None:
        """Take a request out of the queues; its blocks are freed unless ``free_blocks`` is False."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if free_blocks:
            self._free_blocks(request)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- the step -----------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_uncomputed_tokens, self.prefill_chunk_size, budget)
            need = self._blocks_needed(request, n)
            while need > self.block_pool.num_free_blocks:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:  # preempted itself
                break
            last = request.block_ids[-1] if request.block_ids else None
            request.block_ids += self.block_pool.allocate(need, after=last)  # grows in place where it can
            out.scheduled.append((request, n))
            budget -= n
            i += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self.prefix_caching and request.num_computed_tokens == 0:
                self._take_cached_prefix(request)
            n = min(request.num_uncomputed_tokens, self.prefill_chunk_size, budget)
            need = self._blocks_needed(request, n)
            reserve = self.watermark_blocks if self.running else 0
            if need + reserve > self.block_pool.num_free_blocks:
                if request.num_cached_tokens:  # give the cached blocks back until it fits
                    self._free_blocks(request)
                    request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            request.block_ids += self.block_pool.allocate(need)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, n))
            budget -= n
        return out

    # -- prefix caching -----------------------------------------------------------------------------------

    def _take_cached_prefix(self, request: Request) -> None:
        """Share the pool's blocks for the longest named prefix of the request's tokens (never all of them)."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        request.block_names = block_hashes(request.all_token_ids, self.block_size, request.block_names, max_blocks)
        hits = self.block_pool.lookup(request.block_names[:max_blocks])
        self.block_pool.share(hits)
        if self.tier_loader is not None and len(hits) < max_blocks:  # evicted here: maybe in a spill tier
            hits = hits + self.tier_loader(request.block_names[len(hits) : max_blocks])
        request.block_ids = hits
        request.num_computed_tokens = request.num_cached_tokens = len(hits) * self.block_size
        request.num_named_blocks = len(hits)

    def name_computed_blocks(self, request: Request) -> None:
        """Name the request's blocks completed since the last call (call after its KV was computed)."""
        full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if not self.prefix_caching or full <= request.num_named_blocks:
            return
        request.block_names = block_hashes(request.all_token_ids, self.block_size, request.block_names, full)
        for i in range(request.num_named_blocks, full):
            self.block_pool.name(request.block_ids[i], request.block_names[i])
        request.num_named_blocks = full

    # -- helpers ------------------------------------------------------------------------------------------

    def _blocks_needed(self, request: Request, num_new: int) -> int:
        num_tokens = request.num_computed_tokens + num_new
        return max(0, -(-num_tokens // self.block_size) - len(request.block_ids))

    def _preempt(self, request: Request) -> None:
        self._free_blocks(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _free_blocks(self, request: Request) -> None:
        if request.block_ids:
            self.block_pool.free(request.block_ids)
            request.block_ids = []
        request.num_named_blocks = 0
