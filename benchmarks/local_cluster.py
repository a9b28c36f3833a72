"""``pdserve up`` for the benchmarks: a real local cluster until its ready line, stopped with Ctrl-C after."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def pdserve_up(*args: str) -> Iterator[dict]:
    """``pdserve up ARGS`` (its logs to the log dir, not here); yields the ready line's fields (``router``,
    ``redis``, ``http``, ``logs``, ...) and ``proc``. RuntimeError with the line if it did not become ready."""
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "up", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        line = proc.stdout.readline()
        if not line.startswith("pdserve ready: "):
            raise RuntimeError(f"pdserve up failed: {line!r}")
        fields = line.split()
        yield {"router": fields[2], **dict(f.split("=", 1) for f in fields[3:]), "proc": proc}
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
