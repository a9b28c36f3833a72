"""``stop_on_signals``: SIGTERM and SIGINT set the stop event, also when they come while the main thread is inside
``Event.wait`` holding the event's lock (setting it from the handler hung a ``pdserve up`` at Ctrl-C in CI)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.cli import REPO

SIGNAL_IN_THE_LOCK = """
import os, signal, threading
from common.rpc.server import stop_on_signals
stop = threading.Event()
stop_on_signals(stop)
with stop._cond:  # where stop.wait() holds the event's lock: the handler runs here, before the lock is let go
    os.kill(os.getpid(), signal.SIG{name})
    held = True
print(stop.wait(10), flush=True)
"""

DRAIN_LOOP = """
import threading
from common.rpc.server import stop_on_signals
stop = threading.Event()
stop_on_signals(stop)
print("waiting", flush=True)
while not stop.wait(0.2):
    pass
print("stopped", flush=True)
"""


def test_a_signal_while_the_main_thread_holds_the_events_lock_still_sets_it():
    for name in ("INT", "TERM"):
        done = subprocess.run([sys.executable, "-c", SIGNAL_IN_THE_LOCK.format(name=name)], cwd=REPO,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert (done.returncode, done.stdout) == (0, "True\n"), done.stderr


def test_sigterm_from_outside_ends_the_wait_loop_at_once():
    proc = subprocess.Popen([sys.executable, "-c", DRAIN_LOOP], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "waiting\n"
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert proc.stdout.read() == "stopped\n"
        assert time.monotonic() - start < 5
    finally:
        proc.kill()
