"""A prefill worker's channels to decode workers (:class:`common.kv_transfer.connector.SenderPool`): one per
endpoint, reused; a broken one or one idle past the limit is closed and replaced, so channels to decode workers that
went away do not pile up."""

from __future__ import annotations

import time

import pytest

from common.kv_transfer.connector import SenderPool


class FakeSender:
    def __init__(self, name: str) -> None:
        self.name, self.broken, self.closed = name, "", False

    def close(self) -> None:
        self.closed = True


def wait_closed(sender: FakeSender) -> bool:
    deadline = time.monotonic() + 5.0
    while not sender.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    return sender.closed


def test_reused_replaced_when_broken_or_idle_and_closed_at_the_end():
    now = [0.0]
    pool = SenderPool(idle_s=600.0, clock=lambda: now[0])
    opened: list[FakeSender] = []

    def opener(name):
        def open_sender():
            opened.append(FakeSender(name))
            return opened[-1]
        return open_sender

    a = pool.get(("nixl", b"A"), opener("a"))
    assert pool.get(("nixl", b"A"), opener("a2")) is a and len(opened) == 1
    b = pool.get(("shm", "/b.sock"), opener("b"))
    assert len(pool) == 2
    a.broken = "a NIXL write to KV receiver x failed"
    a2 = pool.get(("nixl", b"A"), opener("a2"))  # the broken one is dropped (closed) and the next one opened
    assert a2 is not a and a2.name == "a2" and wait_closed(a)
    now[0] = 500.0
    pool.get(("nixl", b"A"), opener("unused"))  # a2 used at 500: b stays (used at 0, 500 s idle)
    now[0] = 1000.0
    pool.get(("nixl", b"A"), opener("unused"))  # b idle 1000 s: closed; a2 used at 500, 500 s ago: kept
    assert wait_closed(b) and not a2.closed and len(pool) == 1
    pool.close()
    assert a2.closed and len(pool) == 0


def test_an_endpoint_that_cannot_be_opened_leaves_nothing():
    pool = SenderPool()

    def refuse():
        raise ConnectionError("no answer")

    with pytest.raises(ConnectionError):
        pool.get(("nixl", b"gone"), refuse)
    assert len(pool) == 0


def test_a_slow_opening_holds_only_the_requests_for_its_own_endpoint():
    """Opening a channel to a decode worker that does not answer takes seconds: requests for other decode workers
    go on meanwhile; those for the same one wait for that opening and share its channel or its error."""
    import threading

    pool = SenderPool()
    release, results = threading.Event(), {}

    def slow(name: str, error: Exception | None = None):
        def open_sender():
            release.wait(10)
            if error is not None:
                raise error
            return FakeSender(name)
        return open_sender

    def get(tag: str, key, open_sender) -> None:
        try:
            results[tag] = pool.get(key, open_sender)
        except ConnectionError as exc:
            results[tag] = exc

    threads = [threading.Thread(target=get, args=("slow-1", "A", slow("a"))),
               threading.Thread(target=get, args=("bad-1", "B", slow("b", ConnectionError("no answer"))))]
    for t in threads:
        t.start()
    time.sleep(0.1)
    threads += [threading.Thread(target=get, args=("slow-2", "A", slow("a-again"))),
                threading.Thread(target=get, args=("bad-2", "B", slow("b-again")))]
    for t in threads[2:]:
        t.start()
    start = time.monotonic()
    assert pool.get("C", lambda: FakeSender("c")).name == "c"  # not held by A's or B's opening
    assert time.monotonic() - start < 0.5
    time.sleep(0.1)
    assert not results  # A and B still opening: their requests wait
    release.set()
    for t in threads:
        t.join(5)
    assert results["slow-1"] is results["slow-2"] and results["slow-1"].name == "a"  # one opening, one channel
    assert isinstance(results["bad-1"], ConnectionError) and results["bad-2"] is results["bad-1"]
    assert pool.get("B", lambda: FakeSender("b-later")).name == "b-later"  # a failed opening is not remembered
    assert len(pool) == 3
