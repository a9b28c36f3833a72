"""What every gRPC handler of pdserve enters per call: the request id for its logs, and its span."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace

from common.obs.logs import request_scope
from common.obs.tracing import Tracing


@contextmanager
def call_scope(tracing: Tracing, name: str, request_id: str, context) -> Iterator[trace.Span]:
    """Inside a handler (its own thread): logs carry ``request_id``; span ``name`` continues the caller's
    trace from the call's metadata (``context.invocation_metadata()``), or starts one."""
    with request_scope(request_id), tracing.span(name, parent_metadata=context.invocation_metadata() or (),
                                                 attributes={"pdserve.request_id": request_id}) as span:
        yield span
