"""An OTLP/gRPC trace collector on a free loopback port, for tests of trace export."""

from __future__ import annotations

import threading
from concurrent import futures
from contextlib import contextmanager

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps every span it receives as a flat dict."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[dict[str, str]] = []

    def Export(self, request, context):  # the proto's method name
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(
                            {
                                "service": attrs.get("service.name", ""),
                                "name": span.name,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent_span_id": span.parent_span_id.hex(),
                            }
                        )
        return trace_service_pb2.ExportTraceServiceResponse()


@contextmanager
def otlp_collector():
    """``(collector, endpoint)``: spans exported to ``endpoint`` land in ``collector.spans``."""
    sink = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield sink, f"http://127.0.0.1:{port}"
    finally:
        server.stop(grace=None)
