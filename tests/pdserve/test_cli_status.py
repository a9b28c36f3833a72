"""``pdserve status`` against a real redis-server holding fake worker registrations."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.state.redis_client import connect
from common.state.registry import WorkerInfo, WorkerRegistry
from pdserve.commands import status as status_cmd
from tests.redis_server import RedisServer, free_port

REPO = Path(__file__).resolve().parents[2]
CONTRACT_KEYS = set(
    "id role address host pid num_requests_running num_requests_waiting kv_blocks_used kv_blocks_total".split()
)


def status_registered() -> bool:
    """Whether ``pdserve status`` is wired into the CLI yet (the lead adds it to ``_COMMANDS``)."""
    from pdserve.cli import build_parser

    with contextlib.redirect_stderr(io.StringIO()):
        try:
            build_parser().parse_args(["status", "--json"])
        except SystemExit:
            return False
    return True


needs_cli = pytest.mark.skipif(not status_registered(), reason="'status' is not in pdserve.cli._COMMANDS yet")


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


@pytest.fixture
def registry(redis_url):
    client = connect(redis_url)
    client.flushdb()
    yield WorkerRegistry(client, ttl_s=60.0)
    client.close()


def make_info(worker_id: str, role: str, port: int, **overrides) -> WorkerInfo:
    values = dict(
        id=worker_id,
        role=role,
        address=f"127.0.0.1:{port}",
        host="node-a",
        pid=port + 1,
        model="sha256:abc",
        version="0.1.0",
        num_requests_running=2,
        num_requests_waiting=1,
        kv_blocks_used=10,
        kv_blocks_total=512,
        kv_blocks_cached=3,
        started_at=1700000000.25,
        updated_at=time.time() - 2.0,
    )
    return WorkerInfo(**(values | overrides))


@pytest.fixture
def workers(registry) -> list[WorkerInfo]:
    """Registered out of order; ``pdserve status`` lists them sorted by role, then id."""
    infos = [
        make_info("prefill-1", "prefill", 5002, num_requests_running=0, kv_blocks_used=0),
        make_info("decode-0", "decode", 6001, kv_blocks_used=40, kv_blocks_total=1024, state="draining"),
        make_info("prefill-0", "prefill", 5001),
    ]
    for info in infos:
        registry.register(info)
    return sorted(infos, key=lambda w: (w.role, w.id))


def run_in_process(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    status_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["status", *argv])
    return args.func(args)


def test_json_lists_every_worker_with_the_contract_keys(redis_url, workers, capsys):
    assert run_in_process("--json", "--redis-url", redis_url) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and ": " not in out and ", " not in out  # one compact line
    listed = json.loads(out)
    assert list(listed) == ["workers"]
    assert [w["id"] for w in listed["workers"]] == ["decode-0", "prefill-0", "prefill-1"]
    for got, info in zip(listed["workers"], workers):
        assert CONTRACT_KEYS <= set(got)
        assert got == info.to_dict()
    decode = listed["workers"][0]
    assert (decode["role"], decode["address"], decode["pid"]) == ("decode", "127.0.0.1:6001", 6002)
    assert (decode["kv_blocks_used"], decode["kv_blocks_total"], decode["kv_blocks_cached"]) == (40, 1024, 3)
    assert (decode["num_requests_running"], decode["num_requests_waiting"], decode["state"]) == (2, 1, "draining")


def test_table_for_people(redis_url, workers, capsys):
    assert run_in_process("--redis-url", redis_url) == 0
    lines = capsys.readouterr().out.splitlines()
    header = "ROLE ID ADDRESS RUNNING WAITING KV USED/TOTAL CACHED STATE HEARTBEAT"
    assert lines[0].split() == header.split()
    assert [line.split()[:8] for line in lines[1:]] == [
        ["decode", "decode-0", "127.0.0.1:6001", "2", "1", "40/1024", "3", "draining"],
        ["prefill", "prefill-0", "127.0.0.1:5001", "2", "1", "10/512", "3", "ready"],
        ["prefill", "prefill-1", "127.0.0.1:5002", "0", "1", "0/512", "3", "ready"],
    ]
    ages_s = [float(line.split()[8].removesuffix("s")) for line in lines[1:]]
    assert all(1.5 <= age_s < 10.0 for age_s in ages_s)  # updated_at was 2 s ago


def test_empty_registry(redis_url, registry, capsys):
    assert run_in_process("--json", "--redis-url", redis_url) == 0
    assert capsys.readouterr().out == '{"workers":[]}\n'
    assert run_in_process("--redis-url", redis_url) == 0
    assert f"no live workers under prefix 'pdserve:' at {redis_url}" in capsys.readouterr().out


def test_prefix_and_url_from_environment(redis_url, registry, monkeypatch, capsys):
    WorkerRegistry(connect(redis_url), prefix="other:", ttl_s=60.0).register(make_info("d9", "decode", 7000))
    monkeypatch.setenv("PDSERVE_REDIS_URL", redis_url)
    assert run_in_process("--json") == 0
    assert json.loads(capsys.readouterr().out) == {"workers": []}
    assert run_in_process("--json", "--prefix", "other:") == 0
    assert [w["id"] for w in json.loads(capsys.readouterr().out)["workers"]] == ["d9"]


def test_unreachable_redis_is_one_line_naming_the_url(capsys):
    port = free_port()
    url = f"redis://:hunter2@127.0.0.1:{port}/0"
    start = time.monotonic()
    assert run_in_process("--json", "--redis-url", url) == 1
    assert time.monotonic() - start < 3.0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    shown = f"redis://:***@127.0.0.1:{port}/0"
    assert captured.err.startswith(f"pdserve status: error: cannot read the worker registry from Redis at {shown}: ")
    assert "hunter2" not in captured.err


def test_status_does_not_import_the_engine():
    code = (
        "import argparse, sys\n"
        "from pdserve.commands import status\n"
        "parser = argparse.ArgumentParser()\n"
        "status.add_parser(parser.add_subparsers())\n"
        f"args = parser.parse_args(['status', '--redis-url', 'redis://127.0.0.1:{free_port()}/0'])\n"
        "assert args.func(args) == 1\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('common.engine', 'transformers')))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, timeout=30)


def pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", *args], cwd=REPO, capture_output=True, text=True, timeout=30
    )


@needs_cli
def test_cli_json(redis_url, workers):
    proc = pdserve("status", "--json", "--redis-url", redis_url)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"workers": [w.to_dict() for w in workers]}
    assert proc.stdout.count("\n") == 1


@needs_cli
def test_cli_unreachable_redis_exits_1():
    url = f"redis://127.0.0.1:{free_port()}/0"
    proc = pdserve("status", "--redis-url", url)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"pdserve status: error: cannot read the worker registry from Redis at {url}: ")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
