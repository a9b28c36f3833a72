"""Fuzzing the router's fronts (gRPC ``Generate``, the OpenAI HTTP API, the WebSocket stream) on one in-process
cluster with malformed and extreme inputs: empty and huge prompts, out-of-vocabulary ids, NaN / infinite /
negative sampling values, huge stop lists and strings, invalid UTF-8 and lone surrogates, malformed, deeply
nested or truncated JSON, wrong types and unknown fields.

Every answer is a success (the input is valid) or INVALID_ARGUMENT / HTTP 4xx naming the problem (OpenAI's error
shape over HTTP); never UNKNOWN, INTERNAL or a 5xx, never a hang (every call has a deadline). After each run the
router and the workers are healthy, and no KV block, running request or waiting request is left anywhere.

Each gRPC example has an oracle (:func:`grpc_fault`) that says, from the router's documented checks, whether the
request is valid and what the rejection must name; each HTTP / WebSocket example changes one field of a valid body,
so a rejection must name that field. Valid requests stay cheap: a gRPC stream is cancelled after
``MAX_MESSAGES`` messages, and an HTTP body whose ``max_tokens`` changes gets a prompt that fills all but a few
tokens of the context. Runs are derandomized (the same examples every run). Strategies and oracles:
:mod:`tests.fuzz.inputs`.
"""

from __future__ import annotations

import http.client
import json
import math
import urllib.request
import uuid

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from pdserve.client import sampling_message
from pdserve.v1 import generate_pb2
from services.router.config import RouterConfig
from services.router.main import load_model_info
from tests.fuzz.inputs import (
    BAD_UTF8,
    TIMEOUTS,
    Bodies,
    Model,
    dumps,
    generate_requests,
    grpc_fault,
    mutations,
    names_field,
    not_json,
    raw_bodies,
    raw_requests,
)
from tests.services.inprocess import inprocess_cluster
from tests.services.probe import metric, wait_for

CALL_TIMEOUT_S = 30.0  # no single call may take longer: a hang fails the example
MAX_MESSAGES = 4  # a valid gRPC request is cancelled after this many messages (huge max_tokens stay cheap)
FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=True, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def model(model_dir) -> Model:
    info = load_model_info(RouterConfig(model=model_dir))  # what the router itself loads
    return Model(model_dir.rstrip("/").rsplit("/", 1)[-1], info.vocab_size, info.max_model_len, info.tokenizer)


@pytest.fixture(scope="module")
def cluster(model_dir):
    with inprocess_cluster(model_dir, prefill=[{"worker_id": "prefill-0"}], decode=[{"worker_id": "decode-0"}]) as c:
        yield c


def assert_clean(cluster) -> None:
    """Every service answers /healthz; no KV block, running or waiting request is left on any worker."""
    for address in (cluster.router_http, *cluster.metrics.values()):
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=10) as reply:
            assert reply.status == 200, address

    def leftovers() -> dict:
        left = {(w, name): metric(a, f"pdserve:{name}") for w, a in cluster.metrics.items()
                for name in ("kv_cache_blocks_used", "num_requests_running", "num_requests_waiting")}
        left["router", "num_requests_running"] = metric(cluster.router_http, "pdserve:num_requests_running")
        return {k: v for k, v in left.items() if v}

    wait_for(lambda: not leftovers(), 10.0, "KV blocks and requests all freed")


# -- gRPC -------------------------------------------------------------------------------------------------------


def generate_stub(address: str):
    """``Generate`` taking serialized bytes, so that requests the Python protobuf cannot build reach the router."""
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)])
    return channel, channel.unary_stream("/pdserve.v1.GenerateService/Generate", request_serializer=bytes,
                                         response_deserializer=generate_pb2.GenerateResponse.FromString)


def call_generate(stub, raw: bytes) -> tuple[grpc.StatusCode, str, list]:
    """(status, details, messages); a stream still going after MAX_MESSAGES messages is cancelled and is OK."""
    call = stub(raw, timeout=CALL_TIMEOUT_S)
    messages = []
    try:
        for message in call:
            messages.append(message)
            if len(messages) == MAX_MESSAGES:
                call.cancel()
                break
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", messages
    return grpc.StatusCode.OK, "", messages


def check_grpc(raw: bytes, request: generate_pb2.GenerateRequest | None, model: Model, stub) -> None:
    """``request``: ``raw`` parsed (None: it does not parse, the router must say so)."""
    code, details, messages = call_generate(stub, raw)
    fault = ("GenerateRequest",) if request is None else grpc_fault(request, model)
    if fault is None:
        assert code is grpc.StatusCode.OK, (code, details)
        assert messages and (len(messages) == MAX_MESSAGES or messages[-1].finish_reason), messages
        if request.request_id:
            assert messages[0].request_id == request.request_id
    else:
        assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details, fault)
        assert all(word in details for word in fault), (details, fault)


def test_grpc_generate_answers_invalid_argument_or_generates(cluster, model):
    channel, stub = generate_stub(cluster.router)

    @settings(FUZZ, max_examples=150)
    @given(request=generate_requests(model))
    @example(request=generate_pb2.GenerateRequest(text="x" * 1_000_000))  # tokenized: too long
    @example(request=generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[5]), request_id="é" * 129))
    @example(request=generate_pb2.GenerateRequest(text="hi", sampling=sampling_message(max_tokens=2**32 - 1)))
    @example(request=generate_pb2.GenerateRequest(text="hi", sampling=sampling_message(temperature=math.nan)))
    def run(request):
        check_grpc(request.SerializeToString(), request, model, stub)

    with channel:
        run()
    assert_clean(cluster)


def test_grpc_unparsable_requests_are_invalid_argument(cluster, model):
    channel, stub = generate_stub(cluster.router)

    @settings(FUZZ, max_examples=60)
    @given(raw=raw_requests())
    def run(raw):
        try:
            request = generate_pb2.GenerateRequest.FromString(raw)
        except DecodeError:
            request = None
        if request is not None and request.request_id:  # random bytes: a fresh id (ids are unique while live)
            request.request_id = uuid.uuid4().hex
            raw = request.SerializeToString()
        check_grpc(raw, request, model, stub)

    with channel:
        run()
    assert_clean(cluster)


# -- HTTP -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bodies(model) -> dict[str, Bodies]:
    from services.router.openai_requests import CHAT_KEYS, COMPLETION_KEYS, render_chat

    room = model.max_model_len - 4
    n = room  # the chat prompt: "a " * n, rendered to at most `room` tokens
    while len(render_chat([{"role": "user", "content": "a " * n}], model.tokenizer)) > room:
        n -= 8
    completion = {"model": model.name, "prompt": "Hello", "max_tokens": 2}
    chat = {"model": model.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    return {
        "completion": Bodies("/v1/completions", COMPLETION_KEYS, completion, completion | {"prompt": [7] * room}),
        "chat": Bodies("/v1/chat/completions", CHAT_KEYS, chat,
                       chat | {"messages": [{"role": "user", "content": "a " * n}]}),
    }


def post(address: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=CALL_TIMEOUT_S)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        conn.close()


def error_of(data: bytes | str) -> dict:
    """The ``error`` object of an OpenAI error body (asserting its shape)."""
    body = json.loads(data)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return body["error"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_http_bodies_with_one_bad_field_get_a_4xx_naming_it(cluster, bodies, kind):
    spec = bodies[kind]

    @settings(FUZZ, max_examples=120)
    @given(mutation=mutations(spec.keys))
    @example(mutation=("max_tokens", 2**32 - 1))  # valid: ends at the context
    @example(mutation=("max_tokens", -1))
    @example(mutation=("n", 2))
    @example(mutation=("temperature", math.nan))
    @example(mutation=("stream", True))
    @example(mutation=("prompt", "\ud800"))  # lone surrogates wherever text reaches the model
    @example(mutation=("prompt", ["a\udfff"]))
    @example(mutation=("stop", "\udfff"))
    @example(mutation=("session_id", "\ud800"))
    @example(mutation=("messages", [{"role": "user", "content": "\ud800"}]))
    @example(mutation=("messages", [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]))
    @example(mutation=("messages", [{"role": "user", "content": "hi", "name": "\ud800"}]))
    def run(mutation):
        field, value = mutation
        status, headers, data = post(cluster.router_http, spec.path, dumps(spec.mutated(field, value)))
        if status == 200:
            if headers.get("Content-Type") == "text/event-stream":
                assert data.endswith(b"data: [DONE]\n\n"), data[-200:]
            else:
                assert json.loads(data)["choices"][0]["finish_reason"] in ("length", "stop"), data
            return
        assert status in (400, 404), (status, data)
        error = error_of(data)
        assert status == 400 or (field == "model" and error["code"] == "model_not_found"), error
        assert names_field(error, field), (field, error)

    run()
    assert_clean(cluster)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_http_malformed_bodies_get_a_4xx(cluster, model, path):
    @settings(FUZZ, max_examples=60)
    @given(body=raw_bodies(model.name))
    def run(body):
        status, _, data = post(cluster.router_http, path, body)
        if status == 200:
            return
        assert status in (400, 404), (status, data)
        error = error_of(data)
        if not_json(body):
            assert "JSON" in error["message"], error

    run()
    assert_clean(cluster)


def test_http_request_timeout_header_is_a_positive_number_or_a_400(cluster, bodies):
    body = dumps(bodies["completion"].short)

    @settings(FUZZ, max_examples=40)
    @given(value=TIMEOUTS)
    def run(value):
        status, _, data = post(cluster.router_http, "/v1/completions", body, {"X-Request-Timeout": value})
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if 0 < seconds < math.inf:  # a deadline below a second may pass before 2 tokens are out: a 504
            assert status == 200 or (status == 504 and seconds < 1.0), (value, status, data)
        else:
            assert status == 400 and "X-Request-Timeout" in error_of(data)["message"], (value, status, data)

    run()
    assert_clean(cluster)


# -- WebSocket --------------------------------------------------------------------------------------------------


def ws_exchange(address: str, first: str | bytes, *, as_text: bool | None = None) -> tuple[list[dict], int | None]:
    """Send ``first`` (``as_text``: bytes in a text frame), then read until the server closes: (messages, code)."""
    with ws_connect(f"ws://{address}/v1/generate/ws", open_timeout=10, close_timeout=5) as ws:
        ws.send(first, text=as_text)
        messages = []
        try:
            while True:
                messages.append(json.loads(ws.recv(timeout=CALL_TIMEOUT_S)))
        except ConnectionClosed:
            return messages, ws.close_code


def check_ws_answer(messages: list[dict], code: int | None) -> dict | None:
    """The error of a refused request (an error message, then close 1008), or None for tokens + done (1000)."""
    if messages and messages[-1]["type"] == "done":
        assert code == 1000 and {m["type"] for m in messages[:-1]} <= {"token"}, (code, messages)
        return None
    assert [m["type"] for m in messages] == ["error"] and code == 1008, (code, messages)
    return error_of(json.dumps(messages[0]["data"]))


def test_websocket_bad_first_messages_get_an_error_and_a_clean_close(cluster, bodies, model):
    spec = bodies["completion"]
    firsts = st.one_of(
        mutations(spec.keys).map(lambda mu: ("field", mu)),
        raw_bodies(model.name).filter(lambda b: len(b) < 1 << 20).map(lambda b: ("raw", b)),
        st.sampled_from(BAD_UTF8).map(lambda b: ("bad utf-8", b'{"prompt":"' + b + b'"}')),
    )

    @settings(FUZZ, max_examples=60)
    @given(first=firsts)
    def run(first):
        what, value = first
        if what == "bad utf-8":  # a text frame that is not UTF-8: the protocol's own close
            assert ws_exchange(cluster.router_http, value, as_text=True) == ([], 1007)
            return
        if what == "raw":
            error = check_ws_answer(*ws_exchange(cluster.router_http, value))
            if error is not None and not_json(value):
                assert "JSON" in error["message"], error
            return
        field, v = value
        error = check_ws_answer(*ws_exchange(cluster.router_http, dumps(spec.mutated(field, v)).decode()))
        if error is not None:
            assert names_field(error, field), (field, error)

    run()
    assert_clean(cluster)
