"""The rate limiter (GCRA in one Lua script on Redis's clock) against a real private Redis: exact admissions,
retry hints, budgets shared by several limiters, the tokens budget with refunds, keys that expire, and
failing open while Redis is down."""

from __future__ import annotations

import logging
import time

import pytest

from common.state.keys import rate_limit_key
from common.state.rate_limit import Decision, Limits, RateLimiter
from common.state.redis_client import connect

PRINCIPAL = "key:0123456789ab"
ADMITTED = Decision(True, charged=True)


def refused(limit: str, retry_after_ms: int | None) -> Decision:
    return Decision(False, limit, retry_after_ms)


def test_a_requests_budget_admits_exactly_its_limit_then_says_when_one_more_fits(client):
    limiter = RateLimiter(client)
    t0 = time.monotonic()
    outcomes = [limiter.admit(PRINCIPAL, Limits(requests_per_min=3), 10) for _ in range(4)]
    elapsed_ms = (time.monotonic() - t0) * 1000
    assert outcomes[:3] == [ADMITTED] * 3
    fourth = outcomes[3]
    assert (fourth.admitted, fourth.limit, fourth.charged) == (False, "requests", False)
    # the bucket of 3 refills one request every 20 s, counted from the first admission
    assert 20_000 - elapsed_ms - 1 <= fourth.retry_after_ms <= 20_000
    assert limiter.admit(PRINCIPAL, Limits(requests_per_min=3), 10).limit == "requests"  # refusals cost nothing
    assert limiter.admit("key:ffffffffffff", Limits(requests_per_min=3), 10) == ADMITTED  # another caller


def test_waiting_the_retry_hint_is_enough(client):
    limiter = RateLimiter(client)
    limits = Limits(tokens_per_min=6_000)  # 10 ms per token
    t0 = time.monotonic()
    assert limiter.admit(PRINCIPAL, limits, 6_000) == ADMITTED
    over = limiter.admit(PRINCIPAL, limits, 50)
    elapsed_ms = (time.monotonic() - t0) * 1000
    assert (over.admitted, over.limit) == (False, "tokens")
    assert 500 - elapsed_ms - 1 <= over.retry_after_ms <= 500
    time.sleep(over.retry_after_ms / 1000)
    assert limiter.admit(PRINCIPAL, limits, 50) == ADMITTED
    assert limiter.admit(PRINCIPAL, limits, 50).limit == "tokens"


def test_two_limiters_share_one_budget(client, redis_server):
    other = connect(redis_server.url)  # a second router: its own client and script registration
    try:
        a, b = RateLimiter(client), RateLimiter(other)
        limits = Limits(requests_per_min=3)
        assert [a.admit(PRINCIPAL, limits, 0), b.admit(PRINCIPAL, limits, 0), a.admit(PRINCIPAL, limits, 0)] == [
            ADMITTED] * 3  # fmt: skip
        assert b.admit(PRINCIPAL, limits, 0).limit == "requests"
        assert a.admit(PRINCIPAL, limits, 0).limit == "requests"
    finally:
        other.close()


def test_the_tokens_budget_reserves_then_takes_back_the_unused_part(client):
    limiter = RateLimiter(client)
    limits = Limits(tokens_per_min=100)
    assert limiter.admit(PRINCIPAL, limits, 60) == ADMITTED
    assert (limiter.admit(PRINCIPAL, limits, 41).limit, limiter.admit(PRINCIPAL, limits, 40)) == ("tokens", ADMITTED)
    limiter.refund(PRINCIPAL, limits, 30)  # the second request generated 30 tokens fewer than reserved
    assert limiter.admit(PRINCIPAL, limits, 30) == ADMITTED
    assert limiter.admit(PRINCIPAL, limits, 1).limit == "tokens"


def test_a_refund_never_fills_the_budget_past_full(client):
    limiter = RateLimiter(client)
    limits = Limits(tokens_per_min=100)
    assert limiter.admit(PRINCIPAL, limits, 10) == ADMITTED
    limiter.refund(PRINCIPAL, limits, 50)
    assert limiter.admit(PRINCIPAL, limits, 100) == ADMITTED
    assert limiter.admit(PRINCIPAL, limits, 1).limit == "tokens"


def test_a_request_over_the_whole_tokens_budget_is_refused_for_good_without_a_redis_call(client, redis_server):
    limiter = RateLimiter(client)
    redis_server.stop()  # no Redis: the answer comes from the limits alone
    assert limiter.admit(PRINCIPAL, Limits(tokens_per_min=100), 101) == refused("tokens", None)


def test_a_request_refused_by_one_budget_is_charged_to_neither(client):
    limiter = RateLimiter(client)
    limits = Limits(requests_per_min=2, tokens_per_min=100)
    assert limiter.admit(PRINCIPAL, limits, 90) == ADMITTED
    assert limiter.admit(PRINCIPAL, limits, 20).limit == "tokens"  # not charged as a request either
    assert limiter.admit(PRINCIPAL, limits, 10) == ADMITTED  # the second request of 2
    assert limiter.admit(PRINCIPAL, limits, 0).limit == "requests"


def test_when_both_budgets_refuse_the_hint_is_the_longer_wait(client):
    limiter = RateLimiter(client)
    limits = Limits(requests_per_min=1, tokens_per_min=100)
    t0 = time.monotonic()
    assert limiter.admit(PRINCIPAL, limits, 100) == ADMITTED
    over = limiter.admit(PRINCIPAL, limits, 50)  # requests: 60 s away; tokens: 30 s away
    elapsed_ms = (time.monotonic() - t0) * 1000
    assert over.limit == "requests" and 60_000 - elapsed_ms - 1 <= over.retry_after_ms <= 60_000


def test_a_callers_key_lives_until_its_budgets_are_full_again(client):
    limiter = RateLimiter(client)
    key = rate_limit_key(PRINCIPAL)
    assert key == "pdserve:ratelimit:key:0123456789ab"
    for _ in range(3):
        assert limiter.admit(PRINCIPAL, Limits(requests_per_min=3), 0) == ADMITTED
    assert 59_000 < client.pttl(key) <= 60_000
    assert set(client.hgetall(key)) == {b"requests_tat_ms"}
    assert limiter.admit("idle-caller", Limits(requests_per_min=6_000, tokens_per_min=60_000), 1) == ADMITTED
    idle_key = rate_limit_key("idle-caller")
    assert 0 < client.pttl(idle_key) <= 10  # 10 ms per request, 1 ms per token
    time.sleep(0.05)
    assert client.exists(idle_key) == 0 and client.exists(key) == 1


def test_any_principal_makes_a_key(client):
    limiter = RateLimiter(client, prefix="pdserve-test:")
    assert limiter.admit("svc a/b%", Limits(requests_per_min=1), 0) == ADMITTED
    assert client.keys("*") == [b"pdserve-test:ratelimit:svc%20a%2Fb%25"]
    assert limiter.admit("svc a/b%", Limits(requests_per_min=1), 0).limit == "requests"


def test_no_limit_means_no_redis_call(client):
    limiter = RateLimiter(client)
    assert limiter.admit(PRINCIPAL, Limits(), 10**9) == Decision(True)
    limiter.refund(PRINCIPAL, Limits(requests_per_min=5), 10)  # no tokens budget: nothing to give back
    assert client.keys("*") == []


def test_redis_down_admits_and_logs_once_then_limits_again_when_it_returns(client, redis_server, caplog):
    limiter = RateLimiter(client, outage_retry_s=0.0)  # ask Redis on every call
    limits = Limits(requests_per_min=1)
    redis_server.stop()
    caplog.set_level(logging.WARNING, logger="common.state.rate_limit")
    t0 = time.monotonic()
    assert [limiter.admit(PRINCIPAL, limits, 5) for _ in range(3)] == [Decision(True)] * 3
    assert time.monotonic() - t0 < 3.0  # connection refused: no timeouts
    limiter.refund(PRINCIPAL, Limits(tokens_per_min=10), 5)  # no error either
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and messages[0].startswith("rate limits not enforced: Redis failed (")
    redis_server.start()  # empty, same port
    assert limiter.admit(PRINCIPAL, limits, 5) == ADMITTED  # the script is loaded again on the new server
    assert limiter.admit(PRINCIPAL, limits, 5).limit == "requests"
    assert [r.getMessage() for r in caplog.records][1:] == ["rate limits enforced again: Redis answers"]


def test_after_a_redis_error_the_limiter_skips_redis_for_outage_retry_s(client, redis_server):
    limiter = RateLimiter(client, outage_retry_s=30.0)
    redis_server.stop()
    assert limiter.admit(PRINCIPAL, Limits(requests_per_min=1), 0) == Decision(True)
    redis_server.start()
    # within the 30 s it does not ask: still admitted, uncharged, however many
    assert [limiter.admit(PRINCIPAL, Limits(requests_per_min=1), 0) for _ in range(3)] == [Decision(True)] * 3
    assert client.keys("*") == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"requests_per_min": -1}, "requests_per_min must be an int >= 0 (0: no limit), got -1"),
        ({"tokens_per_min": 1.5}, "tokens_per_min must be an int >= 0 (0: no limit), got 1.5"),
        ({"tokens_per_min": True}, "tokens_per_min must be an int >= 0 (0: no limit), got True"),
    ],
)
def test_limits_name_a_bad_value(kwargs, message):
    with pytest.raises(ValueError) as err:
        Limits(**kwargs)
    assert str(err.value) == message


def test_admit_names_a_bad_token_count(client):
    with pytest.raises(ValueError) as err:
        RateLimiter(client).admit(PRINCIPAL, Limits(requests_per_min=1), -3)
    assert str(err.value) == "num_tokens must be an int >= 0, got -3"
