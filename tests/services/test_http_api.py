"""The router's HTTP front on a live cluster (``pdserve up``: real processes, real Redis): the OpenAI API
through the official ``openai`` client, the WebSocket stream, cancellation that frees KV on every worker,
deadlines, and errors in OpenAI's shape; malformed requests on a front with a stand-in router (no cluster)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from common.http.server import HttpFront
from pdserve.client import Client
from services.router.http_api import RouterHttpApi
from tests.cli import pdserve
from tests.services.up import pdserve_up

PROMPT = "The class statement"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    with pdserve_up("--model", model_dir, "--log-dir", str(tmp_path_factory.mktemp("http-logs")),
                    "--worker-arg=--kv-cache-memory=6e7", "--worker-arg=--max-model-len=2048") as info:
        workers = json.loads(pdserve("status", "--json", "--redis-url", info["redis"]).stdout)["workers"]
        info["metrics"] = {w["role"]: w["metrics_address"] for w in workers}
        info["model"] = os.path.basename(model_dir)
        yield info
    assert info["returncode"] == 0


@pytest.fixture(scope="module")
def oai(cluster):
    return openai.OpenAI(base_url=f"http://{cluster['http']}/v1", api_key="unused", max_retries=0, timeout=60)


def kv_blocks_used(address: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "pdserve:kv_cache_blocks_used")


def wait_kv_free(cluster, within_s: float = 1.0) -> float:
    """Seconds until both workers hold no KV block; fails past ``within_s``."""
    t0 = time.monotonic()
    while True:
        used = {role: kv_blocks_used(addr) for role, addr in cluster["metrics"].items()}
        if not any(used.values()):
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within_s, f"KV still held after {within_s} s: {used}"
        time.sleep(0.02)


GREEDY = dict(max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})


def test_models_lists_the_served_model(oai, cluster):
    assert [m.id for m in oai.models.list().data] == [cluster["model"]]


def test_completion_streamed_equals_whole_equals_grpc(oai, cluster):
    whole = oai.completions.create(model=cluster["model"], prompt=PROMPT, **GREEDY)
    chunks = list(oai.completions.create(model=cluster["model"], prompt=PROMPT, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY))
    with Client(cluster["router"]) as client:
        grpc_result = client.generate(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.choices[0].text == streamed == grpc_result.text and streamed
    assert whole.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens == grpc_result.prompt_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12  # include_usage


def test_chat_streamed_equals_whole(oai, cluster):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    whole = oai.chat.completions.create(model=cluster["model"], messages=messages, **GREEDY)
    chunks = list(oai.chat.completions.create(model=cluster["model"], messages=messages, stream=True, **GREEDY))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert whole.choices[0].message.content == streamed and streamed
    assert whole.choices[0].message.role == "assistant" and chunks[0].choices[0].delta.role == "assistant"
    assert whole.usage.completion_tokens == 12


@pytest.mark.parametrize("kwargs, status, names", [
    (dict(temperature=-1.0), 400, "temperature"),
    (dict(n=2), 400, "n"),
    (dict(model="other-model"), 404, "other-model"),
    (dict(prompt="x " * 3000), 400, "2048"),  # names both lengths
])  # fmt: skip
def test_bad_requests_get_openai_errors(oai, cluster, kwargs, status, names):
    args = dict(model=cluster["model"], prompt=PROMPT, max_tokens=4) | kwargs
    with pytest.raises(openai.APIStatusError) as err:
        oai.completions.create(**args)
    assert err.value.status_code == status and names in err.value.message
    assert set(err.value.body) >= {"message", "type", "param", "code"}


def test_websocket_streams_tokens_then_done(cluster):
    with ws_connect(f"ws://{cluster['http']}/v1/generate/ws", open_timeout=10) as ws:
        ws.send(json.dumps({"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}))
        messages = [json.loads(m) for m in ws]
    tokens = [m for m in messages if m["type"] == "token"]
    assert [m["type"] for m in messages] == ["token"] * len(tokens) + ["done"]
    assert sum(len(m["data"]["token_ids"]) for m in tokens) == 12
    assert messages[-1]["data"] == {"finish_reason": "length",
                                    "usage": messages[-1]["data"]["usage"]} and messages[-1]["data"]["usage"][
        "completion_tokens"] == 12
    assert all(isinstance(m["timestamp"], float) for m in messages)
    with Client(cluster["router"]) as client:
        assert "".join(m["data"]["text"] for m in tokens) == client.generate(
            PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True).text


LONG = {"prompt": PROMPT, "max_tokens": 1500, "temperature": 0.0, "ignore_eos": True}


def test_closing_the_websocket_cancels_on_every_worker(cluster):
    with ws_connect(f"ws://{cluster['http']}/v1/generate/ws", open_timeout=10) as ws:
        ws.send(json.dumps(LONG))
        for _ in range(3):
            assert json.loads(ws.recv(timeout=30))["type"] == "token"
    assert wait_kv_free(cluster) < 1.0


def test_http_disconnect_mid_stream_cancels(cluster):
    host, port = cluster["http"].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": cluster["model"], "stream": True, **LONG}),
                 {"Content-Type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 200 and reply.readline().startswith(b"data: ")
    reply.close()
    conn.close()  # the TCP connection ends: the router must notice and cancel
    assert wait_kv_free(cluster) < 1.0


def test_grpc_cancel_mid_stream_cancels(cluster):
    with Client(cluster["router"]) as client:
        stream = client.stream(PROMPT, max_tokens=1500, temperature=0.0, ignore_eos=True)
        next(stream)
        next(stream)
        stream.close()  # cancels the call
    assert wait_kv_free(cluster) < 1.0


def test_deadlines_reach_every_stage(cluster):
    with Client(cluster["router"], timeout_s=0.5) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(PROMPT, max_tokens=1500, temperature=0.0, ignore_eos=True)
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_kv_free(cluster) < 1.0
    body = json.dumps({"model": cluster["model"], **LONG}).encode()
    request = urllib.request.Request(f"http://{cluster['http']}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json", "X-Request-Timeout": "0.5"})
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(request, timeout=30)
    assert http_err.value.code == 504
    assert wait_kv_free(cluster) < 1.0


def test_a_deadline_with_no_time_left_is_kept(cluster):
    # No time remaining (0.0) used to read as "no deadline": the router's 600 s default, all 1500 tokens, a 200.
    body = json.dumps({"model": cluster["model"], **LONG}).encode()
    request = urllib.request.Request(f"http://{cluster['http']}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json", "X-Request-Timeout": "1e-300"})
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(request, timeout=30)
    assert http_err.value.code == 504
    assert wait_kv_free(cluster) < 1.0


# -- malformed requests (a stand-in router: none of these may reach it) -----------------------------------------


class _NoRouter:
    model = type("Model", (), {"tokenizer": None})

    def stream(self, request, context):  # raises before any loop would run it
        raise AssertionError(f"a malformed request reached the router: {request}")


@pytest.fixture(scope="module")
def bare_front():
    front = HttpFront("127.0.0.1", 0)
    RouterHttpApi(_NoRouter(), "m", loop=None).register(front)
    front.start()
    yield front.address
    front.stop()


def raw_exchange(address: str, head: bytes, body: bytes = b"") -> bytes:
    """Send ``head`` and ``body`` on one connection, then read until the server closes it (fails after 5 s)."""
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(head + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


@pytest.mark.parametrize("headers, body, status", [
    (b"Transfer-Encoding: chunked\r\n", b"5\r\nhello\r\n0\r\n\r\n", b"411 Length Required"),
    (b"Content-Length: 12abc\r\n", b"{}", b"400 Bad Request"),
    (b"Content-Length: 99999999999\r\n", b"{}", b"413 Request Entity Too Large"),
])  # fmt: skip
def test_a_body_refused_unread_closes_the_connection(bare_front, headers, body, status):
    # Keep-alive used to go on, parsing the unread body as the next request (an HTML "Bad request syntax").
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"
    reply = raw_exchange(bare_front, head, body)
    assert reply.startswith(b"HTTP/1.1 " + status) and reply.count(b"HTTP/1.1") == 1, reply
    assert b"\r\nConnection: close\r\n" in reply and reply.endswith(b'"param":null,"code":null}}'), reply


def test_json_nested_too_deeply_is_a_400_on_http_and_websocket(bare_front):
    # json.loads raised RecursionError: a 500 over HTTP and an HTTP 500 written into the WebSocket.
    body = b"[" * 100_000
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
    reply = raw_exchange(bare_front, head, body)
    assert reply.startswith(b"HTTP/1.1 400 ") and reply.endswith(
        b'{"error":{"message":"request body is not valid JSON: nested too deeply","type":"invalid_request_error",'
        b'"param":null,"code":null}}'), reply
    with ws_connect(f"ws://{bare_front}/v1/generate/ws", open_timeout=5) as ws:
        ws.send("[" * 100_000)
        error = json.loads(ws.recv(timeout=5))
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=5)
    assert error["data"]["error"]["message"] == "the request message is not valid JSON: nested too deeply"
    assert ws.close_code == 1008


def test_a_lone_surrogate_in_a_websocket_prompt_is_an_error_naming_it(bare_front):
    # The parser let it through and building the proto raised: an HTTP 500 written into the WebSocket.
    with ws_connect(f"ws://{bare_front}/v1/generate/ws", open_timeout=5) as ws:
        ws.send('{"prompt": "a\\ud800"}')
        error = json.loads(ws.recv(timeout=5))["data"]["error"]
    assert (error["param"], error["message"]) == (
        "prompt", "prompt holds a lone UTF-16 surrogate '\\ud800' at index 1, which is not valid Unicode")
    assert ws.close_code == 1008
