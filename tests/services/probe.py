"""Reading a live cluster from tests: a service's /metrics, the registry's workers, waiting for conditions."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from common.state.redis_client import connect
from common.state.registry import WorkerInfo, WorkerRegistry


def metric(address: str, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` (full sample name, e.g. ``pdserve:foo_total``) whose labels include
    ``labels``, on the /metrics of the HTTP server at ``address``; 0.0 when there is none."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))  # fmt: skip


def workers(redis_url: str) -> dict[str, WorkerInfo]:
    """The registry's live workers, by id (what ``pdserve status`` lists)."""
    return {w.id: w for w in WorkerRegistry(connect(redis_url)).list_workers()}


def wait_for(condition: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.2):
    """Poll ``condition`` until it returns a truthy value (returned); AssertionError naming ``what`` after
    ``timeout_s``. Exceptions from ``condition`` count as not yet (a service may be restarting)."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            last = condition()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - not yet
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s (last: {last!r})")
        time.sleep(interval_s)
