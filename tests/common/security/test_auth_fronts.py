"""The fronts enforcing an Authenticator, without a model: a gRPC server from ``build_server`` with
``AuthInterceptor`` (health open, reflection and methods closed, the principal reaches the handler; threaded
and asyncio servers, handlers of every kind) and an
``HttpFront`` with ``authenticator=`` (401 in OpenAI's shape, open probes)."""

from __future__ import annotations

import hashlib
import http.client
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from common.http.server import HttpFront, send_json
from common.rpc.server import build_server
from common.security.auth import ApiKeys, Authenticator, principal_of
from common.security.grpc_auth import AuthInterceptor

KEY = "sk-front-test-0001"
PRINCIPAL = "key:" + hashlib.sha256(KEY.encode()).hexdigest()[:12]
SERVICE = "test.Who"


def _who(request, context) -> bytes:
    return (principal_of(context) or "-").encode()


def _who_stream(request, context):
    yield b"first"
    yield (principal_of(context) or "-").encode()


async def _who_async(request, context) -> bytes:
    return _who(request, context)


async def _who_stream_async(request, context):
    for message in _who_stream(request, context):
        yield message


async def _who_stream_writes(request, context) -> None:  # a coroutine that writes its stream
    for message in _who_stream(request, context):
        await context.write(message)


HANDLERS = {  # server kind -> (asyncio server?, unary behavior, stream behavior)
    "threads": (False, _who, _who_stream),
    "asyncio": (True, _who_async, _who_stream_async),
    "asyncio, a stream that writes": (True, _who_async, _who_stream_writes),
    "asyncio, plain handlers": (True, _who, _who_stream),
}


@pytest.fixture(scope="module", params=list(HANDLERS))
def grpc_address(request):
    """The interceptor behind a threaded server and an asyncio one, with handlers of each kind."""
    use_asyncio, unary, stream = HANDLERS[request.param]
    handlers = {"Unary": grpc.unary_unary_rpc_method_handler(unary),
                "Stream": grpc.unary_stream_rpc_method_handler(stream)}  # fmt: skip
    server, port, health = build_server(
        lambda s: s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),)),
        [SERVICE], interceptors=[AuthInterceptor(Authenticator(ApiKeys([KEY])))], use_asyncio=use_asyncio,
    )  # fmt: skip
    server.start()
    health.set_serving(True)
    yield f"127.0.0.1:{port}"
    server.stop(0).wait(10)


def call(address: str, method: str, metadata=()):
    with grpc.insecure_channel(address) as channel:
        if method == "Unary":
            return channel.unary_unary(f"/{SERVICE}/Unary")(b"", metadata=metadata, timeout=10)
        return list(channel.unary_stream(f"/{SERVICE}/Stream")(b"", metadata=metadata, timeout=10))


@pytest.mark.parametrize("method", ["Unary", "Stream"])
def test_grpc_methods_need_a_key_and_the_handler_sees_the_principal(grpc_address, method):
    for metadata, reason in [((), "missing credentials"), ((("authorization", "Bearer sk-wrong"),), "invalid API key"),
                             ((("authorization", f"Basic {KEY}"),), "authorization must be 'Bearer <token>'")]:
        with pytest.raises(grpc.RpcError) as err:
            call(grpc_address, method, metadata)
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, reason)
    bearer = call(grpc_address, method, (("authorization", f"Bearer {KEY}"),))
    x_api_key = call(grpc_address, method, (("x-api-key", KEY),))
    expected = PRINCIPAL.encode() if method == "Unary" else [b"first", PRINCIPAL.encode()]
    assert bearer == x_api_key == expected


def test_grpc_health_is_open_and_reflection_is_not(grpc_address):
    with grpc.insecure_channel(grpc_address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = [reflection_pb2.ServerReflectionRequest(list_services="")]
        with pytest.raises(grpc.RpcError) as err:
            list(reflection.ServerReflectionInfo(iter(ask), timeout=10))
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, "missing credentials")
        (answer,) = reflection.ServerReflectionInfo(iter(ask), timeout=10, metadata=(("x-api-key", KEY),))
        assert SERVICE in {s.name for s in answer.list_services_response.service}


# -- HTTP ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http_address():
    front = HttpFront(authenticator=Authenticator(ApiKeys([KEY])))
    front.add_observability(CollectorRegistry(), lambda: [], lambda: {})
    front.route("GET", "/whoami", lambda req: send_json(req, 200, {"principal": principal_of(req)}))
    front.route("POST", "/admin/echo", lambda req: send_json(req, 200, json.loads(
        req.rfile.read(int(req.headers["Content-Length"])))))
    front.start()
    yield front.address
    front.stop()


def request(address: str, method: str, path: str, headers: dict | None = None, body: bytes | None = None):
    conn = http.client.HTTPConnection(address, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


UNAUTHORIZED = {"error": {"message": "missing credentials", "type": "invalid_request_error", "param": None,
                          "code": "invalid_api_key"}}  # fmt: skip


@pytest.mark.parametrize("method,path,body", [("GET", "/whoami", None), ("POST", "/admin/echo", b'{"a": 1}'),
                                              ("GET", "/no/such/route", None)])
def test_http_routes_need_a_key_with_openai_401(http_address, method, path, body):
    status, headers, data = request(http_address, method, path, body=body)
    assert status == 401 and json.loads(data) == UNAUTHORIZED
    assert headers["WWW-Authenticate"] == "Bearer" and headers["Connection"] == "close"
    status, _, data = request(http_address, method, path, {"Authorization": "Bearer sk-wrong"}, body)
    assert status == 401 and json.loads(data)["error"]["message"] == "invalid API key"


def test_http_with_a_key_reaches_the_handler_with_its_principal(http_address):
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"X-API-Key": KEY}):
        assert request(http_address, "GET", "/whoami", headers)[::2] == (200, json.dumps(
            {"principal": PRINCIPAL}, separators=(",", ":")).encode())
        assert request(http_address, "POST", "/admin/echo", headers, b'{"a": 1}')[::2] == (200, b'{"a":1}')
    assert request(http_address, "GET", "/no/such/route", {"X-API-Key": KEY})[0] == 404


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics"])
def test_http_probes_and_metrics_stay_open(http_address, path):
    assert request(http_address, "GET", path)[0] == 200
    assert request(http_address, "HEAD", path)[0] == 200
