"""glibc malloc settings for processes that move large buffers: gRPC messages of KV chunks (megabytes), and the
engine's activations in a prefill (a 2,048-token prompt's gate/up product of a 0.35B model: 23 MB a layer).

By default glibc serves an allocation of 128 KiB or more (the threshold then adapts up to 32 MiB) with its own
``mmap`` and gives memory above the heap top back to the kernel past a 128 KiB trim threshold (twice the adapted
mmap threshold once that moved). Buffers of that size, allocated and freed over and over, are then mapped,
faulted in (the kernel zeroes every page) and unmapped again and again:

- a worker receiving 4 MiB KV chunks at 1 GB/s spent more CPU in the kernel than in user space on a KV transfer,
  which ran ~30% slower than with the settings below;
- a 2,048-token prefill of the 0.35B bf16 model faulted in 40-320 MB a prompt, and its gate/up products, whose
  output pages are all fresh then, took 16.4-17.8 ms against 10.4-11.6 ms with the settings below (Intel Xeon
  with AMX, three products alternated in the engine's forward); whole prefills 1.01-1.10x faster (three pairs of runs).

Keeping such buffers on the heap and the heap's top in the process costs at most the peak of what was freed
(bounded by the transfers in flight and the largest step's activations), which is the trade-off tcmalloc and
jemalloc make as well. The services apply them at start (``pdserve serve``), and so does an engine on the CPU
(:class:`common.engine.engine.LLMEngine`), for programs that embed one.

``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in the environment win: an operator's explicit choice
is left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 256 << 20


def tune_malloc() -> bool:
    """Apply the settings above (Linux with glibc only); True if they are in force."""
    if not sys.platform.startswith("linux"):
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if not ok:
        log.warning("mallopt refused the KV-friendly malloc settings; keeping glibc's defaults")
    return ok
