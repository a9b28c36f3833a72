"""Worker registry, heartbeats, key schema and client against a real redis-server on loopback."""

from __future__ import annotations

import json
import logging
import re
import socket
import time

import pytest
import redis

from common.state import keys
from common.state.redis_client import connect, ping, redact_url
from common.state.registry import Heartbeater, WorkerInfo, WorkerRegistry
from tests.redis_server import free_port


def make_info(worker_id: str = "p0", role: str = "prefill", **overrides) -> WorkerInfo:
    values = dict(
        id=worker_id,
        role=role,
        address="127.0.0.1:50051",
        host="node-a",
        pid=4242,
        model="sha256:abc123",
        version="0.1.0",
        num_requests_running=2,
        num_requests_waiting=1,
        kv_blocks_used=10,
        kv_blocks_total=512,
        kv_blocks_cached=3,
        metrics_address="127.0.0.1:9100",
        started_at=1700000000.25,
        updated_at=1700000001.5,
    )
    return WorkerInfo(**(values | overrides))


def wait_until(predicate, timeout_s: float, poll_s: float = 0.01) -> float:
    """Seconds until ``predicate()`` held; fails the test after ``timeout_s``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"condition not met within {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic() - start


# ------------------------------------------------------------------------------------------ key schema


def test_key_schema_is_exact_and_prefixed():
    assert keys.worker_key("p0") == "pdserve:worker:p0"
    assert keys.workers_index_key("decode") == "pdserve:workers:decode"
    assert keys.request_key("r-1") == "pdserve:request:r-1"
    assert keys.session_key("s-1", prefix="t3:") == "t3:session:s-1"


@pytest.mark.parametrize("prefix", ["", "pdserve", "pd serve:", None])
def test_bad_prefix_is_named(prefix):
    with pytest.raises(ValueError, match=re.escape(f"got {prefix!r}")):
        keys.worker_key("p0", prefix=prefix)


@pytest.mark.parametrize("worker_id", ["", "a b", "x\n"])
def test_bad_id_is_named(worker_id):
    with pytest.raises(ValueError, match="worker_id"):
        keys.worker_key(worker_id)


# ------------------------------------------------------------------------------------------ WorkerInfo


def test_worker_info_json_round_trip():
    info = make_info()
    assert WorkerInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info


def test_from_dict_ignores_unknown_fields_and_defaults_missing_optional_ones():
    data = make_info().to_dict() | {"gpu_temp_c": 71, "new_field": "x"}
    for name in ("kv_blocks_cached", "metrics_address", "state"):
        del data[name]
    info = WorkerInfo.from_dict(data)
    assert info == make_info(kv_blocks_cached=0, metrics_address="", state="ready")


def test_from_dict_names_a_missing_required_field():
    data = make_info().to_dict()
    del data["address"]
    with pytest.raises(ValueError, match=r"missing required field\(s\) \['address'\]"):
        WorkerInfo.from_dict(data)


def test_from_dict_names_a_value_of_the_wrong_type():
    with pytest.raises(ValueError, match="'pid' must be int, got 'many'"):
        WorkerInfo.from_dict(make_info().to_dict() | {"pid": "many"})


def test_invalid_role_state_and_load_are_named():
    with pytest.raises(ValueError, match="got 'router'"):
        make_info(role="router")
    with pytest.raises(ValueError, match="got 'sleeping'"):
        make_info(state="sleeping")
    with pytest.raises(ValueError, match="kv_blocks_used must be an int >= 0, got -1"):
        make_info(kv_blocks_used=-1)


# ------------------------------------------------------------------------------------------ registry


def test_register_then_list_and_get_show_exact_fields(client):
    registry = WorkerRegistry(client)
    info = make_info()
    registry.register(info)
    assert registry.list_workers() == [info]
    assert registry.get("p0") == info
    assert registry.get("nobody") is None
    raw = client.hgetall("pdserve:worker:p0")
    assert raw[b"role"] == b"prefill" and raw[b"pid"] == b"4242" and raw[b"started_at"] == b"1700000000.25"
    assert client.smembers("pdserve:workers:prefill") == {b"p0"}
    # Default TTL: 10 s, set with millisecond precision.
    assert registry.ttl_s == 10.0
    assert 9_000 < client.pttl("pdserve:worker:p0") <= 10_000


def test_heartbeat_updates_load_and_restarts_ttl(client):
    registry = WorkerRegistry(client, ttl_s=2.0)
    registry.register(make_info())
    client.pexpire("pdserve:worker:p0", 500)
    busier = make_info(num_requests_running=7, num_requests_waiting=3, kv_blocks_used=400, updated_at=1.7e9)
    registry.heartbeat(busier)
    assert registry.get("p0") == busier
    assert 1_500 < client.pttl("pdserve:worker:p0") <= 2_000


def test_heartbeat_recreates_an_entry_redis_lost(client):
    registry = WorkerRegistry(client)
    registry.register(make_info())
    client.flushdb()
    assert registry.list_workers() == []
    registry.heartbeat(make_info(num_requests_running=5))
    assert registry.list_workers() == [make_info(num_requests_running=5)]


def test_entry_vanishes_within_its_ttl_without_heartbeats(client):
    registry = WorkerRegistry(client, ttl_s=0.5)
    start = time.monotonic()
    registry.register(make_info())
    registered = time.monotonic()
    assert [w.id for w in registry.list_workers()] == ["p0"]
    wait_until(lambda: registry.list_workers() == [], timeout_s=0.7)
    gone = time.monotonic()
    assert gone - registered >= 0.45 and gone - start <= 0.7
    assert registry.get("p0") is None
    # list_workers cleaned the dead member out of the index.
    assert client.smembers("pdserve:workers:prefill") == set()


def test_deregister_removes_the_entry_and_is_idempotent(client):
    registry = WorkerRegistry(client)
    registry.register(make_info("p0"))
    registry.register(make_info("p1"))
    assert registry.deregister("p0") is True
    assert [w.id for w in registry.list_workers()] == ["p1"]
    assert registry.get("p0") is None
    assert client.smembers("pdserve:workers:prefill") == {b"p1"}
    assert registry.deregister("p0") is False


def test_list_filters_by_role_and_sorts_by_id(client):
    registry = WorkerRegistry(client)
    for worker_id, role in [("p1", "prefill"), ("d0", "decode"), ("p0", "prefill")]:
        registry.register(make_info(worker_id, role))
    assert [w.id for w in registry.list_workers(role="prefill")] == ["p0", "p1"]
    assert [w.id for w in registry.list_workers(role="decode")] == ["d0"]
    listed = [(w.id, w.role) for w in registry.list_workers()]
    assert listed == [("d0", "decode"), ("p0", "prefill"), ("p1", "prefill")]
    with pytest.raises(ValueError, match="got 'router'"):
        registry.list_workers(role="router")


def test_a_worker_that_changes_role_is_listed_once_under_its_new_role(client):
    registry = WorkerRegistry(client)
    registry.register(make_info("w0", "prefill"))
    registry.register(make_info("w0", "decode"))
    assert [(w.id, w.role) for w in registry.list_workers()] == [("w0", "decode")]
    assert client.smembers("pdserve:workers:prefill") == set()


def test_fields_from_a_newer_writer_are_ignored_and_broken_entries_skipped(client):
    registry = WorkerRegistry(client)
    registry.register(make_info("p0"))
    registry.register(make_info("p1"))
    client.hset("pdserve:worker:p0", "gpu_temp_c", "71")
    client.hdel("pdserve:worker:p1", "address")  # required: p1 cannot be decoded
    assert registry.list_workers() == [make_info("p0")]
    assert client.smembers("pdserve:workers:prefill") == {b"p0", b"p1"}  # alive, so not cleaned
    with pytest.raises(ValueError, match="address"):
        registry.get("p1")


def test_prefixes_keep_registries_apart(client):
    a, b = WorkerRegistry(client, prefix="a:"), WorkerRegistry(client, prefix="b:")
    a.register(make_info("p0"))
    assert [w.id for w in a.list_workers()] == ["p0"] and b.list_workers() == []
    assert client.exists("a:worker:p0") == 1


def test_bad_ttl_is_named(client):
    with pytest.raises(ValueError, match="ttl_s must be a positive number of seconds, got 0"):
        WorkerRegistry(client, ttl_s=0)


# ------------------------------------------------------------------------------------------ Heartbeater


class Load:
    """A load_fn whose running count goes up by one per call."""

    def __init__(self, worker_id: str = "p0") -> None:
        self.worker_id = worker_id
        self.num_calls = 0

    def __call__(self) -> WorkerInfo:
        self.num_calls += 1
        return make_info(self.worker_id, num_requests_running=self.num_calls, updated_at=time.time())


def test_heartbeater_keeps_the_entry_alive_past_several_ttls(client):
    registry = WorkerRegistry(client, ttl_s=0.3)
    load = Load()
    beater = Heartbeater(registry, load, interval_s=0.05)
    beater.start()
    try:
        wait_until(lambda: beater.connected, timeout_s=1.0)
        end = time.monotonic() + 1.0  # more than 3 TTLs
        while time.monotonic() < end:
            assert [w.id for w in registry.list_workers()] == ["p0"]
            time.sleep(0.02)
        calls_before = load.num_calls
        running = registry.get("p0").num_requests_running
        assert running >= 10  # the stored load is the fresh one, refreshed every beat
        assert calls_before - 1 <= running <= load.num_calls
    finally:
        beater.stop()


def test_heartbeater_re_registers_after_a_redis_restart(redis_server, client):
    registry = WorkerRegistry(client, ttl_s=2.0)
    beater = Heartbeater(registry, Load(), interval_s=0.1)
    beater.start()
    try:
        wait_until(lambda: registry.get("p0") is not None, timeout_s=1.0)
        client.set("sentinel", "1")
        redis_server.restart()  # empty data (the heartbeater may re-register before the next line runs)
        assert client.exists("sentinel") == 0
        assert wait_until(lambda: registry.get("p0") is not None, timeout_s=1.0) <= 0.25  # ~2 intervals
        assert [w.id for w in registry.list_workers()] == ["p0"]
    finally:
        beater.stop()


def test_heartbeater_survives_an_outage_and_logs_it_once(redis_server, client, caplog):
    caplog.set_level(logging.INFO, logger="common.state.registry")
    registry = WorkerRegistry(client, ttl_s=2.0)
    load = Load()
    beater = Heartbeater(registry, load, interval_s=0.05)
    assert beater.connected is False and beater.last_error is None
    beater.start()
    try:
        wait_until(lambda: beater.connected, timeout_s=1.0)
        redis_server.stop()
        wait_until(lambda: not beater.connected, timeout_s=1.0)
        calls_at_outage = load.num_calls
        wait_until(lambda: load.num_calls >= calls_at_outage + 4, timeout_s=1.0)  # keeps trying
        assert isinstance(beater.last_error, redis.ConnectionError)
        redis_server.start()
        wait_until(lambda: beater.connected, timeout_s=1.0)
        wait_until(lambda: registry.get("p0") is not None, timeout_s=1.0)
    finally:
        beater.stop()
    failures = [r for r in caplog.records if "heartbeat to Redis failed" in r.getMessage()]
    recoveries = [r for r in caplog.records if "succeeded again" in r.getMessage()]
    assert (len(failures), len(recoveries)) == (1, 1)


def test_heartbeater_outlives_a_failing_load_fn(client):
    registry = WorkerRegistry(client)
    num_calls = 0

    def flaky() -> WorkerInfo:
        nonlocal num_calls
        num_calls += 1
        if num_calls <= 2:
            raise RuntimeError("load probe broke")
        return make_info()

    beater = Heartbeater(registry, flaky, interval_s=0.02)
    beater.start()
    try:
        wait_until(lambda: registry.get("p0") is not None, timeout_s=1.0)
        assert str(beater.last_error) == "load probe broke" and beater.connected
    finally:
        beater.stop()


def test_stop_joins_promptly_and_is_idempotent(client):
    beater = Heartbeater(WorkerRegistry(client), Load())  # default interval: 1 s
    assert beater.interval_s == 1.0
    beater.stop()  # before start: no-op
    beater = Heartbeater(WorkerRegistry(client), Load())
    beater.start()
    wait_until(lambda: beater.connected, timeout_s=1.0)
    start = time.monotonic()
    beater.stop()
    assert time.monotonic() - start < 0.2
    assert not beater._thread.is_alive()
    beater.stop()
    with pytest.raises(RuntimeError, match="twice"):
        beater.start()


def test_heartbeat_interval_must_be_below_the_ttl(client):
    with pytest.raises(ValueError, match=r"interval_s \(2.0\) must be below the registry's ttl_s \(1.0\)"):
        Heartbeater(WorkerRegistry(client, ttl_s=1.0), Load(), interval_s=2.0)


# ------------------------------------------------------------------------------------------ client


def test_ping_to_a_closed_port_is_false_fast():
    port = free_port()  # nothing listens there
    client = connect(f"redis://127.0.0.1:{port}/0")
    start = time.monotonic()
    assert ping(client) is False
    assert time.monotonic() - start < 2.0


def test_ping_to_an_unresponsive_server_is_false_within_the_timeout():
    with socket.socket() as listener:  # accepts connections (backlog) but never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        client = connect(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", socket_timeout_s=0.3)
        start = time.monotonic()
        assert ping(client) is False
        assert 0.3 <= time.monotonic() - start < 1.0


def test_password_in_the_url(redis_server, client):
    client.config_set("requirepass", "s3cret")
    assert ping(connect(f"redis://:s3cret@127.0.0.1:{redis_server.port}/0")) is True
    assert ping(connect(redis_server.url)) is False


def test_connect_rejects_other_schemes_without_leaking_the_password():
    with pytest.raises(ValueError, match=r"got 'http://:\*\*\*@h:1'"):
        connect("http://:s3cret@h:1")
    assert redact_url("rediss://user:pw@h:6380/1") == "rediss://user:***@h:6380/1"
    assert redact_url("redis://h:1") == "redis://h:1"
