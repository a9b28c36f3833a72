"""Run the ``pdserve`` command as a user would: a subprocess from the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def pdserve(*args: str, check: bool = True, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """``python -m pdserve ARGS``; with ``check``, a non-zero exit fails the test with the end of stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"pdserve {args} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc


def process_group_alive(pgid: int, wait_s: float) -> bool:
    """Whether any process of group ``pgid`` is still alive after waiting up to ``wait_s`` for all to go."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.2)
