"""A decode host that drops off the network while a prompt's KV is on its way to it (virtual hosts:
:mod:`tests.netns_hosts`; links slowed to 10 Mbit/s so that the transfer takes seconds): the router, which keeps
the decode worker's DecodeMany stream open during the hand-off, hears its keepalive pings go unanswered, cancels
the prefill and retries on the other decode worker with the same prefill worker (the only one). Before, a NIXL
hand-off waited out the KV lease (no call was open to the decode worker, only UCX traffic) and the retry then
avoided the prefill worker, so with one prefill worker the request failed after 35 s; over gRPC the transfer
failed in ~12 s and the retry failed the same way. Per transport, its own cluster; real processes.

Also a prefill and a decode host that lose only each other (both still reach the router): nothing carries pings
between them, so the prefill worker's NIXL channel watches the decode worker's silence (--kv-write-stall-s):
the hand-off fails after it, not after the KV lease, and is retried on the other prefill worker."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest

from common.kv_transfer import nixl
from pdserve.client import Client
from tests.conftest import hf_greedy
from tests.netns_hosts import VirtualHosts, start_pdserve, unavailable_reason, wait_serving
from tests.services.probe import metric, wait_for, workers

DECODE_HOSTS = {"decode-a": "da", "decode-b": "db"}
LEASE_S = 30.0  # the router's default --kv-lease-s, which the hand-off must not wait out


def _skip_reason() -> str:
    return unavailable_reason() or nixl.unavailable_reason()


pytestmark = pytest.mark.skipif(bool(_skip_reason()), reason=_skip_reason() or "-")


@pytest.fixture(scope="module", params=["nixl", "grpc"])
def cluster(request, tiny_model_dir, tmp_path_factory):
    model_dir = tiny_model_dir("llama")
    logs = tmp_path_factory.mktemp(f"split-mid-transfer-{request.param}")
    flags = ["--kv-cache-memory", "6e7", "--heartbeat-ttl-s", "3", "--threads", "1"]
    layout = {"prefill-a": ("prefill", "pa", [*flags, "--kv-transport", request.param])}
    layout |= {w: ("decode", host, [*flags, "--kv-nixl"]) for w, host in DECODE_HOSTS.items()}
    with VirtualHosts(["svc", "pa", *DECODE_HOSTS.values()]) as hosts:
        info = start_pdserve(hosts, model_dir, layout, logs, router_args=["--worker-cooldown-s", "1"])
        wait_serving(info, layout, logs)
        yield info | {"hosts": hosts, "model_dir": model_dir, "transport": request.param, "logs": logs}


def test_decode_host_split_off_mid_transfer_is_retried_within_keepalive(cluster, hf_reference):
    hosts, model = cluster["hosts"], hf_reference(cluster["model_dir"])
    with Client(cluster["router"], timeout_s=60) as client:  # warm: KV channels open, both pools used once
        for seed in range(2):
            warm = [(seed * 17 + 3 * i) % 3000 + 11 for i in range(64)]
            assert client.generate(warm, max_tokens=4, temperature=0.0, ignore_eos=True).token_ids == hf_greedy(
                model, warm, 4)
    wait_for(lambda: all(w.kv_blocks_used == 0 for w in workers(cluster["redis"]).values()), 15,
             "the warm requests' blocks free in the registry")  # else a stale entry names the wrong victim
    for host in ("pa", *DECODE_HOSTS.values()):
        hosts.shape(host, "10mbit")  # 1,500 tokens of the tiny model's KV: 3.1 MB, 2.5 s on this link
    prompt = [(7 + 13 * i) % 3000 + 11 for i in range(1500)]
    outcome: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            with Client(cluster["router"], timeout_s=120) as client:
                outcome["result"] = client.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
        except Exception as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc
        outcome["took_s"] = time.monotonic() - t0

    thread = threading.Thread(target=run)
    thread.start()
    # the decode worker whose reservation the KV is filling: split it off while the transfer runs
    target = wait_for(lambda: [w for w, info in workers(cluster["redis"]).items()
                               if w in DECODE_HOSTS and info.kv_blocks_used > 0], 10, "a reservation")  # fmt: skip
    victim = target[0]
    hosts.partition(DECODE_HOSTS[victim])
    try:
        thread.join(120)
        assert "result" in outcome, outcome
        result = outcome["result"]
        assert result.token_ids == hf_greedy(model, prompt, 8)
        assert result.prefill_worker_id == "prefill-a" and result.decode_worker_id != victim, result
        assert outcome["took_s"] < LEASE_S - 5, outcome  # keepalive (5 s + 5 s), the retry's transfer
        text = urllib.request.urlopen(f"http://{cluster['http']}/metrics", timeout=10).read().decode()
        assert metric(cluster["http"], "pdserve:handoff_retries_total", code="UNAVAILABLE") == 1, (
            result, outcome["took_s"], [line for line in text.splitlines() if "retries" in line])
    finally:
        hosts.heal(DECODE_HOSTS[victim])
    wait_for(lambda: victim in workers(cluster["redis"]) and all(
        w.kv_blocks_used == 0 for w in workers(cluster["redis"]).values()), 30,
        f"{victim} registered again, every KV block free")  # fmt: skip
    # healed: the victim serves again, its KV from the same prefill worker (a new channel where the old one broke)
    for host in ("pa", *DECODE_HOSTS.values()):
        hosts.shape(host, "")
    time.sleep(1.5)  # its suspicion (--worker-cooldown-s 1) over
    served = set()
    with Client(cluster["router"], timeout_s=60) as client:
        for seed in range(4):
            p = [(seed * 29 + 5 * i) % 3000 + 11 for i in range(300)]
            result = client.generate(p, max_tokens=8, temperature=0.0, ignore_eos=True)
            assert result.token_ids == hf_greedy(model, p, 8), seed
            served.add(result.decode_worker_id)
    assert victim in served, served


def test_a_lone_prefill_worker_that_cannot_reach_one_decode_worker_hands_off_to_the_other(cluster, hf_reference):
    """One prefill worker, two decode workers; the prefill host loses only decode-a's host. A hand-off to decode-a
    fails (its NIXL channel finds decode-a silent, or a new one finds it unreachable); decode-a answers the
    router's release, so the retry would avoid the prefill worker, the only one: it avoids decode-a instead, and
    every request ends on decode-b with stock tokens (before: "no other worker pair to retry on"). The router
    then pairs the two last (--pair-cooldown-s, 30 s): the requests after it go to decode-b without a failure
    first (before: each paid 3-10 s for it)."""
    if cluster["transport"] != "nixl":
        pytest.skip("the router's choice is the transport's business only in how long the failure takes (gRPC's "
                    "connect to an unanswering host: ~20 s)")  # fmt: skip
    hosts, model = cluster["hosts"], hf_reference(cluster["model_dir"])
    wait_for(lambda: set(DECODE_HOSTS) <= set(workers(cluster["redis"])), 30, "both decode workers registered")
    hosts.split("pa", DECODE_HOSTS["decode-a"])
    swapped = "the retry avoids decode-a instead"
    try:
        with Client(cluster["router"], timeout_s=90) as client:
            for seed in range(6):  # until a request went to decode-a first (the router spreads them)
                p = [(seed * 37 + 11 * i) % 3000 + 11 for i in range(150)]
                t0 = time.monotonic()
                result = client.generate(p, max_tokens=8, temperature=0.0, ignore_eos=True)
                took_s = time.monotonic() - t0
                assert result.token_ids == hf_greedy(model, p, 8), seed
                assert (result.prefill_worker_id, result.decode_worker_id) == ("prefill-a", "decode-b"), result
                assert took_s < 10 + 8, took_s  # --kv-write-stall-s's default, the retry
                if swapped in (cluster["logs"] / "router.log").read_text():
                    break
            router_log = (cluster["logs"] / "router.log").read_text()
            assert swapped in router_log
            assert "prefill-a and decode-a paired last for 30 s" in router_log, router_log[-3000:]
            for seed in range(6, 9):  # the router remembers the pair: the next requests go to decode-b at once
                p = [(seed * 37 + 11 * i) % 3000 + 11 for i in range(150)]
                t0 = time.monotonic()
                result = client.generate(p, max_tokens=8, temperature=0.0, ignore_eos=True)
                assert result.token_ids == hf_greedy(model, p, 8), seed
                assert result.decode_worker_id == "decode-b", result
                assert time.monotonic() - t0 < 2.5, seed  # no failed hand-off first (3 s at least: a new channel)
        later = (cluster["logs"] / "router.log").read_text()[len(router_log):]
        assert " failed: " not in later, later
    finally:
        hosts.join("pa", DECODE_HOSTS["decode-a"])


@pytest.fixture(scope="module")
def two_prefill(tiny_model_dir, tmp_path_factory):
    """Two prefill workers (NIXL, a short silence allowance) and one decode worker, on hosts of their own; the
    router's KV lease the default."""
    model_dir = tiny_model_dir("llama")
    logs = tmp_path_factory.mktemp("split-pair")
    flags = ["--kv-cache-memory", "6e7", "--heartbeat-ttl-s", "3", "--threads", "1"]
    prefill = [*flags, "--kv-transport", "nixl", "--kv-write-stall-s", str(STALL_S)]
    layout = {w: ("prefill", host, prefill) for w, host in (("prefill-a", "pa"), ("prefill-b", "pb"))}
    layout["decode-a"] = ("decode", "da", [*flags, "--kv-nixl"])
    with VirtualHosts(["svc", "pa", "pb", "da"]) as hosts:
        info = start_pdserve(hosts, model_dir, layout, logs,
                             router_args=["--worker-cooldown-s", "1", "--pair-cooldown-s", "1"])
        wait_serving(info, layout, logs)
        yield info | {"hosts": hosts, "model_dir": model_dir, "logs": logs}


STALL_S = 3.0


def test_a_prefill_and_a_decode_host_split_off_each_other_only(two_prefill, hf_reference):
    """prefill-a and decode-a lose each other but both still reach the router: no call between them carries
    keepalive pings. A NIXL channel already open finds decode-a silent past --kv-write-stall-s (before the watch a
    hand-off waited out the KV lease, 30 s); a channel to open finds decode-a's address unreachable (NIXL's own
    connect held the agent for ~2 minutes). Either way the hand-off fails within seconds, decode-a answers the
    release, so the retry avoids prefill-a and goes through prefill-b; never a hang, stock tokens."""
    hosts, model, logs = two_prefill["hosts"], hf_reference(two_prefill["model_dir"]), two_prefill["logs"]
    with Client(two_prefill["router"], timeout_s=60) as client:  # warm: both prefill workers' channels open
        used: set[str] = set()
        for seed in range(8):
            p = [(seed * 31 + 7 * i) % 3000 + 11 for i in range(100)]
            used.add(client.generate(p, max_tokens=2, temperature=0.0, ignore_eos=True).prefill_worker_id)
            if len(used) == 2:
                break
        assert used == {"prefill-a", "prefill-b"}, used
    hosts.split("pa", "da")
    ways = {"silent": "silent for", "unreachable": "unreachable from this prefill worker"}
    seen: set[str] = set()
    try:
        with Client(two_prefill["router"], timeout_s=60) as client:
            for seed in range(8):  # until prefill-a was tried both ways (the router alternates, a suspect waits 1 s)
                p = [(seed * 23 + 3 * i) % 3000 + 11 for i in range(200)]
                t0 = time.monotonic()
                result = client.generate(p, max_tokens=8, temperature=0.0, ignore_eos=True)
                took_s = time.monotonic() - t0
                assert result.token_ids == hf_greedy(model, p, 8), seed
                assert result.prefill_worker_id == "prefill-b", result
                assert took_s < STALL_S + 8 < LEASE_S, took_s
                print(f"after the split, request {seed}: {took_s:.2f} s")
                router_log = (logs / "router.log").read_text()
                seen = {way for way, text in ways.items() if text in router_log}
                if len(seen) == 2:
                    break
                time.sleep(1.2)  # prefill-a's suspicion and the pair's over (both cooldowns 1 s)
        assert seen == set(ways), router_log[-3000:]
        assert metric(two_prefill["http"], "pdserve:handoff_retries_total", code="UNAVAILABLE") >= 2
    finally:
        hosts.join("pa", "da")
    time.sleep(1.5)  # prefill-a's suspicion and the pair's over
    with Client(two_prefill["router"], timeout_s=60) as client:  # joined again: prefill-a hands off again
        used = set()
        for seed in range(3):
            p = [(seed * 41 + 9 * i) % 3000 + 11 for i in range(120)]
            result = client.generate(p, max_tokens=8, temperature=0.0, ignore_eos=True)
            assert result.token_ids == hf_greedy(model, p, 8), seed
            used.add(result.prefill_worker_id)
    assert "prefill-a" in used, used
