"""The router's view of the registry across Redis outages and restarts (a real redis-server, no workers:
entries are written by hand)."""

from __future__ import annotations

import time

import pytest

from common.state.redis_client import connect
from common.state.registry import WorkerInfo, WorkerRegistry
from services.router.registry_view import RegistryView
from tests.redis_server import RedisServer


def info(worker_id: str, role: str = "decode") -> WorkerInfo:
    return WorkerInfo(id=worker_id, role=role, address="127.0.0.1:1", host="h", pid=1, model="m", version="v",
                      num_requests_running=0, num_requests_waiting=0, kv_blocks_used=0, kv_blocks_total=8)


@pytest.fixture
def redis_server():
    with RedisServer() as server:
        yield server


def ids(view: RegistryView) -> list[str]:
    return sorted(w.id for w in view.workers())


def test_a_redis_restart_keeps_the_missing_workers_for_the_grace_period(redis_server):
    registry = WorkerRegistry(connect(redis_server.url), ttl_s=5.0)
    view = RegistryView(registry, grace_s=1.0)
    registry.register(info("decode-0"))
    registry.register(info("prefill-0", "prefill"))
    assert view.refresh() and ids(view) == ["decode-0", "prefill-0"]
    redis_server.restart()  # empty; only decode-0 re-registers
    registry.register(info("decode-0"))
    assert view.refresh() and not view.degraded
    assert ids(view) == ["decode-0", "prefill-0"]  # prefill-0 kept: it may be re-registering
    time.sleep(1.1)
    assert view.refresh() and ids(view) == ["decode-0"]  # grace over: it did not come back


def test_an_outage_keeps_the_last_view_then_grace_after_it(redis_server):
    registry = WorkerRegistry(connect(redis_server.url), ttl_s=5.0)
    view = RegistryView(registry, grace_s=1.0)
    registry.register(info("decode-0"))
    assert view.refresh() and ids(view) == ["decode-0"]
    redis_server.stop()
    assert not view.refresh() and view.degraded and ids(view) == ["decode-0"]
    redis_server.start()
    assert view.refresh() and not view.degraded and ids(view) == ["decode-0"]  # not re-registered yet: kept
    registry.register(info("decode-0"))
    time.sleep(1.1)
    assert view.refresh() and ids(view) == ["decode-0"]


def test_a_lapsed_worker_leaves_the_view_at_once_without_an_outage(redis_server):
    registry = WorkerRegistry(connect(redis_server.url), ttl_s=0.3)
    view = RegistryView(registry, grace_s=10.0)
    registry.register(info("decode-0"))
    registry.register(info("decode-1"))
    assert view.refresh() and ids(view) == ["decode-0", "decode-1"]
    time.sleep(0.2)
    registry.heartbeat(info("decode-1"))
    time.sleep(0.2)  # decode-0's entry lapsed; decode-1's lives on
    assert view.refresh() and ids(view) == ["decode-1"]
    assert [w.id for w in view.all_workers()] == ["decode-1"]  # nor in the pool figures
