"""A real local cluster for tests: ``pdserve up`` as a subprocess, until its ready line."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tests.cli import REPO

READY_TIMEOUT_S = 240
STOP_TIMEOUT_S = 60  # its own grace: 30 s, then SIGKILL


@contextmanager
def pdserve_up(*args: str) -> Iterator[dict]:
    """``pdserve up ARGS`` until ``pdserve ready:``; yields the ready line's fields (``router``, ``redis``, ``http``,
    ``logs``, ...) with ``proc`` and ``stderr`` (its lines so far, collected on a thread). Stopped with Ctrl-C
    on exit; its exit status is then in ``returncode``."""
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "up", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    ready: list[str] = []
    reader = threading.Thread(target=lambda: ready.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(READY_TIMEOUT_S)
    if not ready or not ready[0].startswith("pdserve ready: "):
        proc.kill()
        raise RuntimeError(f"pdserve up did not become ready: {ready} {''.join(stderr)[-3000:]}")
    fields = ready[0].split()
    info = {"router": fields[2], **dict(f.split("=", 1) for f in fields[3:]), "proc": proc, "stderr": stderr}
    try:
        yield info
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            info["returncode"] = proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # its children die with it (PR_SET_PDEATHSIG): nothing is left running
            proc.kill()
            proc.wait()
            raise RuntimeError(f"pdserve up did not stop within {STOP_TIMEOUT_S} s of Ctrl-C: "
                               f"{''.join(stderr)[-3000:]}") from None


def generate_concurrently(router: str, prompts: list[list[int]], max_tokens: list[int],
                          timeout_s: float = 180) -> tuple[dict[int, object], list[BaseException]]:  # fmt: skip
    """Every prompt at once, one client thread each (greedy, EOS ignored) through ``router``: the results by prompt
    index, and the errors raised."""
    from pdserve.client import Client

    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def one(i):
        try:
            with Client(router, timeout_s=120) as client:
                results[i] = client.generate(prompts[i], max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return results, errors
