"""``pdserve.v1.GenerateService``: the router's public API.

Life cycle of a request at the router (every stage has a deadline; it ends in a result or an error):

1. validate and tokenize (INVALID_ARGUMENT naming the bad value), then charge the caller's rate limits
   (:mod:`services.router.rate_limits`; RESOURCE_EXHAUSTED with a retry hint when over one);
2. pick a decode worker and reserve KV blocks there under a lease (RESOURCE_EXHAUSTED → the next one);
3. pick a prefill worker and ``Prefill`` with the decode worker as KV target: it streams the KV there and
   answers with the first token, which goes to the client at once; meanwhile the decode worker's DecodeMany
   stream stays open, whose keepalive pings notice it gone (the Prefill is then cancelled);
4. ``Decode`` on the decode worker; relay its stream to the client;
5. a hand-off that fails before any token reached the client (a worker died, a corrupt or late KV transfer)
   is retried once on another worker pair (without the worker that failed: the decode worker when it no longer
   answers, else the prefill worker), with both sides' blocks freed; otherwise the client gets the
   failing status with a message that says what failed where.

The request's record in Redis follows it (status, workers, tokens emitted) and expires after it finishes;
a Redis outage never fails a request.

Every stream is a task on the router's event loop (``build_server(use_asyncio=True)``): the calls to the
workers are ``grpc.aio`` calls, Redis and other blocking work runs on the loop's thread pool
(``asyncio.to_thread``), and a client that goes away cancels the task, which cancels its worker calls and frees
the decode worker's blocks. The HTTP front drives the same generator from its threads
(:class:`services.router.http_call.BlockingStream`).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import grpc

from common.engine.prefix_cache import block_hashes
from common.kv_transfer.wire import KV_UNDELIVERED_KEY, MAX_REQUEST_ID_BYTES
from common.metrics.router import RequestTimer, RouterMetrics
from common.obs import Tracing, call_scope, trace_id_of
from common.rpc import convert
from common.rpc.server import channel
from common.rpc.tls import TlsFiles
from common.security.auth import principal_of
from common.state.prefix_index import PrefixIndex
from common.state.records import RequestStore, SessionRecord, SessionStore
from pdserve.v1 import generate_pb2, generate_pb2_grpc, types_pb2, worker_pb2, worker_pb2_grpc
from services.router.config import RouterConfig
from services.router.decode_mux import DecodeMux
from services.router.decode_stream import DecodeStreamMixin
from services.router.errors import HandoffError, worker_status
from services.router.policy import Choice, LoadTracker, pick_decode, pick_prefill, pick_prefill_cached
from services.router.rate_limits import RATE_LIMIT_KEY, Charge, RateLimited, RouterRateLimits
from services.router.registry_view import RegistryView
from services.router.request_records import RecordsMixin

log = logging.getLogger(__name__)
RETRY_AFTER_MS_KEY = "retry-after-ms"  # trailing metadata of a RESOURCE_EXHAUSTED answer: when to retry

# Failures of a hand-off that another worker pair may not have.
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED,
}  # fmt: skip


TOKENIZE_ON_LOOP_CHARS = 4096  # longer prompt texts are tokenized on the thread pool, not on the event loop


@dataclass
class ModelInfo:
    """What the router knows of the model without loading its weights."""

    tokenizer: object
    generation_config: object
    vocab_size: int
    max_model_len: int


class _DecodeLost(Exception):
    """The decode worker of a hand-off failed or went silent while its KV was on the way (its DecodeMany stream
    failed with ``error``)."""

    def __init__(self, error: grpc.RpcError) -> None:
        super().__init__(str(error))
        self.error = error


class _Outcome:
    """What a served attempt leaves for its caller: the decode worker that finished the request."""

    decode_id = ""


class RouterServicer(DecodeStreamMixin, RecordsMixin, generate_pb2_grpc.GenerateServiceServicer):
    def __init__(
        self,
        model: ModelInfo,
        view: RegistryView,
        records: RequestStore,
        config: RouterConfig,
        metrics: RouterMetrics,
        tracing: Tracing,
        sessions: SessionStore,
        prefix_index: PrefixIndex | None = None,
        worker_tls: TlsFiles | None = None,
        rate_limits: RouterRateLimits | None = None,
    ) -> None:
        """``worker_tls``: the channels to the workers use mutual TLS with these files (None: plaintext).
        ``rate_limits``: the callers' budgets, charged before any worker is touched (None: no limit).
        Its methods run on one event loop (the gRPC server's)."""
        self.model = model
        self.view = view
        self.records = records
        self.sessions = sessions
        self.prefix_index = prefix_index
        self.worker_tls = worker_tls
        self.rate_limits = rate_limits
        self.config = config
        self.metrics = metrics
        self.tracing = tracing
        self.tracker = LoadTracker(config.worker_cooldown_s, pair_cooldown_s=config.pair_cooldown_s)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._muxes: dict[str, DecodeMux] = {}  # decode worker address -> its DecodeMany stream
        self._streams: asyncio.Semaphore | None = None  # --max-streams gRPC streams at once (made on the loop)
        self._background: set[asyncio.Task] = set()

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(address, self.worker_tls, use_asyncio=True)
        return ch

    def _decode_call(self, address: str, request: worker_pb2.DecodeRequest, deadline_s: float, metadata):
        """A Decode call of ``request`` on the worker at ``address`` until ``deadline_s`` (monotonic): on that
        worker's DecodeMany stream (``--decode-mux``, the default) or a call of its own."""
        timeout = max(0.1, deadline_s - time.monotonic())
        if not self.config.decode_mux:
            stub = worker_pb2_grpc.DecodeServiceStub(self._channel(address))
            return stub.Decode(request, timeout=timeout, metadata=metadata)
        return self._mux(address).decode(request, timeout=timeout, metadata=metadata)

    def _mux(self, address: str) -> DecodeMux:
        mux = self._muxes.get(address)
        if mux is None:
            mux = self._muxes[address] = DecodeMux(worker_pb2_grpc.DecodeServiceStub(self._channel(address)), address)
        return mux

    async def _prefill_watching(self, call, decode_address: str):
        """Await the Prefill ``call`` while watching the decode worker its KV goes to (its DecodeMany stream kept
        open, :meth:`DecodeMux.watch`): a decode worker that fails or goes silent meanwhile raises
        :class:`_DecodeLost` after cancelling the call (the prefill worker then aborts the transfer), instead of
        the hand-off waiting out the KV lease. Without ``--decode-mux`` the call is awaited alone."""
        ended = self._mux(decode_address).watch() if self.config.decode_mux else None
        if ended is None or (ended.done() and ended.result() is None):
            return await call
        prefill = asyncio.ensure_future(call)
        try:
            await asyncio.wait((prefill, ended), return_when=asyncio.FIRST_COMPLETED)
            if not prefill.done() and ended.result() is not None:
                raise _DecodeLost(ended.result())  # (the call is cancelled below)
            return await prefill
        except BaseException:  # the decode worker lost, or a client that left cancelled this task
            prefill.cancel()
            call.cancel()
            raise

    def _spawn(self, coroutine) -> None:
        """Run ``coroutine`` on the loop without waiting for it (cleanup of a stream that is going away)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- validation ---------------------------------------------------------------------------------------

    def _prompt_ids(self, request) -> list[int]:
        """The prompt as token ids; ValueError naming what is wrong with it."""
        kind = request.WhichOneof("prompt")
        if kind == "text":
            ids = list(self.model.tokenizer(request.text)["input_ids"]) if request.text else []
        elif kind == "token_ids":
            ids = list(request.token_ids.ids)
        else:
            ids = []
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.model.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's context is {self.model.max_model_len} tokens")
        bad = next((t for t in ids if t >= self.model.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.model.vocab_size})")
        return ids

    # -- Generate -----------------------------------------------------------------------------------------

    async def Generate(self, request, context) -> None:
        """The gRPC API: at most ``--max-streams`` at once; later calls wait for one to end. A coroutine that
        writes, so that a client that leaves (the call's task cancelled) closes the stream in this task."""
        if self._streams is None:
            self._streams = asyncio.Semaphore(self.config.max_streams)
        async with self._streams, aclosing(self.stream(request, context)) as messages:
            async for message in messages:
                await context.write(message)

    async def stream(self, request, context) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """One request's messages; ``context``: the gRPC call's, or the HTTP front's
        :class:`services.router.http_call.HttpCallContext`."""
        rid = request.request_id or uuid.uuid4().hex
        with call_scope(self.tracing, "router.Generate", rid, context) as span:
            async with aclosing(self._generate(rid, request, context, trace_id_of(span))) as messages:
                async for message in messages:
                    yield message

    async def _generate(self, rid: str, request, context, trace_id: str):
        try:
            _check_request_id(request.request_id)
            if len(request.text) > TOKENIZE_ON_LOOP_CHARS:
                prompt_ids = await asyncio.to_thread(self._prompt_ids, request)
            else:
                prompt_ids = self._prompt_ids(request)
            sampling = convert.sampling_from_proto(request.sampling, self.model.generation_config,
                                                   self.config.default_max_tokens)
            sampling.validate(self.model.vocab_size)
        except ValueError as exc:
            self.metrics.start_request(0).fail(grpc.StatusCode.INVALID_ARGUMENT.name)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        charge = await self._admit(context, prompt_ids, sampling)
        timer = self.metrics.start_request(len(prompt_ids))
        try:
            remaining = context.time_remaining()  # None when the client set no deadline
            timeout_s = min(self.config.request_timeout_s if remaining is None else remaining,
                            self.config.request_timeout_s)  # 0 is a deadline already past, not "none"
            deadline_s = time.monotonic() + timeout_s
            await self._record_create(rid, len(prompt_ids), trace_id)
            session = await self._session_load(request.session_id) if request.session_id else None
            excluded: set[str] = set()
            full: set[str] = set()  # workers that answered RESOURCE_EXHAUSTED
            last_error: HandoffError | None = None
            retries_left = self.config.max_retries
            for attempt in itertools.count(1):
                outcome = _Outcome()
                try:
                    async with aclosing(self._serve(rid, attempt_id(rid, attempt), prompt_ids, request.sampling,
                                                    deadline_s, excluded, context, timer, outcome, session,
                                                    frozenset(full))) as messages:  # fmt: skip
                        async for message in messages:
                            yield message
                    if request.session_id:
                        await self._session_save(request.session_id, prompt_ids + timer.token_ids,
                                                 outcome.decode_id)
                    return
                except HandoffError as exc:
                    if not exc.worker_id and last_error is not None and last_error.other_id not in ("", *excluded):
                        # no stand-in for the worker the retry avoided: avoid the other one of the pair instead
                        log.info("request %s: no worker other than %s; the retry avoids %s instead", rid,
                                 last_error.worker_id, last_error.other_id)  # fmt: skip
                        excluded.discard(last_error.worker_id)
                        excluded.add(last_error.other_id)
                        last_error = HandoffError(last_error.code, str(last_error), last_error.other_id)
                        continue
                    if not exc.worker_id and last_error is not None:  # no other pair: report the real failure
                        last_error = HandoffError(last_error.code,
                                                  f"{last_error} (no other worker pair to retry on)",
                                                  last_error.worker_id)  # fmt: skip
                        break
                    last_error = exc
                    excluded.add(exc.worker_id)
                    if exc.worker_id and (exc.code is grpc.StatusCode.UNAVAILABLE or (
                            exc.code is grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() < deadline_s)):
                        self.tracker.suspect(exc.worker_id)  # unreachable or hung: other requests avoid it too
                    log.warning("request %s attempt %d failed: %s", rid, attempt, exc)
                    if exc.code not in _RETRYABLE or time.monotonic() >= deadline_s:
                        break
                    if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:  # a full worker is no failure: try the
                        full.add(exc.worker_id)  # others (and decode-side prefill when every prefill is full)
                    else:  # anything else costs a retry
                        if retries_left == 0:
                            break
                        retries_left -= 1
                    self.metrics.retries.labels(exc.code.name).inc()
            message = str(last_error)
            if last_error.code is grpc.StatusCode.RESOURCE_EXHAUSTED:  # saturated: say when to come back
                retry_ms = round(self.config.retry_after_s * 1000)
                context.set_trailing_metadata(((RETRY_AFTER_MS_KEY, str(retry_ms)),))
                message = f"cluster saturated, retry after {retry_ms} ms: {message}"
            await self._record_finish(rid, "failed", timer, error=message)
            timer.fail(last_error.code.name)
            await context.abort(last_error.code, message)
        finally:
            timer.fail(grpc.StatusCode.CANCELLED.name)  # the client went away (no-op once the request ended)
            if charge is not None:  # give back the tokens it did not generate
                await asyncio.shield(asyncio.to_thread(self.rate_limits.release, charge, len(timer.token_ids)))

    async def _admit(self, context, prompt_ids: list[int], sampling) -> Charge | None:
        """Charge the caller's rate limits (None: no limit set). Over one: RESOURCE_EXHAUSTED naming it, with
        trailing metadata ``rate-limit`` (requests|tokens) and ``retry-after-ms`` (absent when no wait helps)."""
        if self.rate_limits is None:
            return None
        max_completion = min(sampling.max_new_tokens, self.model.max_model_len - len(prompt_ids))
        try:
            return await asyncio.to_thread(self.rate_limits.admit, principal_of(context), len(prompt_ids),
                                           max_completion)  # fmt: skip
        except RateLimited as exc:
            self.metrics.rate_limited.labels(exc.limit).inc()
            self.metrics.start_request(0).fail(grpc.StatusCode.RESOURCE_EXHAUSTED.name)
            hint = () if exc.retry_after_ms is None else ((RETRY_AFTER_MS_KEY, str(exc.retry_after_ms)),)
            context.set_trailing_metadata(((RATE_LIMIT_KEY, exc.limit), *hint))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))

    async def _serve(self, rid, wid, prompt_ids, sampling_msg, deadline_s, excluded, context, timer: RequestTimer,
                     outcome: _Outcome, session: SessionRecord | None = None, full: frozenset[str] = frozenset()):
        """One attempt on one worker pair (or one decode worker prefilling locally); sets ``outcome.decode_id``.
        ``wid``: the attempt's id at the workers (:func:`attempt_id`; ``rid`` is the client's and the records').
        ``full``: workers that answered RESOURCE_EXHAUSTED. Raises HandoffError before the first token reaches
        the client; after that, a decode worker that fails hands the request to another one (:meth:`_relay`)."""
        workers = self.view.workers()
        if not pick_decode(workers, self.tracker, excluded) or not pick_prefill(workers, self.tracker, excluded):
            await asyncio.to_thread(self.view.refresh)  # the view may predate a worker that just registered
            workers = self.view.workers()
        decode, local_reason = self._sticky_decode(session, workers, excluded), ""
        if decode is not None:
            local_reason = f"{decode.reason}: prefilled there from its cached KV"
        else:
            decode = pick_decode(workers, self.tracker, excluded, via_prefill=True)
        if decode is None:
            raise HandoffError(grpc.StatusCode.UNAVAILABLE, "no live decode worker", "")
        prefill = await self._pick_prefill(prompt_ids, workers, excluded, decode.worker.id)
        threshold = self.config.local_prefill_threshold
        if not local_reason and len(prompt_ids) < threshold:
            local_reason = f"{decode.reason}; {len(prompt_ids)} prompt tokens < --local-prefill-threshold {threshold}"
        prefills = [w.id for w in workers if w.role == "prefill"]
        if not local_reason and prefill is None and prefills and set(prefills) <= full:
            local_reason = f"{decode.reason}; every prefill worker is full: prefilled on decode"
        if local_reason:
            async with aclosing(self._serve_local(rid, wid, prompt_ids, sampling_msg, deadline_s, context, timer,
                                                  decode.worker, local_reason, outcome)) as messages:  # fmt: skip
                async for message in messages:
                    yield message
            return
        if prefill is None:
            raise HandoffError(grpc.StatusCode.UNAVAILABLE, "no live prefill worker", "")
        d, p = decode.worker, prefill.worker
        decode_stub = worker_pb2_grpc.DecodeServiceStub(self._channel(d.address))
        prefill_stub = worker_pb2_grpc.PrefillServiceStub(self._channel(p.address))
        self.tracker.acquire(d.id)
        self.tracker.acquire(p.id)
        prefill_released = False
        metadata = self.tracing.outgoing_metadata()
        try:
            # 2. reserve on decode (the prefill must answer within the lease: after it the KV has no home)
            lease_ends_s = time.monotonic() + self.config.kv_lease_s
            try:
                reserved = await decode_stub.ReserveKv(
                    worker_pb2.ReserveKvRequest(request_id=wid, num_tokens=len(prompt_ids),
                                                lease_seconds=self.config.kv_lease_s),
                    timeout=min(10.0, max(0.1, deadline_s - time.monotonic())), metadata=metadata,
                )
            except grpc.RpcError as exc:
                raise HandoffError(worker_status(exc), f"decode worker {d.id} could not reserve KV: {exc.details()}",
                                   d.id)  # fmt: skip
            except asyncio.CancelledError:  # the client went away: the reservation may have been made
                self._release_soon(decode_stub, wid)
                raise
            # 3. prefill, KV to decode (a client that goes away cancels it: the prefill worker aborts it)
            try:
                await self._record_update(rid, status="prefilling", decode_worker_id=d.id, prefill_worker_id=p.id,
                                          route_reason=f"{decode.reason}; {prefill.reason}", routed_at=time.time())
                first = await self._prefill_watching(prefill_stub.Prefill(
                    worker_pb2.PrefillRequest(request_id=wid, prompt_token_ids=prompt_ids, sampling=sampling_msg,
                                              kv_target_address=d.address, decode_identity=reserved.identity,
                                              kv_shm_address=reserved.kv_shm_address, kv_target_host=reserved.host,
                                              kv_nixl_metadata=reserved.kv_nixl_metadata,
                                              kv_block_ids=reserved.kv_block_ids),
                    timeout=max(0.1, min(deadline_s - time.monotonic(), lease_ends_s - time.monotonic())),
                    metadata=metadata,
                ), d.address)  # fmt: skip
            except _DecodeLost as exc:  # the KV's destination is gone: the retry avoids it, not the prefill worker
                self._release_soon(decode_stub, wid)  # (the retry loop makes it a suspect: UNAVAILABLE)
                raise HandoffError(grpc.StatusCode.UNAVAILABLE, f"prefill on {p.id} (KV to {d.id}) failed: the decode "
                                   f"worker stopped answering during the hand-off: {exc.error.details()}", d.id)
            except asyncio.CancelledError:  # the client cancelled or disconnected (the call is cancelled too)
                self._release_soon(decode_stub, wid)
                self._spawn(self._record_finish(rid, "aborted", timer, error="cancelled by the client"))
                timer.fail(grpc.StatusCode.CANCELLED.name)
                raise
            except grpc.RpcError as exc:
                decode_answers = await self._release(decode_stub, wid)
                if not decode_answers:  # a hung or dead decode worker, while its registry entry has not lapsed
                    self.tracker.suspect(d.id)
                details = exc.details()
                client_deadline = time.monotonic() >= deadline_s - 0.05
                if decode_answers and _kv_undelivered(exc):  # both answer the router, not each other
                    self.tracker.suspect_pair(p.id, d.id)  # the next requests take another pair while there is one
                    log.info("request %s: %s and %s paired last for %g s (--pair-cooldown-s): %s", rid, p.id, d.id,
                             self.tracker.pair_cooldown_s, exc.code().name)  # fmt: skip
                if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and not client_deadline:
                    details = (f"no first token before the KV reservation's lease ended "
                               f"(--kv-lease-s {self.config.kv_lease_s:g}): the prefill or its KV transfer stalled")
                # The retry avoids the decode worker when it does not answer either (the transfer failed on its
                # side: the prefill worker may well be the only one), else this prefill worker (a corrupt or late
                # transfer starts at the sender as often as anywhere; the decode worker may be the only one), or
                # the decode worker when this prefill worker is the only one (a pair that cannot reach each other).
                if exc.code() is grpc.StatusCode.CANCELLED:
                    details = f"the prefill worker cancelled the call (its server stopping): {details}"
                raise HandoffError(worker_status(exc), f"prefill on {p.id} (KV to {d.id}) failed: {details}",
                                   p.id if decode_answers else d.id, d.id if decode_answers else "")  # fmt: skip
            finally:
                self.tracker.release(p.id)
                prefill_released = True
            emitted = len(first.token_ids)
            first_message = generate_pb2.GenerateResponse(
                request_id=rid, token_ids=first.token_ids, text=first.text, logprobs=first.logprobs,
                prefill_worker_id=p.id, decode_worker_id=d.id,
            )  # fmt: skip
            stages = dict(queued_at=first.queued_at, prefill_started_at=first.prefill_started_at,
                          prefill_finished_at=first.first_token_at, kv_transfer_started_at=first.kv_transfer_started_at,
                          kv_transfer_finished_at=first.kv_transfer_finished_at)
            if first.finish_reason != types_pb2.FINISH_REASON_UNSPECIFIED:
                await self._release(decode_stub, wid)
                timer.on_tokens(first.token_ids)
                yield first_message
                yield self._last(rid, first.finish_reason, len(prompt_ids), emitted, p.id, d.id)
                await self._record_update(rid, first_token_at=timer.first_token_at, **stages)
                await self._record_finish(rid, "finished", timer, emitted, first.finish_reason)
                outcome.decode_id = d.id
                return
            # 4. decode and relay. Decode starts before the first token goes out: the reservation never waits on
            # the client, so a router that dies now leaves no KV behind for longer than the decode worker's
            # admission window.
            call = self._decode_call(d.address, worker_pb2.DecodeRequest(
                request_id=wid, prompt_token_ids=prompt_ids, output_token_ids=first.token_ids, sampling=sampling_msg,
                generator_state=first.generator_state), deadline_s, metadata)
            timer.on_tokens(first.token_ids)
            try:
                await self._record_update(rid, status="decoding", num_tokens_emitted=emitted,
                                          decode_started_at=time.time(), first_token_at=timer.first_token_at,
                                          **stages)  # fmt: skip
                yield first_message
            except (GeneratorExit, asyncio.CancelledError):  # the client left: stop decoding (the cancelled
                call.cancel()  # Decode may never have reached the worker: free the reservation too)
                self._release_soon(decode_stub, wid)
                raise
            async with aclosing(self._relay(rid, wid, call, decode_stub, d.id, p.id, prompt_ids, emitted, timer,
                                            context, sampling_msg, deadline_s)) as messages:  # fmt: skip
                async for message in messages:
                    yield message
            outcome.decode_id = d.id
        finally:
            self.tracker.release(d.id)
            if not prefill_released:
                self.tracker.release(p.id)

    async def _pick_prefill(self, prompt_ids: list[int], workers, excluded: set[str],
                            decode_id: str) -> Choice | None:  # fmt: skip
        """Cache-aware when the prefix index answers and there is a choice; else the load-only policy. ``decode_id``:
        where the KV goes (a suspect pair with it goes last)."""
        candidates = [w for w in workers if w.role == "prefill" and w.id not in excluded]
        if len(candidates) < 2 or self.prefix_index is None:
            return pick_prefill(workers, self.tracker, excluded, decode_id)
        bs = candidates[0].block_size
        names = block_hashes(prompt_ids, bs, max_blocks=(len(prompt_ids) - 1) // bs)
        try:
            blocks = await asyncio.to_thread(self.prefix_index.overlap, [w.id for w in candidates], names)
        except Exception as exc:  # noqa: BLE001 - Redis away: route on load alone
            log.debug("prefix index unavailable: %s", exc)
            return pick_prefill(workers, self.tracker, excluded, decode_id)
        cached = {w: n * bs for w, n in blocks.items()}
        return pick_prefill_cached(workers, self.tracker, excluded, cached, len(prompt_ids),
                                   self.config.prefix_load_penalty_tokens, decode_id)


def _kv_undelivered(exc: grpc.RpcError) -> bool:
    """The prefill worker answered that its KV did not reach the decode worker (not a prefill worker the router
    could not reach, or one that failed otherwise)."""
    try:
        return any(key == KV_UNDELIVERED_KEY for key, _ in exc.trailing_metadata() or ())
    except Exception:  # noqa: BLE001 - an error without metadata
        return False


def attempt_id(rid: str, attempt: int) -> str:
    """The id an attempt's calls give the workers: ``rid`` for the first, ``rid~N`` for the N-th (hashed when that
    would not fit the KV wire format). A retry may reach the same worker as a failed attempt that it is still
    cancelling (a decode worker lost mid-hand-off: the prefill worker is kept), or whose reservation it still holds:
    under the same id the old one's cancellation ended the new one, or their KV senders mixed."""
    if attempt == 1:
        return rid
    wid = f"{rid}~{attempt}"
    if len(wid.encode()) > MAX_REQUEST_ID_BYTES:
        wid = f"{hashlib.sha256(rid.encode()).hexdigest()}~{attempt}"
    return wid


def _check_request_id(request_id: str) -> None:
    """ValueError naming a client-chosen request id longer than the KV wire format carries (it names the KV)."""
    size = len(request_id.encode())
    if size > MAX_REQUEST_ID_BYTES:
        raise ValueError(f"request_id must be at most {MAX_REQUEST_ID_BYTES} UTF-8 bytes, got {size}: "
                         f"{request_id[:32]!r}...")
