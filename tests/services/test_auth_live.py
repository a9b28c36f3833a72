"""API keys and JWTs on a live cluster: the router's gRPC API and HTTP front (OpenAI routes, WebSocket), the
open probes, ``pdserve generate`` / ``pdserve bench`` with ``--api-key``, and ``pdserve up --api-key-file``
(router and the workers' ``/admin/warmup``)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request

import grpc
import jwt
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from common.state.redis_client import connect
from common.state.registry import WorkerRegistry
from pdserve.cli import build_parser
from pdserve.client import Client
from tests.cli import pdserve
from tests.services.inprocess import inprocess_cluster
from tests.services.up import pdserve_up

KEY = "sk-live-test-key-0001"
SECRET = b"live-test-hs256-secret-of-32-bytes-or-more"
ISSUER, AUDIENCE = "https://idp.test", "pdserve"
PROMPT = "The class statement"
GREEDY = dict(max_tokens=4, temperature=0.0, ignore_eos=True)


def unauthorized(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


def make_token(*, exp_in_s: float = 300.0, aud: str = AUDIENCE) -> str:
    claims = {"sub": "svc-test", "iss": ISSUER, "aud": aud, "exp": int(time.time() + exp_in_s)}
    return jwt.encode(claims, SECRET, algorithm="HS256")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "api-keys"
    path.write_text(f"# test keys\n{KEY}\n\nsk-another-key\n")
    return str(path)


@pytest.fixture(scope="module")
def cluster(model_dir, key_file, tmp_path_factory):
    secret = tmp_path_factory.mktemp("jwt") / "secret"
    secret.write_bytes(SECRET)
    router = dict(api_key_file=key_file, jwt_secret_file=str(secret), jwt_issuer=ISSUER, jwt_audience=AUDIENCE)
    with inprocess_cluster(model_dir, prefill=[{"worker_id": "prefill-0"}], decode=[{"worker_id": "decode-0"}],
                           router=router) as cluster:  # fmt: skip
        yield cluster


def oai(cluster, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster.router_http}/v1", api_key=api_key, max_retries=0, timeout=120)


def http_call(address: str, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection(address, timeout=120)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
        resp = conn.getresponse()
        return resp.status, resp.getheader("WWW-Authenticate"), resp.read()
    finally:
        conn.close()


# -- gRPC ---------------------------------------------------------------------------------------------------


def test_grpc_generate_needs_a_valid_key_or_token(cluster):
    for api_key, reason in [(None, "missing credentials"), ("sk-wrong", "invalid API key"),
                            (make_token(exp_in_s=-120), "token expired"), (make_token(aud="other"), "wrong audience")]:
        with Client(cluster.router, timeout_s=120, api_key=api_key) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.generate(PROMPT, **GREEDY)
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, reason)
    with Client(cluster.router, timeout_s=120, api_key=KEY) as client:
        by_key = client.generate(PROMPT, **GREEDY)
    with Client(cluster.router, timeout_s=120, api_key=make_token()) as client:
        by_token = client.generate(PROMPT, **GREEDY)
    assert (by_key.finish_reason, by_key.completion_tokens) == ("length", 4) and by_key.text
    assert by_token.token_ids == by_key.token_ids


def test_grpc_health_needs_no_key(cluster):
    with grpc.insecure_channel(cluster.router) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


# -- HTTP ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/v1/completions", {"model": "x", "prompt": PROMPT, "max_tokens": 4}),
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": "hi"}]}),
])  # fmt: skip
def test_openai_routes_without_a_key_get_401(cluster, method, path, body):
    status, challenge, data = http_call(cluster.router_http, method, path, body)
    assert (status, challenge, json.loads(data)) == (401, "Bearer", unauthorized("missing credentials"))
    status, challenge, data = http_call(cluster.router_http, method, path, body, {"Authorization": "Bearer sk-no"})
    assert (status, challenge, json.loads(data)) == (401, "Bearer", unauthorized("invalid API key"))


def test_openai_client_with_a_key_or_token(cluster):
    for credential in (KEY, make_token()):
        client = oai(cluster, credential)
        model = client.models.list().data[0].id
        completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0.0)
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0.0)  # fmt: skip
        assert completion.usage.completion_tokens <= 4 and completion.choices[0].text
        assert chat.choices[0].message.role == "assistant"
    with pytest.raises(openai.AuthenticationError) as err:
        oai(cluster, make_token(exp_in_s=-120)).models.list()
    assert err.value.status_code == 401 and err.value.body == unauthorized("token expired")["error"]


def test_websocket_upgrade_needs_a_key(cluster):
    url = f"ws://{cluster.router_http}/v1/generate/ws"
    with pytest.raises(InvalidStatus) as err:
        ws_connect(url, open_timeout=60)
    response = err.value.response
    assert response.status_code == 401 and response.headers["WWW-Authenticate"] == "Bearer"
    assert json.loads(response.body) == unauthorized("missing credentials")
    with ws_connect(url, open_timeout=60, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        ws.send(json.dumps({"prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}))
        messages = [json.loads(m) for m in ws]
    assert messages[-1]["type"] == "done" and messages[-1]["data"]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics"])
def test_probes_and_metrics_stay_open(cluster, path):
    with urllib.request.urlopen(f"http://{cluster.router_http}{path}", timeout=30) as resp:
        assert resp.status == 200


# -- the CLI ------------------------------------------------------------------------------------------------


def test_pdserve_generate_with_and_without_api_key(cluster, monkeypatch):
    args = ("generate", PROMPT, "--router", cluster.router, "--max-tokens", "4", "--temperature", "0", "--json")
    refused = pdserve(*args, check=False)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr == "pdserve generate: error: UNAUTHENTICATED: missing credentials\n"
    by_flag = json.loads(pdserve(*args, "--api-key", KEY).stdout)
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    by_env = json.loads(pdserve(*args).stdout)
    assert by_flag["completion_tokens"] == by_env["completion_tokens"] == 4
    assert by_flag["token_ids"] == by_env["token_ids"]


def run_bench(cluster, result_json, *argv: str) -> dict:
    args = build_parser().parse_args(["bench", "--router", cluster.router, "--no-progress", "--result-json",
                                      str(result_json), "--num-requests", "3", "--concurrency", "3",
                                      "--input-len", "8", "--output-len", "4", *argv])  # fmt: skip
    assert args.func(args) == 0
    return json.loads(result_json.read_text())


def test_pdserve_bench_sends_the_api_key_over_grpc_and_http(cluster, tmp_path):
    refused = run_bench(cluster, tmp_path / "refused.json")
    assert (refused["completed"], refused["errors"]) == (0, {"UNAUTHENTICATED": 3})
    over_grpc = run_bench(cluster, tmp_path / "grpc.json", "--api-key", KEY)
    over_http = run_bench(cluster, tmp_path / "http.json", "--api-key", KEY, "--http-url",
                          f"http://{cluster.router_http}")
    for result in (over_grpc, over_http):
        assert (result["completed"], result["errors"], result["output_tokens"]) == (3, {}, 12)


# -- pdserve up --api-key-file (a real cluster: router and workers) -----------------------------------------


def test_pdserve_up_with_api_key_file(model_dir, key_file, tmp_path):
    with pdserve_up("--model", model_dir, "--api-key-file", key_file, "--log-dir", str(tmp_path / "logs"),
                    "--worker-arg=--kv-cache-memory=5e7") as info:
        with Client(info["router"], timeout_s=120) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.generate(PROMPT, **GREEDY)
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, "missing credentials")
        with Client(info["router"], timeout_s=120, api_key=KEY) as client:
            assert client.generate(PROMPT, **GREEDY).completion_tokens == 4
        assert http_call(info["http"], "GET", "/v1/models")[:2] == (401, "Bearer")
        assert http_call(info["http"], "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})[0] == 200
        workers = WorkerRegistry(connect(info["redis"])).list_workers()
        assert sorted(w.role for w in workers) == ["decode", "prefill"]
        for w in workers:
            warmup = {"prompts": ["Hello"]}
            status, challenge, data = http_call(w.metrics_address, "POST", "/admin/warmup", warmup)
            assert (status, challenge, json.loads(data)) == (401, "Bearer", unauthorized("missing credentials"))
            status, _, _ = http_call(w.metrics_address, "POST", "/admin/warmup", warmup, {"X-API-Key": KEY})
            assert status == 200
            assert http_call(w.metrics_address, "GET", "/metrics")[0] == 200
    assert info["returncode"] == 0
