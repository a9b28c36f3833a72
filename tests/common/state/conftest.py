"""Fixtures of the state tests: a fresh redis-server on a free port per test, and a client to it."""

from __future__ import annotations

import pytest

from common.state.redis_client import connect
from tests.redis_server import RedisServer


@pytest.fixture
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def client(redis_server):
    c = connect(redis_server.url)
    yield c
    c.close()
