"""The OpenMP thread teams behind torch's CPU operators, kept to the engine's own.

torch's CPU wheels run parallel operators on libgomp, which gives every thread that runs one a team of worker
threads of its own, kept for as long as that thread lives. Once a process holds more of these threads than it
has CPUs, libgomp stops letting any idle worker spin for the next operator: after 100 tries it sleeps, and each
parallel operator then starts by waking its workers. In a worker the model is loaded on the main thread and
stepped on the engine loop's, so the main thread's team alone tipped the count on a 2-core machine: the decode
step's second thread slept through half of each step (see docs/benchmarks.md, 2026-12-02).

Two verbs, for the threads of a process that runs an engine on a thread of its own:

- :func:`release_team` frees the calling thread's team (a thread that has handed its torch work to another);
- :func:`run_serially` makes the calling thread run torch's operators on itself alone (helper threads that copy
  KV while the engine steps): no team is ever made for it.

Both are no-ops where torch does not run on libgomp (another OpenMP runtime, or none).
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import cache

import torch

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t


@cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's own copy), or None."""
    torch.get_num_threads()  # torch loads its OpenMP runtime with its first parallel query
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all") and hasattr(lib, "omp_set_num_threads"):
            return lib
    return None


def release_team() -> bool:
    """Free the calling thread's OpenMP team, if it has one (its workers exit). A later parallel operator on
    this thread makes a new one. False where torch does not run on libgomp."""
    lib = _libgomp()
    if lib is None:
        return False
    if lib.omp_pause_resource_all(ctypes.c_int(OMP_PAUSE_SOFT)) != 0:  # inside a parallel region: nothing freed
        log.debug("omp_pause_resource_all refused on this thread")
        return False
    return True


def run_serially() -> bool:
    """Run torch's CPU operators on the calling thread alone from now on (its OpenMP thread count set to 1),
    and free any team it had. The other threads keep theirs. False where torch does not run on libgomp."""
    lib = _libgomp()
    if lib is None:
        return False
    torch.get_num_threads()  # torch sets a thread's count on its first parallel query: after that, not over ours
    lib.omp_set_num_threads(ctypes.c_int(1))
    release_team()
    return True
