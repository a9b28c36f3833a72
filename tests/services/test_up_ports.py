"""``pdserve up`` and ports another process takes: ``up`` picks each service a free port, and another process
(a tensor-parallel neighbour's ranks, any outgoing connection) may be handed it as an ephemeral one before the
service binds it. The service then exits with ``EXIT_PORT_TAKEN`` and ``up`` starts it again on new ports,
unless the user gave them."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from pdserve.client import Client
from tests.cli import REPO, pdserve

WAIT_S = 240


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


class Up:
    """``pdserve up ARGS`` with its stdout and stderr lines collected on threads as they come."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve", "up", *args], cwd=REPO, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        for stream, lines in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr)):
            threading.Thread(target=lambda s=stream, out=lines: out.extend(iter(s.readline, "")), daemon=True).start()

    def wait_for(self, lines: list[str], text: str) -> str:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            found = [line for line in lines if text in line]
            if found:
                return found[0]
            if self.proc.poll() is not None and not found:
                time.sleep(0.5)  # the reader threads may still hold its last lines
                found = [line for line in lines if text in line]
                if found:
                    return found[0]
                break
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} from pdserve up (exit {self.proc.poll()}): {''.join(self.stderr)[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def test_a_worker_whose_port_was_taken_is_started_again_and_serves(model_dir, tmp_path):
    """The prefill worker's metrics port is taken for its first start only (the test frees it once ``up`` says it
    starts the worker again): the cluster comes up, the worker serves /metrics on that port, a request works."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    up = Up("--model", model_dir, "--log-dir", str(tmp_path), f"--prefill-arg=--metrics-port={port}",
            "--worker-arg=--kv-cache-memory=6e7")  # fmt: skip
    try:
        said = up.wait_for(up.stderr, "pdserve up: prefill-0 could not listen")
        taken.close()  # its second start binds it: seconds away (imports, the model's load)
        assert f"cannot listen for HTTP on 127.0.0.1:{port}: Address already in use" in said, said
        assert "starting it again on other ports" in said, said
        ready = up.wait_for(up.stdout, "pdserve ready: ").split()
        fields = dict(f.split("=", 1) for f in ready[3:])
        workers = json.loads(pdserve("status", "--json", "--redis-url", fields["redis"]).stdout)["workers"]
        prefill = [w for w in workers if w["role"] == "prefill"]
        assert [w["metrics_address"] for w in prefill] == [f"127.0.0.1:{port}"], workers
        with Client(ready[2], timeout_s=60) as client:
            result = client.generate([5, 6, 7], max_tokens=4, ignore_eos=True)
        assert len(result.token_ids) == 4
        log = (tmp_path / "prefill-0.log").read_text()
        assert log.count("cannot listen for HTTP") == 1, log[-3000:]  # one failed start, then the one that serves
    finally:
        taken.close()
        code = up.stop()
    assert code == 0, "".join(up.stderr)[-3000:]


def test_the_router_on_ports_the_user_gave_is_not_started_again(model_dir, tmp_path):
    """``--port`` and ``--http-port`` given, the first taken: ``up`` reports the router's failure and exits 1
    (another port would not be the one the user asked for), leaving nothing running."""
    with socket.socket() as taken, socket.socket() as other:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        other.bind(("127.0.0.1", 0))  # held so that no one else gets it; released before the router binds it
        port, http_port = taken.getsockname()[1], other.getsockname()[1]
        other.close()
        up = Up("--model", model_dir, "--log-dir", str(tmp_path), "--port", str(port), "--http-port", str(http_port),
                "--worker-arg=--kv-cache-memory=6e7")  # fmt: skip
        try:
            code = up.proc.wait(WAIT_S)
        finally:
            up.stop()
    err = "".join(up.stderr)
    assert code == 1, err[-3000:]
    assert "pdserve up: router did not become ready (router exited with 75)" in err, err[-3000:]
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in err, err[-3000:]
    assert "starting it again" not in err, err[-3000:]
    assert not up.stdout
