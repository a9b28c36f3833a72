"""The engine's own CPU kernels (``common/engine/csrc``), compiled for this machine on first use.

:func:`load` builds the sources with ``torch.utils.cpp_extension`` (a C++ compiler and ``ninja`` needed:
``ninja`` is a dependency, g++ is on every machine the Makefile and the Docker image set up) into torch's
extension directory (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and registers them as
``torch.ops.pdserve.*``. The build is tuned for the CPU that compiles it (``-march=native``), so the
extension's name carries a digest of the CPU's model and flags: a checkout shared between different CPUs
builds once per kind. A later process loads the built library in about a tenth of a second.

Where the build fails (no compiler, an unsupported platform) or ``PDSERVE_CPU_KERNELS=0`` is set, :func:`load`
returns False once with a warning and the engine keeps its pure-PyTorch paths, which compute the same thing.
``python -m common.engine.cpu_kernels`` builds ahead of time (``make setup`` does).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("csrc") / f for f in ("paged_attention.cpp", "rms_norm.cpp", "bf16_linear.cpp")]
OPS = ("paged_decode_attention", "rms_norm", "bf16_linear")
_lock = threading.Lock()
_loaded: bool | None = None
_error: str = ""


@functools.cache
def _cpuinfo_lines() -> tuple[str, ...]:
    """/proc/cpuinfo's model and feature lines, one of each kind (read once: it is large on big machines)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return (platform.processor() or platform.machine(),)
    return tuple(sorted({line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))}))


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    for line in _cpuinfo_lines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _cpu_digest() -> str:
    """A digest of what ``-march=native`` depends on: the CPU's model name and feature flags."""
    return hashlib.sha256("\n".join(_cpuinfo_lines()).encode()).hexdigest()[:10]


def _put_ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; a venv used without activation has the pip package's binary off it."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def load() -> bool:
    """Build (first time) and load the kernels; True when ``torch.ops.pdserve`` has them. Never raises."""
    global _loaded, _error
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
            _loaded, _error = False, "disabled by PDSERVE_CPU_KERNELS=0"
            return False
        try:
            from torch.utils import cpp_extension

            _put_ninja_on_path()
            flags = ["-O3", "-fopenmp", "-ffp-contract=fast"]  # -fopenmp: at::parallel_for is inlined here
            if platform.machine() in ("x86_64", "AMD64"):
                flags.append("-march=native")
            elif platform.machine() in ("aarch64", "arm64"):
                flags.append("-mcpu=native")
            cpp_extension.load(
                name=f"pdserve_cpu_kernels_{_cpu_digest()}",
                sources=[str(s) for s in SOURCES],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
            missing = [op for op in OPS if not hasattr(torch.ops.pdserve, op)]
            _loaded = not missing
            if missing:
                _error = f"the library loaded without pdserve::{', '.join(missing)}"
        except Exception as exc:  # noqa: BLE001 - any build failure means: use the PyTorch paths
            _loaded, _error = False, f"{type(exc).__name__}: {exc}".strip()[:500]
        if not _loaded:
            log.warning("pdserve CPU kernels unavailable, using PyTorch attention: %s", _error)
        return _loaded


def unavailable_reason() -> str:
    """Why :func:`load` returned False ('' if it did not, or was not called)."""
    return _error


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    ok = load()
    print("pdserve CPU kernels:", "ready" if ok else f"unavailable ({_error})")
    raise SystemExit(0 if ok else 1)
