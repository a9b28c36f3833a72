"""OpenMP teams: a helper thread that runs serially makes none, a released team's workers exit (each case in a
fresh interpreter, so that no other test's threads are counted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.engine.omp_teams import _libgomp

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(_libgomp() is None, reason="torch does not run on libgomp here")

PRELUDE = """
import json, os, threading, torch
from common.engine import omp_teams
torch.set_num_threads(2)
x = torch.randn(1 << 22)
threads = lambda: len(os.listdir("/proc/self/task"))
out = {}
"""


def run(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PRELUDE + code + "\nprint(json.dumps(out))"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_serial_helper_thread_makes_no_team_and_leaves_the_others_theirs():
    out = run("""
(x * 2).sum()
out["main_team"] = threads()
gate, seen = threading.Event(), threading.Event()
def helper(serial):
    if serial:
        out["serial"] = omp_teams.run_serially()
    (x * 2).sum()  # large enough for torch to run it in parallel
    out[f"helper_threads_{serial}"] = torch.get_num_threads()
    out[f"with_helper_{serial}"] = threads()
    seen.set()
    gate.wait()
for serial in (True, False):  # the non-serial one last: its team may outlive it a moment
    gate.clear(); seen.clear()
    t = threading.Thread(target=helper, args=(serial,))
    t.start(); seen.wait(); gate.set(); t.join()
out["main_threads"] = torch.get_num_threads()
""")
    assert out["with_helper_False"] == out["main_team"] + 2  # the helper and a worker of its own team
    assert out["serial"] is True
    assert out["with_helper_True"] == out["main_team"] + 1  # the helper alone
    assert out["helper_threads_True"] == 1
    assert out["main_threads"] == 2


def test_release_team_ends_the_calling_threads_workers_and_a_later_operator_makes_a_new_team():
    out = run("""
out["before"] = threads()
(x * 2).sum()
out["with_team"] = threads()
out["released"] = omp_teams.release_team()
import time
until = time.monotonic() + 10  # the workers exit on their own threads: on a loaded machine, a moment later
while threads() != out["before"] and time.monotonic() < until:
    time.sleep(0.01)
out["after_release"] = threads()
y = (x * 2).sum()
out["again"] = threads()
out["sum_equal"] = bool(y == (x * 2).sum())
""")
    assert out["with_team"] == out["before"] + 1
    assert out["released"] is True
    assert out["after_release"] == out["before"]
    assert out["again"] == out["with_team"]
    assert out["sum_equal"]
