"""Router policy on tiny factories: exact choices."""

from __future__ import annotations

from common.state.registry import WorkerInfo
from services.router.policy import LoadTracker, pick_decode, pick_prefill, pick_prefill_cached


def worker(wid: str, role: str, running: int = 0, waiting: int = 0, used: int = 0, total: int = 100) -> WorkerInfo:
    return WorkerInfo(id=wid, role=role, address=f"{wid}:1", host="h", pid=1, model="m", version="v",
                      num_requests_running=running, num_requests_waiting=waiting, kv_blocks_used=used,
                      kv_blocks_total=total)


def test_idle_pool_is_served_round_robin():
    workers = [worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode"), worker("d1", "decode")]
    tracker = LoadTracker()
    chosen = []
    for _ in range(4):  # each request finishes before the next arrives
        p = pick_prefill(workers, tracker, set()).worker.id
        d = pick_decode(workers, tracker, set()).worker.id
        tracker.acquire(p)
        tracker.acquire(d)
        tracker.release(p)
        tracker.release(d)
        chosen.append((p, d))
    assert chosen == [("p0", "d0"), ("p1", "d1"), ("p0", "d0"), ("p1", "d1")]


def test_in_flight_first_then_round_robin_then_registry_and_exclusions_hold():
    workers = [worker("d0", "decode", running=3), worker("d1", "decode", running=1, used=90),
               worker("d2", "decode", running=1, used=10)]
    tracker = LoadTracker()
    # nothing sent yet: the registry decides (least loaded, then most free blocks)
    assert pick_decode(workers, tracker, set()).worker.id == "d2"
    tracker.acquire("d2")
    # d2 has a request in flight here: the others go first, round robin before the registry's stale load
    assert pick_decode(workers, tracker, set()).worker.id == "d1"
    tracker.acquire("d1")
    assert pick_decode(workers, tracker, set()).worker.id == "d0"
    tracker.release("d2")
    tracker.release("d1")
    tracker.acquire("d0")
    tracker.release("d0")
    # all idle, each sent one: the registry breaks the tie again
    assert pick_decode(workers, tracker, set()).worker.id == "d2"
    assert pick_decode(workers, tracker, {"d1", "d2"}).worker.id == "d0"
    assert pick_decode(workers, tracker, {"d0", "d1", "d2"}) is None
    prefills = [worker("p0", "prefill", waiting=2), worker("p1", "prefill", running=1)]
    assert pick_prefill(prefills, tracker, set()).worker.id == "p1"
    assert pick_prefill(workers, tracker, set()) is None  # no prefill worker at all


def test_a_stale_busy_heartbeat_does_not_starve_a_worker():
    """d1's last heartbeat caught a request that has finished; sequential requests still alternate."""
    workers = [worker("d0", "decode"), worker("d1", "decode", running=1)]
    tracker = LoadTracker()
    chosen = []
    for _ in range(4):
        d = pick_decode(workers, tracker, set()).worker.id
        tracker.acquire(d)
        tracker.release(d)
        chosen.append(d)
    assert chosen == ["d0", "d1", "d0", "d1"]


def test_cache_aware_prefill_weighs_cached_tokens_against_load():
    workers = [worker("p0", "prefill"), worker("p1", "prefill")]
    tracker = LoadTracker()
    choice = pick_prefill_cached(workers, tracker, set(), {"p1": 512}, 600, load_penalty_tokens=256)
    assert choice.worker.id == "p1" and "512 of 600 prompt tokens cached there" in choice.reason
    tracker.acquire("p1")
    tracker.acquire("p1")  # two in flight there cost 512 tokens: a tie on score, then the less used one
    assert pick_prefill_cached(workers, tracker, set(), {"p1": 512}, 600, 256).worker.id == "p0"
    assert pick_prefill_cached(workers, tracker, {"p0"}, {"p1": 512}, 600, 256).worker.id == "p1"
    assert "in flight here" in pick_prefill_cached(workers, LoadTracker(), set(), {}, 600, 256).reason  # no cache


def test_a_suspect_goes_last_in_every_pool_until_its_cooldown_ends():
    now = [100.0]
    tracker = LoadTracker(cooldown_s=5.0, clock=lambda: now[0])
    workers = [worker("p0", "prefill"), worker("p1", "prefill", waiting=9), worker("d0", "decode"),
               worker("d1", "decode", running=9, used=90)]
    tracker.suspect("p0")
    tracker.suspect("d0")
    assert pick_prefill(workers, tracker, set()).worker.id == "p1"
    assert pick_decode(workers, tracker, set()).worker.id == "d1"
    cached = pick_prefill_cached(workers, tracker, set(), {"p0": 512, "p1": 16}, 600, 1)
    assert cached.worker.id == "p1"  # p0's cache does not outweigh its suspicion
    assert pick_decode(workers, tracker, {"d1"}).worker.id == "d0"  # a suspect beats no worker at all
    now[0] += 5.0
    assert not tracker.is_suspect("p0")
    assert pick_prefill(workers, tracker, set()).worker.id == "p0"
    assert pick_decode(workers, tracker, set()).worker.id == "d0"


def test_a_suspect_pair_goes_last_for_its_own_cooldown():
    """p0 -> d0 failed while both answered (their hosts lost each other): for --pair-cooldown-s the router pairs
    d0 with another prefill worker, or, where every prefill worker is a suspect pair with d0, sends the KV to
    another decode worker; neither worker is a suspect by itself, and either pair comes back after the cooldown."""
    now = [100.0]
    tracker = LoadTracker(cooldown_s=5.0, clock=lambda: now[0], pair_cooldown_s=30.0)
    pools = [worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode"), worker("d1", "decode")]
    tracker.suspect_pair("p0", "d0")
    assert not tracker.is_suspect("p0") and not tracker.is_suspect("d0")
    assert pick_prefill(pools, tracker, set(), "d0").worker.id == "p1"  # d0 takes its KV from p1
    assert pick_prefill(pools, tracker, set(), "d1").worker.id == "p0"  # p0 still serves d1
    assert pick_prefill_cached(pools, tracker, set(), {"p0": 512}, 600, 256, "d0").worker.id == "p1"
    assert pick_prefill_cached(pools, tracker, set(), {"p0": 512}, 600, 256, "d1").worker.id == "p0"
    assert pick_decode(pools, tracker, set(), via_prefill=True).worker.id == "d0"  # p1 can still feed d0
    lone = [w for w in pools if w.id != "p1"]  # one prefill worker, cut off from d0: d1 goes first
    assert pick_decode(lone, tracker, set(), via_prefill=True).worker.id == "d1"
    assert pick_decode(pools, tracker, {"p1"}, via_prefill=True).worker.id == "d1"  # p1 excluded: the same
    assert pick_decode(lone, tracker, set()).worker.id == "d0"  # a migration takes no KV from a prefill worker
    assert pick_decode(lone, tracker, {"d1"}, via_prefill=True).worker.id == "d0"  # tried last, not excluded
    now[0] += 29.0
    assert pick_decode(lone, tracker, set(), via_prefill=True).worker.id == "d1"
    now[0] += 1.0  # cooldown over
    assert not tracker.is_suspect_pair("p0", "d0")
    assert pick_decode(lone, tracker, set(), via_prefill=True).worker.id == "d0"
    assert pick_prefill(pools, tracker, set(), "d0").worker.id == "p0"
    tracker.suspect_pair("p1", "d1")  # a new suspect pair drops the lapsed ones from the table
    assert list(tracker._pair_until_s) == [("p1", "d1")]


def test_each_attempt_of_a_request_has_its_own_id_at_the_workers():
    """A retry may go to a worker still cancelling the failed attempt (the prefill worker kept when the decode
    worker was lost): under one id the old one's cancellation ended the new one (seen in the chaos test)."""
    from common.kv_transfer.wire import MAX_REQUEST_ID_BYTES
    from services.router.servicer import attempt_id

    assert attempt_id("req-1", 1) == "req-1"
    assert [attempt_id("req-1", n) for n in (2, 3)] == ["req-1~2", "req-1~3"]
    longest = "x" * MAX_REQUEST_ID_BYTES  # a client's id may use the whole wire limit
    ids = {attempt_id(longest, n) for n in (1, 2, 3)}
    assert len(ids) == 3 and all(len(i.encode()) <= MAX_REQUEST_ID_BYTES for i in ids)
