from __future__ import annotations

from collections import deque

import pytest
import redis as redis_lib

from common.state.prefix_index import PrefixIndex, PrefixPublisher
from common.state.redis_client import connect
from tests.redis_server import RedisServer


@pytest.fixture(scope="module")
def client():
    with RedisServer() as server:
        yield connect(server.url)


def test_published_names_give_leading_overlap_per_worker(client):
    index = PrefixIndex(client, prefix="pi-1:", ttl_s=5)
    events: deque = deque()
    PrefixPublisher(index, "p0", events).flush()  # nothing yet: still fine
    events.extend([(b"a", True), (b"b", True), (b"c", True), (b"x", True), (b"x", False)])
    PrefixPublisher(index, "p0", events).flush()
    index.publish("p1", [b"a", b"c"], [])
    assert not events
    assert index.overlap(["p0", "p1", "p2"], [b"a", b"b", b"c", b"d"]) == {"p0": 3, "p1": 1, "p2": 0}
    assert index.overlap(["p0"], [b"x"]) == {"p0": 0}  # added then evicted: the last event wins
    assert 0 < client.pttl("pi-1:prefix:p0") <= 5000


def test_a_failed_publish_keeps_the_events_in_order():
    index = PrefixIndex(connect("redis://127.0.0.1:1/0"), prefix="pi-2:")
    events = deque([(b"a", True), (b"b", True)])
    with pytest.raises(redis_lib.RedisError):
        PrefixPublisher(index, "p0", events).flush()
    assert list(events) == [(b"a", True), (b"b", True)]
