"""A real ``redis-server`` for tests: on a free loopback port, no persistence, its own temp directory.

    with RedisServer() as server:
        client = connect(server.url)
        ...
        server.restart()  # same port, empty data

Never uses the default port 6379, so a developer's own Redis is never touched.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

DEFAULT_REDIS_PORT = 6379


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it; never 6379)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != DEFAULT_REDIS_PORT:
            return port


class RedisServer:
    """One ``redis-server`` process from the PATH; ``start()`` on entering the context, ``stop()`` on exit."""

    def __init__(self, *, startup_timeout_s: float = 10.0, executable: str = "redis-server") -> None:
        path = shutil.which(executable)
        if path is None:
            raise RuntimeError(f"{executable!r} is not on the PATH; install Redis to run these tests")
        self.executable = path
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
        self._proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self._dir / "redis.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the server on ``self.port`` and wait until it answers PING (RuntimeError with its log)."""
        if self.running:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        # fmt: off
        args = [
            self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(self._dir), "--daemonize", "no",
            # SIGTERM is acted on in the server's cron, which runs hz times a second: 100 (default 10)
            # makes stop() take ~10 ms instead of ~100 ms.
            "--hz", "100",
        ]
        # fmt: on
        self._log_file = open(self.log_path, "ab")
        self._proc = subprocess.Popen(args, stdout=self._log_file, stderr=subprocess.STDOUT, cwd=self._dir)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while True:
                if self._proc.poll() is not None:
                    self._fail(f"redis-server exited with code {self._proc.returncode} while starting")
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    self._fail(f"redis-server did not answer PING within {self.startup_timeout_s} s")
                time.sleep(0.01)
        finally:
            client.close()

    def _fail(self, message: str) -> None:
        log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        raise RuntimeError(f"{message} (port {self.port}); its log:\n{log[-4000:]}")

    def stop(self) -> None:
        """Terminate the server and wait for it (kill after 5 s). Idempotent."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def restart(self) -> None:
        """Stop, then start again on the same port with empty data (``--save ""``: nothing persists)."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
