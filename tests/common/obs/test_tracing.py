"""common.obs.tracing: W3C trace context router → prefill → decode, in process, over a real gRPC call, and
exported over OTLP/gRPC to an in-test collector."""

from __future__ import annotations

import re
from collections import namedtuple
from concurrent import futures

import grpc
import pytest
from opentelemetry.trace import StatusCode

from common.obs.tracing import Tracing, resolve_endpoint, span_id_of, trace_id_of
from tests.otlp_collector import otlp_collector

TRACEPARENT_RE = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")  # version-trace-parent-flags
Metadatum = namedtuple("Metadatum", ["key", "value"])


class KeyValue:
    """An object with .key/.value (as some gRPC metadata wrappers hand out), not a tuple."""

    def __init__(self, key: str, value: str) -> None:
        self.key, self.value = key, value


@pytest.fixture
def tracings():
    """``make(service)`` → a ``Tracing`` that exports nowhere (whatever the environment says); all shut down
    after the test."""
    made: list[Tracing] = []

    def make(service: str, otlp_endpoint: str = "") -> Tracing:
        made.append(Tracing(service, otlp_endpoint, environ={}))
        return made[-1]

    yield make
    for tracing in made:
        tracing.shutdown()


def test_trace_flows_router_to_prefill_to_decode(tracings):
    router, prefill, decode = tracings("router"), tracings("prefill"), tracings("decode")
    assert router.endpoint == "" and router.outgoing_metadata() == []

    with router.span("Generate", attributes={"request_id": "req-1"}) as router_span:
        to_prefill = router.outgoing_metadata()
    [(key, value)] = to_prefill
    match = TRACEPARENT_RE.fullmatch(value)
    assert key == "traceparent" and match is not None, to_prefill
    assert match.groups()[:2] == (trace_id_of(router_span), span_id_of(router_span))
    assert int(match.group(3), 16) & 0x01, "sampled flag: exporting workers downstream record the trace"
    assert router_span.attributes["request_id"] == "req-1"

    with prefill.span("Prefill", parent_metadata=to_prefill) as prefill_span:
        to_decode = prefill.outgoing_metadata()
    with decode.span("Decode", parent_metadata=[Metadatum(k, v) for k, v in to_decode]) as decode_span:
        pass

    trace_id = trace_id_of(router_span)
    assert re.fullmatch(r"[0-9a-f]{32}", trace_id) and trace_id != "0" * 32
    assert trace_id_of(prefill_span) == trace_id_of(decode_span) == trace_id
    assert router_span.parent is None
    assert prefill_span.parent.is_remote and f"{prefill_span.parent.span_id:016x}" == span_id_of(router_span)
    assert decode_span.parent.is_remote and f"{decode_span.parent.span_id:016x}" == span_id_of(prefill_span)
    assert len({span_id_of(router_span), span_id_of(prefill_span), span_id_of(decode_span)}) == 3
    assert prefill_span.resource.attributes["service.name"] == "prefill"


def test_metadata_forms_and_tracestate_are_carried(tracings):
    worker = tracings("prefill")
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    traceparent = f"00-{trace_id}-{parent_id}-01"
    for metadata in (
        [("user-agent", "grpc-python"), ("traceparent", traceparent), ("tracestate", "vendor=abc")],
        [KeyValue("traceparent", traceparent), KeyValue("tracestate", "vendor=abc"), KeyValue("x-bin", b"\x00")],
        {"traceparent": traceparent, "tracestate": "vendor=abc"},
    ):
        with worker.span("Prefill", parent_metadata=metadata) as span:
            outgoing = dict(worker.outgoing_metadata())
        assert trace_id_of(span) == trace_id
        assert f"{span.parent.span_id:016x}" == parent_id
        assert outgoing == {"traceparent": f"00-{trace_id}-{span_id_of(span)}-01", "tracestate": "vendor=abc"}


def test_metadata_without_traceparent_starts_a_new_trace_even_inside_a_span(tracings):
    router, worker = tracings("router"), tracings("prefill")
    with router.span("Generate") as outer:
        with worker.span("Prefill", parent_metadata=[("user-agent", "x")]) as root:
            pass
        with worker.span("Local") as child:  # no metadata: child of the current span
            pass
    assert root.parent is None and trace_id_of(root) != trace_id_of(outer)
    assert child.parent.span_id == outer.get_span_context().span_id and trace_id_of(child) == trace_id_of(outer)


def test_exception_is_recorded_and_reraised(tracings):
    tracing = tracings("decode")
    with pytest.raises(RuntimeError, match="out of blocks"):
        with tracing.span("Decode") as span:
            raise RuntimeError("out of blocks")
    assert span.status.status_code is StatusCode.ERROR
    assert [event.name for event in span.events] == ["exception"]


def test_endpoint_resolution():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://generic:4317", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ""}
    assert resolve_endpoint("http://flag:4317", env) == "http://flag:4317"
    assert resolve_endpoint("", env) == "http://generic:4317"
    assert resolve_endpoint("", {**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:4317"}) == (
        "http://traces:4317"
    )
    assert resolve_endpoint("", {}) == ""
    assert Tracing("router", environ={}).endpoint == ""
    from_env = Tracing("router", environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    assert from_env.endpoint == "http://127.0.0.1:9"
    from_env.shutdown()  # nothing queued: returns at once
    from_env.shutdown()


def test_bad_service_name_is_named():
    with pytest.raises(ValueError, match="' '"):
        Tracing(" ", environ={})


def test_trace_continues_over_a_real_grpc_call(tracings):
    router, prefill = tracings("router"), tracings("prefill")
    seen: dict[str, str] = {}

    def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
        with prefill.span("Prefill", parent_metadata=context.invocation_metadata()) as span:
            seen.update(trace_id=trace_id_of(span), parent_id=f"{span.parent.span_id:016x}")
        return request

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(handle)  # no (de)serializers: bytes in, bytes out
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Prefill", {"Run": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/test.Prefill/Run")
            with router.span("Generate") as router_span:
                reply = call(b"ping", metadata=router.outgoing_metadata(), timeout=5)
    finally:
        server.stop(grace=None)
    assert reply == b"ping"
    assert seen == {"trace_id": trace_id_of(router_span), "parent_id": span_id_of(router_span)}


@pytest.fixture
def collector():
    """``(collector, endpoint)`` of an OTLP collector on a free loopback port."""
    with otlp_collector() as sink_and_endpoint:
        yield sink_and_endpoint


def test_spans_are_exported_over_otlp_with_service_names(collector):
    sink, endpoint = collector
    router = Tracing("router", otlp_endpoint=endpoint, environ={})
    decode = Tracing("decode", otlp_endpoint=endpoint, environ={})
    assert router.endpoint == endpoint
    with router.span("Generate") as router_span:
        with decode.span("Decode", parent_metadata=router.outgoing_metadata(), attributes={"num_tokens": 4}):
            pass
    router.shutdown()  # flushes the batch processor
    decode.shutdown()
    router.shutdown()  # second call: no-op

    by_service = {span.pop("service"): span for span in sink.spans}
    assert len(sink.spans) == 2 and set(by_service) == {"router", "decode"}
    trace_id = trace_id_of(router_span)
    assert by_service["router"] == {
        "name": "Generate",
        "trace_id": trace_id,
        "span_id": span_id_of(router_span),
        "parent_span_id": "",
    }
    assert by_service["decode"]["name"] == "Decode"
    assert by_service["decode"]["trace_id"] == trace_id
    assert by_service["decode"]["parent_span_id"] == span_id_of(router_span)
