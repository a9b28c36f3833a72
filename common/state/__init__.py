"""State in Redis: the key schema (:mod:`.keys`), the worker registry (:mod:`.registry`), request and
session records (:mod:`.records`), and opening a client (:mod:`.redis_client`). Nothing outside this
package builds a Redis key."""

from common.state.keys import DEFAULT_PREFIX
from common.state.records import RequestRecord, RequestStore, SessionRecord, SessionStore
from common.state.redis_client import connect, ping
from common.state.registry import Heartbeater, WorkerInfo, WorkerRegistry

__all__ = [
    "DEFAULT_PREFIX",
    "Heartbeater",
    "RequestRecord",
    "RequestStore",
    "SessionRecord",
    "SessionStore",
    "WorkerInfo",
    "WorkerRegistry",
    "connect",
    "ping",
]
