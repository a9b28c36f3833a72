"""``RejectUnparsable``: a request that does not parse is INVALID_ARGUMENT naming the parse error (gRPC's own answer
was INTERNAL "Exception deserializing request!"); the behavior never sees it; requests that parse are untouched,
and an AuthInterceptor around it still refuses first."""

from __future__ import annotations

import grpc
import pytest

from common.rpc.server import build_server
from common.rpc.unparsable import RejectUnparsable
from common.security.auth import ApiKeys, Authenticator
from common.security.grpc_auth import AuthInterceptor
from pdserve.v1 import generate_pb2, generate_pb2_grpc

KEY = "sk-unparsable-0001"
BAD_UTF8_TEXT = b"\x0a\x02\xff\xfe"  # field 1 (text), 2 bytes that are not UTF-8
TRUNCATED = b"\x0a\x05ab"  # field 1 says 5 bytes, 2 follow


class Echo(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def Generate(self, request, context):
        self.seen.append(request.text)
        yield generate_pb2.GenerateResponse(text=request.text.upper())


class AsyncEcho(Echo):
    async def Generate(self, request, context):
        self.seen.append(request.text)
        yield generate_pb2.GenerateResponse(text=request.text.upper())


@pytest.fixture(scope="module", params=["open", "with auth", "open, asyncio", "with auth, asyncio"])
def server(request):
    use_asyncio = request.param.endswith("asyncio")
    echo = AsyncEcho() if use_asyncio else Echo()
    interceptors = [RejectUnparsable()]
    if request.param.startswith("with auth"):
        interceptors.insert(0, AuthInterceptor(Authenticator(ApiKeys([KEY]))))
    server, port, _ = build_server(lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(echo, s),
                                   ["pdserve.v1.GenerateService"], interceptors=interceptors,
                                   use_asyncio=use_asyncio)  # fmt: skip
    server.start()
    yield f"127.0.0.1:{port}", echo, (("x-api-key", KEY),) if request.param.startswith("with auth") else ()
    server.stop(0)


def generate(address: str, raw: bytes, metadata=()) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream("/pdserve.v1.GenerateService/Generate", request_serializer=bytes,
                                    response_deserializer=generate_pb2.GenerateResponse.FromString)
        return [r.text for r in call(raw, metadata=metadata, timeout=10)]


@pytest.mark.parametrize("raw, reason", [
    (BAD_UTF8_TEXT, "String field had bad UTF-8"),
    (TRUNCATED, "Wire format was corrupt"),
])  # fmt: skip
def test_a_request_that_does_not_parse_is_invalid_argument_naming_why(server, raw, reason):
    address, echo, metadata = server
    served = len(echo.seen)
    with pytest.raises(grpc.RpcError) as err:
        generate(address, raw, metadata)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (f"request does not parse: Error parsing message with type "
                                   f"'pdserve.v1.GenerateRequest': {reason}")
    assert len(echo.seen) == served  # the servicer never ran


def test_a_request_that_parses_reaches_the_servicer(server):
    address, echo, metadata = server
    assert generate(address, generate_pb2.GenerateRequest(text="hé").SerializeToString(), metadata) == ["HÉ"]
    assert echo.seen[-1] == "hé"


def test_auth_still_refuses_first():
    server, port, _ = build_server(lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(Echo(), s),
                                   ["pdserve.v1.GenerateService"],
                                   interceptors=[AuthInterceptor(Authenticator(ApiKeys([KEY]))), RejectUnparsable()])
    server.start()
    try:
        with pytest.raises(grpc.RpcError) as err:
            generate(f"127.0.0.1:{port}", BAD_UTF8_TEXT)
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, "missing credentials")
    finally:
        server.stop(0)
