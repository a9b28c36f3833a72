"""The router's writes to Redis for a request: its record (status, workers, stage times) and its session.
Best effort: Redis trouble never fails a request, and never stalls the router's event loop (the writes run on its
thread pool). Mixed into :class:`services.router.servicer.RouterServicer` (uses its ``records`` and ``sessions``
stores)."""

from __future__ import annotations

import asyncio
import logging
import time

from common.metrics.router import RequestTimer
from common.rpc import convert
from common.state.records import RequestRecord, SessionRecord

log = logging.getLogger(__name__)


class RecordsMixin:
    # -- sessions (best effort too: without its record a turn is served by a full prefill) ---------------

    async def _session_load(self, session_id: str) -> SessionRecord | None:
        try:
            return await asyncio.to_thread(self.sessions.get, session_id)
        except Exception as exc:  # noqa: BLE001 - Redis trouble or a bad id: serve the turn from scratch
            log.debug("session %s not read: %s", session_id, exc)
            return None

    async def _session_save(self, session_id: str, token_ids: list[int], decode_id: str) -> None:
        await self._best_effort(self.sessions.put, SessionRecord(session_id=session_id, token_ids=token_ids,
                                                                 decode_worker_id=decode_id))

    async def _record_create(self, rid: str, num_prompt: int, trace_id: str) -> None:
        await self._best_effort(self.records.create, RequestRecord(request_id=rid, status="queued",
                                                                   num_prompt_tokens=num_prompt, trace_id=trace_id))

    async def _record_update(self, rid: str, **fields) -> None:
        await self._best_effort(self.records.update, rid, **fields)

    async def _record_finish(self, rid: str, status: str, timer: RequestTimer, emitted: int = 0, finish=None,
                             error: str = "") -> None:
        """The request's terminal record; finished ones also count at the router (``timer.finish``)."""
        reason = convert.finish_reason_from_proto(finish) if finish is not None else None
        if status == "finished":
            timer.finish(reason.value if reason else "")
        ttft_ms = (timer.first_token_s - timer.start_s) * 1e3 if timer.first_token_s is not None else -1.0
        log.info("request %s %s (%s): %d tokens, TTFT %.1f ms, %.1f ms in all", rid, status,
                 reason.value if reason else error, emitted, ttft_ms, (time.monotonic() - timer.start_s) * 1e3)
        fields = {"last_token_at": timer.last_token_at} if timer.last_token_at else {}
        if emitted:
            fields["num_tokens_emitted"] = emitted
        finish_reason = reason.value if reason else ""

        def write() -> None:  # one trip to the thread pool; the finish is written even if the update fails
            if fields:
                try:
                    self.records.update(rid, **fields)
                except Exception as exc:  # noqa: BLE001
                    log.debug("request record not updated: %s", exc)
            self.records.finish(rid, status, finish_reason=finish_reason, error=error)

        await self._best_effort(write)

    @staticmethod
    async def _best_effort(fn, *args, **kwargs) -> None:
        """``fn(*args, **kwargs)`` on the thread pool; a failure is logged, never raised."""
        try:
            await asyncio.to_thread(fn, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            log.debug("request record not written: %s", exc)
