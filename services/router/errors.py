"""Errors of the router's request flow."""

from __future__ import annotations

import grpc


class HandoffError(Exception):
    """A failed attempt, before the first token: ``worker_id`` is the worker the retry avoids ('' when there was no
    pair to try); ``other_id``, the other worker of the pair, which the retry avoids instead when no other worker
    can stand in for ``worker_id`` (a pair-specific failure with a pool of one: one prefill worker that cannot hand
    off to one of several decode workers)."""

    def __init__(self, code: grpc.StatusCode, message: str, worker_id: str, other_id: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.worker_id = worker_id
        self.other_id = other_id


def worker_status(exc: grpc.RpcError) -> grpc.StatusCode:
    """A worker call's status as the router treats it. The router's own cancellations arrive as
    ``asyncio.CancelledError``, so a CANCELLED status is the worker's doing: its server stopped (a drain that ran
    out, a SIGTERM) with the call in flight. That is UNAVAILABLE: a worker gone, retried or migrated elsewhere."""
    return grpc.StatusCode.UNAVAILABLE if exc.code() is grpc.StatusCode.CANCELLED else exc.code()
