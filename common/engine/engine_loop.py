"""Runs an :class:`~common.engine.engine.LLMEngine` on a thread of its own, for servers.

The engine is single-threaded; a server has many handler threads. :class:`EngineLoop` owns the engine on
one thread and gives the others three verbs:

- :meth:`EngineLoop.call` runs a function on the engine thread between two steps and returns its result
  (add a request, abort, reserve or write KV, read stats): every engine access goes through it, so the
  engine never sees two threads.
- :meth:`EngineLoop.add_request` is ``call(engine.add_request)`` plus a :class:`RequestStream` that
  receives the request's outputs as the steps produce them.
- :meth:`EngineLoop.stop` ends the thread; every open stream then ends with an error, never silence.

Life cycle of the thread: run queued calls → if the engine has work, ``step()`` and route the outputs to
their streams → else sleep until a call arrives. A step that raises fails every open stream with that
error and the loop keeps serving (the error is logged); nothing waits forever.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from common.engine.counters import RequestTimings
from common.engine.request import FinishReason, RequestOutput

if TYPE_CHECKING:
    from common.engine.engine import LLMEngine

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.05  # an idle loop wakes this often to expire KV reservation leases
STREAM_LINGER_S = 0.1  # longest a stream interval holds a token back waiting for more


class StreamClosed(RuntimeError):
    """The stream ended without a finished output: the loop stopped or a step failed."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot taken after each step; reading it needs no lock."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_reserved: int = 0
    kv_blocks_cached: int = 0  # free blocks still holding a cached prefix (not counted in kv_blocks_used)
    num_prompt_tokens: int = 0  # cumulative counters: see common.engine.counters.EngineCounters
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    num_host_tier_hits: int = 0  # blocks brought back from the spill tiers (see common.engine.kv_tiers)
    num_shared_tier_hits: int = 0
    num_kv_tier_integrity_failures: int = 0  # shared-tier blocks that failed authentication (recomputed)


class RequestStream:
    """The outputs of one request, in order; ends after the output with ``finished`` (or ``prefilled``).

    Read it from a thread (:meth:`get`, :meth:`get_pending`, iteration) or from an asyncio event loop
    (:meth:`get_async`, :meth:`get_pending_async`), one reader at a time."""

    _END = object()

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None  # an async reader waiting

    def _put(self, out: RequestOutput, wakes: list | None = None) -> None:
        """Queue ``out``; an async reader waiting is woken now, or with the rest of ``wakes`` (a step's outputs:
        see :func:`_wake_all`)."""
        self._queue.put(out)
        self._wake(wakes)

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._queue.put(self._END)
        self._wake()

    def _wake(self, wakes: list | None = None) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and wakes is not None:
            wakes.append(waiter)
        elif waiter is not None:
            loop, future = waiter
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:  # that loop is closed: nobody reads any more
                pass

    def _item(self, item):
        if item is self._END:
            self._queue.put(self._END)  # every later get() fails the same way
            raise StreamClosed(f"request {self.request_id}: {self._error}") from self._error
        return item

    def get(self, timeout_s: float | None = None) -> RequestOutput:
        """The next output; raises ``queue.Empty`` after ``timeout_s``, :class:`StreamClosed` if the loop
        stopped or a step failed before the request finished."""
        return self._item(self._queue.get(timeout=timeout_s))

    async def get_async(self, timeout_s: float | None = None) -> RequestOutput:
        """:meth:`get` for a coroutine: waits without holding a thread."""
        return self._item(await self._next_async(timeout_s))

    async def _next_async(self, timeout_s: float | None):
        """The next queued item, waiting up to ``timeout_s`` (``queue.Empty`` after it)."""
        while True:
            try:
                return self._queue.get_nowait()
            except queue.Empty:
                pass
            loop = asyncio.get_running_loop()
            future = loop.create_future()
            self._waiter = (loop, future)
            if not self._queue.empty():  # it arrived between the two looks: _put may not have seen the waiter
                self._waiter = None
                continue
            try:  # not asyncio.wait_for: on Python 3.11 it can swallow a cancellation that meets the result
                async with asyncio.timeout(timeout_s):
                    await future
            except TimeoutError:
                self._waiter = None
                raise queue.Empty from None

    def get_pending(
        self, timeout_s: float | None = None, *, min_tokens: int = 1, linger_s: float = STREAM_LINGER_S
    ) -> RequestOutput:
        """The next output merged with every later one already queued (one output of several tokens): a reader
        that fell behind the steps catches up in one message, and a reader that keeps up gets each output as
        soon as it exists (nothing waits to be merged). Same errors as :meth:`get`.

        ``min_tokens`` > 1 (a stream interval): then also wait for later outputs until the merge holds that many
        tokens, the request ends, or ``linger_s`` has passed since the first output was taken, so a token is
        held back at most ``linger_s``; and merge no more than that (a reader that fell behind catches up in
        messages of ``min_tokens``, the interval's promise). Callers pass 1 for a request's first token, which
        never waits."""
        merge = _Merge(self.get(timeout_s), min_tokens, linger_s)
        while (wait := merge.wait_s()) is not None:
            try:
                item = self._queue.get_nowait() if wait == 0 else self._queue.get(timeout=wait)
            except queue.Empty:
                if wait == 0 and merge.linger():
                    continue
                break
            if item is self._END:
                self._queue.put(self._END)  # the next get raises it
                break
            merge.add(item)
        return merge.result()

    async def get_pending_async(
        self, timeout_s: float | None = None, *, min_tokens: int = 1, linger_s: float = STREAM_LINGER_S
    ) -> RequestOutput:
        """:meth:`get_pending` for a coroutine."""
        merge = _Merge(await self.get_async(timeout_s), min_tokens, linger_s)
        while (wait := merge.wait_s()) is not None:
            try:
                item = self._queue.get_nowait() if wait == 0 else await self._next_async(wait)
            except queue.Empty:
                if wait == 0 and merge.linger():
                    continue
                break
            if item is self._END:
                self._queue.put(self._END)  # the next get raises it
                break
            merge.add(item)
        return merge.result()

    def __iter__(self):
        while True:
            out = self.get()
            yield out
            if out.finished or out.prefilled:
                return


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _resolve_all(futures: list[asyncio.Future]) -> None:
    for future in futures:
        _resolve(future)


def _wake_all(wakes: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]) -> None:
    """Wake the async readers of one step's outputs with one hand-off per event loop: their tasks then run in
    the same turn of the loop (a DecodeMany stream sends their tokens as one message), and the engine thread
    writes to each loop's wake-up pipe once a step instead of once a request."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}
    for loop, future in wakes:
        by_loop.setdefault(loop, []).append(future)
    for loop, futures in by_loop.items():
        try:
            loop.call_soon_threadsafe(_resolve_all, futures)
        except RuntimeError:  # that loop is closed: nobody reads any more
            pass


class _Merge:
    """One :meth:`RequestStream.get_pending`: the outputs taken so far and when to stop taking more."""

    def __init__(self, first: RequestOutput, min_tokens: int, linger_s: float) -> None:
        self.merged = [first]
        self.tokens = len(first.new_token_ids)
        self.min_tokens = min_tokens
        self.linger_s = linger_s
        self.give_up: float | None = None

    def wait_s(self) -> float | None:
        """None: done; 0: take what is queued without waiting; else wait up to that long for the next one."""
        last = self.merged[-1]
        if last.finished or last.prefilled or (self.min_tokens > 1 and self.tokens >= self.min_tokens):
            return None
        if self.give_up is None:
            return 0
        wait = self.give_up - time.monotonic()
        return wait if wait > 0 else None

    def linger(self) -> bool:
        """Nothing queued: whether to wait (the interval's tokens are not there yet) rather than stop."""
        if self.tokens >= self.min_tokens:
            return False
        self.give_up = self.give_up or time.monotonic() + self.linger_s
        return True

    def add(self, item: RequestOutput) -> None:
        self.merged.append(item)
        self.tokens += len(item.new_token_ids)

    def result(self) -> RequestOutput:
        return self.merged[0] if len(self.merged) == 1 else merge_outputs(self.merged)


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: tokens, text and logprobs concatenated, the rest the last's."""
    logprobs = None
    if any(o.new_logprobs is not None for o in outs):
        logprobs = [lp for o in outs for lp in (o.new_logprobs or [None] * len(o.new_token_ids))]
    last = outs[-1]
    return RequestOutput(
        request_id=last.request_id,
        new_token_ids=[t for o in outs for t in o.new_token_ids],
        new_text="".join(o.new_text for o in outs),
        finished=last.finished,
        finish_reason=last.finish_reason,
        new_logprobs=logprobs,
        prefilled=last.prefilled,
        times=last.times,
    )


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        name: str = "engine-loop",
        on_request_finished: Callable[[RequestTimings], None] | None = None,
    ) -> None:
        """``on_request_finished`` gets each request's stage times when it leaves the engine (finished,
        aborted or prefilled); it runs on the engine thread between steps, so it must be quick."""
        self.engine = engine
        self.on_request_finished = on_request_finished
        self._calls: queue.Queue[tuple[Callable, Future]] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.stats = EngineStats(kv_blocks_total=engine.block_pool.num_blocks)

    # -- any thread -----------------------------------------------------------------------------------------

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the loop after the current step; open streams fail with StreamClosed. Idempotent."""
        self._stopping.set()
        self._calls.put((lambda engine: None, Future()))  # wake the thread
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def call(self, fn: Callable[[LLMEngine], T], timeout_s: float | None = None) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; its result or its exception."""
        return self.submit(fn).result(timeout_s)

    def submit(self, fn: Callable[[LLMEngine], T]) -> Future:
        future: Future = Future()
        if self._stopping.is_set():
            future.set_exception(StreamClosed("the engine loop is stopped"))
            return future
        self._calls.put((fn, future))
        return future

    def add_request(self, *args, **kwargs) -> RequestStream:
        """``engine.add_request(*args, **kwargs)`` on the engine thread, with a stream of its outputs.

        Raises what ``add_request`` raises (ValueError on bad input) in the caller's thread.
        """

        return self.open_stream(lambda engine: engine.add_request(*args, **kwargs))

    def open_stream(self, fn: Callable[[LLMEngine], str]) -> RequestStream:
        """Run ``fn`` (which adds or admits a request and returns its id) and stream that request's outputs."""

        def run(engine: LLMEngine) -> RequestStream:
            request_id = fn(engine)
            stream = self._streams[request_id] = RequestStream(request_id)
            return stream

        return self.call(run)

    def abort(self, request_id: str) -> bool:
        """Abort a request (or release a KV reservation); its stream ends with an aborted output."""

        def abort(engine: LLMEngine) -> bool:
            done = engine.abort(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream._put(RequestOutput(request_id, [], "", True, FinishReason.ABORT))
            return done

        return self.call(abort)

    # -- the engine thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        if engine.device.type == "cuda" and engine.device.index is not None:
            import torch  # (CUDA only: a CPU worker's loop imports nothing more)

            # its kernels, events and current streams on the engine's GPU, not on cuda:0 (a worker on cuda:1)
            torch.cuda.set_device(engine.device)
        while not self._stopping.is_set():
            self._run_calls(block=not engine.has_unfinished_requests())  # idle: wait up to IDLE_WAIT_S
            if self._stopping.is_set():
                break
            if not engine.has_unfinished_requests():
                if engine.reservations.expire():  # leases end while idle too
                    self._snapshot()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 - a broken step must end streams, not the server
                log.exception("engine step failed; failing %d open streams", len(self._streams))
                for rid, stream in list(self._streams.items()):
                    engine.abort(rid)
                    stream._fail(exc)
                self._streams.clear()
                continue
            self._route(outputs)
            self._snapshot()
        self._shutdown()

    def _run_calls(self, *, block: bool) -> None:
        try:
            item = self._calls.get(timeout=IDLE_WAIT_S) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
        self._snapshot()

    def _route(self, outputs: list[RequestOutput]) -> None:
        wakes: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream._put(out, wakes)
            if out.finished or out.prefilled:
                del self._streams[out.request_id]
        if wakes:
            _wake_all(wakes)

    def _snapshot(self) -> None:
        e = self.engine
        for timings in e.drain_timings():
            if self.on_request_finished is not None:
                try:
                    self.on_request_finished(timings)
                except Exception:  # noqa: BLE001 - metrics must never stop the engine
                    log.exception("on_request_finished failed")
        c = e.counters
        self.stats = EngineStats(
            num_requests_running=e.num_requests_running,
            num_requests_waiting=e.num_requests_waiting,
            kv_blocks_used=e.block_pool.num_live_blocks,
            kv_blocks_total=e.block_pool.num_blocks,
            kv_blocks_reserved=e.reservations.num_reserved_blocks,
            kv_blocks_cached=e.block_pool.num_cached_blocks,
            num_prompt_tokens=c.num_prompt_tokens,
            num_generation_tokens=c.num_generation_tokens,
            num_preemptions=c.num_preemptions,
            num_prefix_cache_queries=c.num_prefix_cache_queries,
            num_prefix_cache_hits=c.num_prefix_cache_hits,
            num_host_tier_hits=e.kv_tiers.num_host_hits if e.kv_tiers else 0,
            num_shared_tier_hits=e.kv_tiers.num_shared_hits if e.kv_tiers else 0,
            num_kv_tier_integrity_failures=e.kv_tiers.num_integrity_failures if e.kv_tiers else 0,
        )

    def _shutdown(self) -> None:
        closed = StreamClosed("the engine loop stopped")
        for rid, stream in list(self._streams.items()):
            self.engine.abort(rid)
            stream._fail(closed)
        self._streams.clear()
        while True:  # calls that arrived too late
            try:
                _fn, future = self._calls.get_nowait()
            except queue.Empty:
                break
            if future.set_running_or_notify_cancel():
                future.set_exception(closed)
