"""Errors of the router's request flow."""

from __future__ import annotations

import grpc


class HandoffError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, worker_id: str) -> None:
        super().__init__(message)
        self.code = code
        self.worker_id = worker_id
