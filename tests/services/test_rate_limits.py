"""The router's rate-limit policy (:mod:`services.router.rate_limits`): which budgets apply to whom, the
``--rate-limit-file`` and its errors, the refusal messages, and the OpenAI error of a refusal."""

from __future__ import annotations

import pytest

from common.state.rate_limit import Limits
from common.state.redis_client import connect
from services.router.config import RouterConfig
from services.router.openai_protocol import error_from_grpc, rate_limit_error
from services.router.rate_limits import ANONYMOUS, Charge, RateLimited, RouterRateLimits, load_limits_file
from tests.redis_server import RedisServer

DEFAULT = Limits(requests_per_min=5, tokens_per_min=1000)


@pytest.fixture
def redis_client():
    with RedisServer() as server:
        client = connect(server.url)
        yield client
        client.close()


def write(tmp_path, text: str) -> str:
    path = tmp_path / "limits.yaml"
    path.write_text(text)
    return str(path)


def test_the_file_overrides_the_flags_budget_by_budget(tmp_path):
    path = write(tmp_path, '"key:0123456789ab": {requests_per_min: 600, tokens_per_min: 200000}\n'
                           "svc-batch: {tokens_per_min: 0}\nanonymous: {}\n")  # fmt: skip
    assert load_limits_file(path, DEFAULT) == {
        "key:0123456789ab": Limits(600, 200000),
        "svc-batch": Limits(5, 0),
        "anonymous": DEFAULT,
    }
    assert load_limits_file(write(tmp_path, "# nobody yet\n"), DEFAULT) == {}


@pytest.mark.parametrize(
    "text, message",
    [
        ("- a\n", "--rate-limit-file {path} must map principals to budgets, got a list"),
        ("svc: 5\n", "--rate-limit-file {path}: entry 'svc' must be a mapping with requests_per_min and/or "
                     "tokens_per_min, got 5"),
        ("svc: {rpm: 5}\n", "--rate-limit-file {path}: entry 'svc': unknown key(s) ['rpm']; the keys are "
                            "['requests_per_min', 'tokens_per_min']"),
        ("svc: {tokens_per_min: -1}\n", "--rate-limit-file {path}: entry 'svc': tokens_per_min must be an int >= 0 "
                                        "(0: no limit), got -1"),
        ("7: {tokens_per_min: 1}\n", "--rate-limit-file {path}: entry 7: a principal must be a non-empty string"),
    ],
)  # fmt: skip
def test_a_bad_file_is_an_error_naming_the_entry(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as err:
        load_limits_file(path, DEFAULT)
    assert str(err.value) == message.format(path=path)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_limits_file(str(tmp_path / "nope.yaml"), DEFAULT)
    assert str(err.value) == f"--rate-limit-file not found: {tmp_path / 'nope.yaml'}"


def test_no_budget_anywhere_means_no_rate_limits(tmp_path, redis_client):
    assert RouterRateLimits.from_config(RouterConfig(), redis_client) is None
    only_file = RouterConfig(rate_limit_file=write(tmp_path, "svc: {requests_per_min: 2}\n"))
    limits = RouterRateLimits.from_config(only_file, redis_client)
    assert (limits.default, limits.limits_of("svc"), limits.limits_of("other")) == (Limits(), Limits(2, 0), Limits())


def test_without_auth_every_caller_shares_the_anonymous_budget(redis_client):
    limits = RouterRateLimits.from_config(RouterConfig(rate_limit_requests_per_min=2), redis_client)
    assert limits.admit(None, 3, 4) == Charge(ANONYMOUS, Limits(2, 0), 4, True)
    assert limits.admit(None, 3, 4).principal == ANONYMOUS
    with pytest.raises(RateLimited) as err:
        limits.admit(None, 3, 4)
    assert (err.value.limit, 0 < err.value.retry_after_ms <= 30_000) == ("requests", True)
    assert str(err.value) == (f"rate limit: 2 requests per minute for anonymous exceeded, retry after "
                              f"{err.value.retry_after_ms} ms")
    assert limits.admit("key:0123456789ab", 3, 4).principal == "key:0123456789ab"  # its own budget


def test_release_gives_back_only_what_was_not_generated(redis_client):
    limits = RouterRateLimits.from_config(RouterConfig(rate_limit_tokens_per_min=100), redis_client)
    charge = limits.admit("svc", 10, 90)
    limits.release(charge, 30)  # 60 of the 90 reserved were not generated
    assert limits.admit("svc", 10, 50).charged
    with pytest.raises(RateLimited) as err:
        limits.admit("svc", 1, 1)
    assert str(err.value) == ("rate limit: 100 tokens per minute for svc exceeded (this request reserves 1 prompt + "
                              f"1 completion tokens), retry after {err.value.retry_after_ms} ms")


def test_a_rate_limit_refusal_is_a_429_told_apart_from_a_saturated_cluster():
    limited, saturated = rate_limit_error("tokens", "rate limit: ..."), error_from_grpc("RESOURCE_EXHAUSTED", "full")
    assert (limited.status, limited.body()) == (429, {"error": {"message": "rate limit: ...", "type": "tokens",
                                                                "param": None, "code": "rate_limit_exceeded"}})
    assert (saturated.status, saturated.type) == (429, "rate_limit_error")
