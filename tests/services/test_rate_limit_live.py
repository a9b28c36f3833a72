"""Per-key rate limits on a live (in-process) cluster: a key over its requests budget gets RESOURCE_EXHAUSTED
with a ``retry-after-ms`` trailer over gRPC and 429 with ``Retry-After`` over HTTP, other keys are unaffected,
HTTP and gRPC spend one budget, and a tokens budget (from ``--rate-limit-file``) refuses what exceeds what is
left, gives back what a request did not generate, and refuses for good what exceeds the whole budget."""

from __future__ import annotations

import hashlib
import http.client
import json
import math
import re

import grpc
import pytest
import yaml

from pdserve.client import Client
from tests.services.inprocess import inprocess_cluster
from tests.services.probe import metric

KEY_A, KEY_B, KEY_H, KEY_T = "sk-rate-a-0001", "sk-rate-b-0002", "sk-rate-http-0003", "sk-rate-tokens-0004"
PROMPT = [5, 6, 7]  # 3 prompt tokens
RATE_LIMITED = "pdserve:rate_limited_requests_total"
MODEL = "tiny-llama"


def principal(key: str) -> str:
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:12]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    files = tmp_path_factory.mktemp("rate-limits")
    (files / "api-keys").write_text("\n".join((KEY_A, KEY_B, KEY_H, KEY_T)) + "\n")
    (files / "limits.yaml").write_text(yaml.safe_dump({principal(KEY_T): {"requests_per_min": 0,
                                                                          "tokens_per_min": 40}}))
    router = {"rate_limit_requests_per_min": 3, "api_key_file": str(files / "api-keys"),
              "rate_limit_file": str(files / "limits.yaml"), "served_model_name": MODEL}
    with inprocess_cluster(tiny_model_dir("llama"), prefill=[{"worker_id": "prefill-0"}],
                           decode=[{"worker_id": "decode-0"}], router=router) as c:  # fmt: skip
        yield c


def refusal(client: Client, **sampling) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        client.generate(PROMPT, **sampling)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    return err.value


def test_a_key_over_its_requests_budget_is_told_when_to_come_back_and_others_are_not(cluster):
    before = metric(cluster.router_http, RATE_LIMITED, limit="requests")
    with Client(cluster.router, timeout_s=120, api_key=KEY_A) as a:
        for _ in range(3):
            assert a.generate(PROMPT, max_tokens=2, ignore_eos=True).completion_tokens == 2
        err = refusal(a, max_tokens=2)
    trailers = dict(err.trailing_metadata())
    retry_ms = int(trailers["retry-after-ms"])
    assert 0 < retry_ms <= 20_000 and trailers["rate-limit"] == "requests"  # 3 a minute: one every 20 s
    assert err.details() == (f"rate limit: 3 requests per minute for {principal(KEY_A)} exceeded, "
                             f"retry after {retry_ms} ms")
    with Client(cluster.router, timeout_s=120, api_key=KEY_B) as b:
        assert b.generate(PROMPT, max_tokens=2, ignore_eos=True).completion_tokens == 2
    assert metric(cluster.router_http, RATE_LIMITED, limit="requests") == before + 1


def completion(cluster, key: str, max_tokens: int = 2):
    conn = http.client.HTTPConnection(cluster.router_http, timeout=120)
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens}
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Retry-After"), json.loads(resp.read())
    finally:
        conn.close()


def test_over_http_the_fourth_request_gets_429_and_grpc_shares_the_budget(cluster):
    answers = [completion(cluster, KEY_H) for _ in range(3)]
    assert [(status, retry, body["usage"]["completion_tokens"]) for status, retry, body in answers] == [
        (200, None, 2)] * 3  # fmt: skip
    status, retry_after, body = completion(cluster, KEY_H)
    match = re.fullmatch(rf"rate limit: 3 requests per minute for {principal(KEY_H)} exceeded, retry after (\d+) ms",
                         body["error"]["message"])
    assert match, body
    retry_ms = int(match[1])
    assert (status, retry_after) == (429, str(math.ceil(retry_ms / 1000)))
    assert body["error"] | {"message": ""} == {"message": "", "type": "requests", "param": None,
                                               "code": "rate_limit_exceeded"}  # fmt: skip
    with Client(cluster.router, timeout_s=120, api_key=KEY_H) as h:  # the same caller over gRPC: same budget
        assert dict(refusal(h, max_tokens=2).trailing_metadata())["rate-limit"] == "requests"


def test_a_tokens_budget_refuses_what_exceeds_what_is_left_and_takes_back_what_went_unused(cluster):
    who = principal(KEY_T)  # 40 tokens a minute, no requests budget (--rate-limit-file)
    before = metric(cluster.router_http, RATE_LIMITED, limit="tokens")
    with Client(cluster.router, timeout_s=120, api_key=KEY_T) as t:
        first = t.generate(PROMPT, max_tokens=2, temperature=0.0, ignore_eos=True)  # 5 tokens, all used
        assert first.completion_tokens == 2
        # stops at its first token: 3 + 30 reserved, 29 given back when it ends (9 of 40 spent in all)
        stopped = t.generate(PROMPT, max_tokens=30, temperature=0.0, stop_token_ids=[first.token_ids[0]])
        assert stopped.completion_tokens == 1
        assert t.generate(PROMPT, max_tokens=28, ignore_eos=True).completion_tokens == 28  # 31: all that is left
        err = refusal(t, max_tokens=10)  # 13 tokens; about 0 are left
        retry_ms = int(dict(err.trailing_metadata())["retry-after-ms"])
        assert 0 < retry_ms <= 13 * 1500  # 1.5 s per token
        assert err.details() == (f"rate limit: 40 tokens per minute for {who} exceeded (this request reserves "
                                 f"3 prompt + 10 completion tokens), retry after {retry_ms} ms")
        never = refusal(t, max_tokens=100)  # 103 tokens: more than the whole budget
        assert "retry-after-ms" not in dict(never.trailing_metadata())
        assert never.details() == (f"rate limit: this request needs 3 prompt + 100 completion tokens = 103, more "
                                   f"than the 40 tokens per minute of {who}; lower max_tokens or shorten the prompt")
    status, retry_after, body = completion(cluster, KEY_T, max_tokens=10)
    assert (status, body["error"]["type"], body["error"]["code"]) == (429, "tokens", "rate_limit_exceeded")
    assert retry_after is not None and 1 <= int(retry_after) <= 20
    assert metric(cluster.router_http, RATE_LIMITED, limit="tokens") == before + 3
