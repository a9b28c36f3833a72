"""Trace context router → prefill → decode in gRPC metadata (W3C ``traceparent``), OTLP export when configured.

Who calls what:

- the entry point: ``tracing = Tracing(service_name, otlp_endpoint=config.otlp_endpoint)`` once, passes it
  to the servicer, and calls :meth:`Tracing.shutdown` on stop (flushes spans not yet exported);
- the servicer, once per call, inside the handler: ``with tracing.span("Prefill",
  parent_metadata=context.invocation_metadata(), attributes={...}) as span:``;
- a caller of a downstream stub, inside that span: ``stub.Method(req, metadata=tracing.outgoing_metadata())``;
- records and logs: :func:`trace_id_of` (the JSON log formatter finds the current trace id by itself).

Spans are per request and per phase (a few per request), never per token.

Propagation without export: with no endpoint, a ``Tracing`` still has its own SDK ``TracerProvider`` (with no
span processor), so a root span gets fresh random trace/span ids, a received ``traceparent`` is continued,
and :meth:`Tracing.outgoing_metadata` passes the trace on. Such spans are sampled (flag ``01``) under the
default sampler, so a downstream service that does export records them. (``OTEL_SDK_DISABLED=true`` turns
the SDK into no-ops, and then no trace ids flow.)

No global state: each ``Tracing`` keeps its provider on the object (``trace.set_tracer_provider`` is never
called), so several services can live in one process (tests) with their own ``service.name``. The *current
span* is OpenTelemetry's context variable, shared by all of them: as with ``request_scope`` in
:mod:`common.obs.logs`, a gRPC handler runs on a pool thread, so it enters :meth:`Tracing.span` itself.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

# Endpoint environment variables, most specific first (the OpenTelemetry exporter specification's order).
ENDPOINT_ENV_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_TRACE_HEADERS = ("traceparent", "tracestate")


def resolve_endpoint(otlp_endpoint: str, environ: Mapping[str, str]) -> str:
    """``otlp_endpoint`` when non-empty, else the first non-empty of :data:`ENDPOINT_ENV_VARS` in
    ``environ``, else ``""`` (no export)."""
    if otlp_endpoint:
        return otlp_endpoint
    for name in ENDPOINT_ENV_VARS:
        value = environ.get(name, "").strip()
        if value:
            return value
    return ""


class Tracing:
    """One service's tracer: spans, the W3C trace context in gRPC metadata, and (optionally) OTLP export.

    ``Tracing(service_name, otlp_endpoint="")``: ``service_name`` becomes the resource attribute
    ``service.name`` of every span. The endpoint is resolved by :func:`resolve_endpoint`: the argument
    (the service's ``--otlp-endpoint`` flag, default ``""``) wins; when it is empty,
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` then ``OTEL_EXPORTER_OTLP_ENDPOINT`` are read from ``environ``
    (default ``os.environ``). With an endpoint (e.g. ``"http://127.0.0.1:4317"``), finished spans go through
    a ``BatchSpanProcessor`` to an OTLP/gRPC exporter (plaintext for ``http://``; ``https://`` uses TLS);
    other ``OTEL_EXPORTER_OTLP_*`` variables (headers, timeout, compression) apply as the exporter reads
    them. Without one, spans are created and propagated but exported nowhere. The resolved endpoint is
    :attr:`endpoint` (``""`` when not exporting).

    Thread-safe: spans may be started from any thread. Call :meth:`shutdown` once on stop (twice is safe);
    spans ended after it are dropped.
    """

    def __init__(self, service_name: str, otlp_endpoint: str = "", *, environ: Mapping[str, str] | None = None):
        if not isinstance(service_name, str) or not service_name.strip():
            raise ValueError(f"service_name must be a non-empty str, got {service_name!r}")
        if not isinstance(otlp_endpoint, str):
            raise ValueError(f"otlp_endpoint must be a str, got {otlp_endpoint!r}")
        self.service_name = service_name
        self.endpoint = resolve_endpoint(otlp_endpoint.strip(), os.environ if environ is None else environ)
        exporting = bool(self.endpoint)
        self._provider = TracerProvider(
            resource=Resource.create({SERVICE_NAME: service_name}),
            shutdown_on_exit=exporting,  # flush at interpreter exit if the entry point never called shutdown()
        )
        if exporting:
            # Imported only when exporting: the gRPC exporter pulls in the OTLP protobufs.
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            exporter = OTLPSpanExporter(endpoint=self.endpoint, insecure=True)  # https:// forces TLS anyway
            self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("pdserve")
        self._propagator = TraceContextTextMapPropagator()
        self._shutdown_lock = threading.Lock()
        self._is_shut_down = False

    def span(
        self,
        name: str,
        *,
        parent_metadata: Iterable[Any] | Mapping[str, Any] | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> AbstractContextManager[trace.Span]:
        """A context manager that starts span ``name``, makes it current for the ``with`` body, yields it,
        and ends it on exit (an exception escaping the body is recorded on the span, status ERROR, and
        re-raised).

        Parent: with ``parent_metadata`` ``None``, the span is a child of the current span (a root when
        none is current); kind INTERNAL. With ``parent_metadata`` given (a gRPC handler passes
        ``context.invocation_metadata()``: (key, value) pairs, objects with ``.key``/``.value``, or a
        mapping), the parent is the W3C ``traceparent`` (and ``tracestate``) found there, and only that:
        a root span when the metadata has no valid ``traceparent``, whatever span is current; kind SERVER.
        ``attributes``: span attributes (str, bool, int, float or sequences of one of those).
        """
        if parent_metadata is None:
            return self._tracer.start_as_current_span(name, kind=trace.SpanKind.INTERNAL, attributes=attributes)
        parent_context = self._propagator.extract(_metadata_carrier(parent_metadata))
        return self._tracer.start_as_current_span(
            name, context=parent_context, kind=trace.SpanKind.SERVER, attributes=attributes
        )

    def outgoing_metadata(self) -> list[tuple[str, str]]:
        """``[("traceparent", ...), ("tracestate", ...)]`` of the current span (``tracestate`` only when
        non-empty), ready for ``metadata=`` of a gRPC stub call (keys lowercase, as gRPC requires).
        ``[]`` when no valid span is current."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier)
        return list(carrier.items())

    def shutdown(self) -> None:
        """Export the spans still queued (blocks up to the exporter's timeouts) and shut the provider down.
        Called once by the entry point on stop; a second call does nothing."""
        with self._shutdown_lock:
            if self._is_shut_down:
                return
            self._is_shut_down = True
        self._provider.shutdown()


def trace_id_of(span: trace.Span) -> str:
    """The span's trace id as 32 lowercase hex chars; ``""`` for an invalid (no-op) span."""
    span_context = span.get_span_context()
    return f"{span_context.trace_id:032x}" if span_context.is_valid else ""


def span_id_of(span: trace.Span) -> str:
    """The span's own id as 16 lowercase hex chars; ``""`` for an invalid (no-op) span."""
    span_context = span.get_span_context()
    return f"{span_context.span_id:016x}" if span_context.is_valid else ""


def _metadata_carrier(metadata: Iterable[Any] | Mapping[str, Any]) -> dict[str, list[str]]:
    """The trace headers of gRPC metadata as ``{lowercase key: [values]}`` (the propagator's getter takes
    lists; repeated ``tracestate`` entries are all kept). Binary values are skipped."""
    items = metadata.items() if isinstance(metadata, Mapping) else metadata
    carrier: dict[str, list[str]] = {}
    for item in items:
        if isinstance(item, tuple):  # also grpc's _Metadatum, a namedtuple
            key, value = item
        else:
            key, value = item.key, item.value
        if not isinstance(key, str) or not isinstance(value, str):
            continue
        key = key.lower()
        if key in _TRACE_HEADERS:
            carrier.setdefault(key, []).append(value)
    return carrier
