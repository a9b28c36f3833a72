"""Observability: structured JSON logs carrying the request and trace ids (:mod:`.logs`), and OpenTelemetry
trace context router → prefill → decode with OTLP export when configured (:mod:`.tracing`).

Both are set up by a service's entry point (``setup_logging(...)``, ``Tracing(...)``) and used per call by
its servicer (``request_scope(request_id)``, ``tracing.span(...)``), inside the handler thread.

Importing this package (or any module in it) imports the OpenTelemetry API and SDK, about 0.1 s once per
process; the OTLP exporter loads only when a ``Tracing`` is given an endpoint.
"""

from common.obs.logs import JsonFormatter, TextFormatter, current_request_id, request_scope, setup_logging
from common.obs.scope import call_scope
from common.obs.tracing import Tracing, resolve_endpoint, span_id_of, trace_id_of

__all__ = [
    "JsonFormatter",
    "TextFormatter",
    "Tracing",
    "call_scope",
    "current_request_id",
    "request_scope",
    "resolve_endpoint",
    "setup_logging",
    "span_id_of",
    "trace_id_of",
]
