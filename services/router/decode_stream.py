"""The decode half of a request at the router: relay a decode worker's stream to the client, prefill on the
decode worker itself (sessions, conditional disaggregation), and move a request to another decode worker when
its own fails mid-stream (migration). Mixed into :class:`services.router.servicer.RouterServicer`, whose
attributes (``config``, ``metrics``, ``tracker``, ``view``, ``tracing``, ``_channel``) it uses."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing

import grpc

from common.metrics.router import RequestTimer
from common.state.records import SessionRecord
from pdserve.v1 import generate_pb2, types_pb2, worker_pb2, worker_pb2_grpc
from services.router.errors import HandoffError
from services.router.policy import Choice, pick_decode

log = logging.getLogger(__name__)

# Mid-stream failures of a decode worker that another one can take over (it died or broke, not the request).
MIGRATABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.ABORTED, grpc.StatusCode.DATA_LOSS}  # fmt: skip


class DecodeStreamMixin:
    async def _serve_local(self, rid, wid, prompt_ids, sampling_msg, deadline_s, context, timer, d, reason: str,
                           outcome):
        """Conditional disaggregation: the decode worker prefills the prompt itself (``prefill_here``)."""
        decode_stub = worker_pb2_grpc.DecodeServiceStub(self._channel(d.address))
        self.tracker.acquire(d.id)
        try:
            now = time.time()
            await self._record_update(rid, status="decoding", decode_worker_id=d.id, route_reason=reason,
                                      routed_at=now, decode_started_at=now)
            call = self._decode_call(d.address, worker_pb2.DecodeRequest(
                request_id=wid, prompt_token_ids=prompt_ids, sampling=sampling_msg, prefill_here=True),
                deadline_s, self.tracing.outgoing_metadata())  # fmt: skip
            async with aclosing(self._relay(rid, wid, call, decode_stub, d.id, "", prompt_ids, 0, timer, context,
                                            sampling_msg, deadline_s)) as messages:  # fmt: skip
                async for message in messages:
                    yield message
            outcome.decode_id = d.id
        finally:
            self.tracker.release(d.id)

    async def _relay(self, rid, wid, call, decode_stub, d_id: str, p_id: str, prompt_ids: list[int], emitted: int,
                     timer: RequestTimer, context, sampling_msg, deadline_s: float):
        """Relay a Decode stream to the client, then the last message. A failure before any token reached
        the client (a local prefill) raises HandoffError. After that, a decode worker that fails (it died)
        hands the request to another one, at most ``--max-migrations`` times: the new one prefills the prompt
        and the tokens already sent, then continues, so the client sees one stream; else the call ends. A client
        that leaves (the stream closed or its task cancelled) cancels the Decode call. ``rid``: the client's id (its
        messages, the record); ``wid``: the attempt's at the workers."""
        finish = types_pb2.FINISH_REASON_UNSPECIFIED
        sent, migrations, failed, held = emitted > 0, 0, set(), []
        try:
            while True:
                try:
                    async for piece in call:
                        emitted += len(piece.token_ids)
                        finish = piece.finish_reason
                        if piece.token_ids or piece.text:
                            timer.on_tokens(piece.token_ids)
                            message = generate_pb2.GenerateResponse(request_id=rid, token_ids=piece.token_ids,
                                                                    text=piece.text, logprobs=piece.logprobs)
                            if not sent:  # the first message names the workers
                                message.prefill_worker_id, message.decode_worker_id, sent = p_id, d_id, True
                                await self._record_update(rid, first_token_at=timer.first_token_at)
                            yield message
                    break
                except grpc.RpcError as exc:
                    await self._release(decode_stub, wid)  # the call may have ended before the worker admitted it
                    if not sent and exc.code() is not grpc.StatusCode.CANCELLED:
                        raise HandoffError(exc.code(), f"decode worker {d_id} could not serve it: {exc.details()}",
                                           d_id)  # fmt: skip
                    failed.add(d_id)
                    if exc.code() is grpc.StatusCode.UNAVAILABLE:
                        self.tracker.suspect(d_id)  # it died or hangs: new requests avoid it too
                    moved = None
                    if exc.code() in MIGRATABLE and migrations < self.config.max_migrations:
                        moved = self._migrate(wid, prompt_ids, timer.token_ids, sampling_msg, deadline_s, failed)
                    if moved is None:
                        status = "aborted" if exc.code() is grpc.StatusCode.CANCELLED else "failed"
                        await self._record_finish(rid, status, timer, emitted, error=exc.details() or "")
                        timer.fail(exc.code().name)
                        await context.abort(exc.code(), f"decode worker {d_id} failed mid-stream: {exc.details()}")
                    call, decode_stub, d_id = moved
                    held.append(d_id)
                    migrations += 1
                    self.metrics.migrations.inc()
                    log.warning("request %s moved to decode worker %s after %d tokens: %s", rid, d_id,
                                len(timer.token_ids), exc.details())
                    await self._record_update(rid, decode_worker_id=d_id, num_migrations=migrations)
        except (GeneratorExit, asyncio.CancelledError):  # the client left: stop decoding; the cancelled Decode
            call.cancel()  # may never have reached the worker: free the reservation too
            self._release_soon(decode_stub, wid)
            raise
        finally:
            for worker_id in held:
                self.tracker.release(worker_id)
        last = self._last(rid, finish, len(prompt_ids), emitted, p_id, d_id)
        last.migrations = migrations
        yield last
        await self._record_finish(rid, "finished", timer, emitted, finish)

    def _migrate(self, wid, prompt_ids, sent_ids, sampling_msg, deadline_s, failed: set[str]):
        """Continue a request on another decode worker: (call, stub, worker id), or None if none is left."""
        choice = pick_decode(self.view.workers(), self.tracker, failed)
        if choice is None:
            return None
        sampling = types_pb2.SamplingParams()
        sampling.CopyFrom(sampling_msg)
        sampling.max_tokens = (sampling_msg.max_tokens or self.config.default_max_tokens) - len(sent_ids)
        stub = worker_pb2_grpc.DecodeServiceStub(self._channel(choice.worker.address))
        self.tracker.acquire(choice.worker.id)
        call = self._decode_call(choice.worker.address, worker_pb2.DecodeRequest(
            request_id=wid, prompt_token_ids=list(prompt_ids) + list(sent_ids), sampling=sampling, prefill_here=True),
            deadline_s, self.tracing.outgoing_metadata())  # fmt: skip
        return call, stub, choice.worker.id

    def _sticky_decode(self, session: SessionRecord | None, workers, excluded: set[str]) -> Choice | None:
        """The decode worker that served the session's last turn, if it is live and not excluded."""
        if session is None or not session.decode_worker_id or session.decode_worker_id in excluded:
            return None
        worker = next((w for w in workers if w.role == "decode" and w.id == session.decode_worker_id), None)
        if worker is None:
            return None
        return Choice(worker, f"session {session.session_id}: its last turn's KV is on {worker.id}")

    @staticmethod
    def _last(rid, finish, num_prompt, num_emitted, prefill_id, decode_id) -> generate_pb2.GenerateResponse:
        return generate_pb2.GenerateResponse(
            request_id=rid, finish_reason=finish,
            usage=types_pb2.Usage(prompt_tokens=num_prompt, completion_tokens=num_emitted),
            prefill_worker_id=prefill_id, decode_worker_id=decode_id,
        )  # fmt: skip

    def _release_soon(self, decode_stub, rid: str) -> None:
        """:meth:`_release` without waiting for it (from a stream that is going away). A Decode call cancelled
        before the worker started it leaves the reservation to its admission window (10 s) if this fails."""
        self._spawn(self._release(decode_stub, rid))

    async def _release(self, decode_stub, rid: str) -> bool:
        """Free a request's reservation (or stop its decoding) on a decode worker; False if it did not answer."""
        try:
            await decode_stub.ReleaseKv(worker_pb2.ReleaseKvRequest(request_id=rid), timeout=5.0)
        except grpc.RpcError as exc:  # the lease frees the blocks anyway
            log.warning("could not release KV of %s: %s", rid, exc.details())
            return False
        return True

    # -- request records (best effort: Redis trouble never fails a request) -------------------------------
