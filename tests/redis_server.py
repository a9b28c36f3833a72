"""A real ``redis-server`` for tests: on a free loopback port, no persistence, its own temp directory.

    with RedisServer() as server:
        client = connect(server.url)
        ...
        server.restart()  # same port, empty data

    with RedisServer(password="s3cret", tls=True) as server:   # requirepass, and TLS only (no plain port)
        client = connect(server.url)   # rediss://:s3cret@127.0.0.1:PORT/0?ssl_ca_certs=/tmp/.../ca.pem

Never uses the default port 6379, so a developer's own Redis is never touched. With ``tls=True`` the server
listens only for TLS, with a throwaway CA and server certificate (:mod:`tests.tls_certs`) that clients trust
through the URL's ``ssl_ca_certs`` query parameter; clients need no certificate of their own.
"""

from __future__ import annotations

import functools
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
from pathlib import Path

import redis

from tests.tls_certs import ServerCertFiles, write_test_certs

DEFAULT_REDIS_PORT = 6379


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it; never 6379)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != DEFAULT_REDIS_PORT:
            return port


TLS_UNSUPPORTED = "redis-server on this machine was built without TLS support (BUILD_TLS=no)"


@functools.cache
def tls_supported(executable: str = "redis-server") -> bool:
    """Whether ``executable`` accepts the ``tls-port`` directive (a build with TLS), asked without listening:
    with ``--port 0 --tls-port 0`` a TLS build exits at once ("not listen anywhere"), others reject the flag."""
    path = shutil.which(executable)
    if path is None:
        return False
    proc = subprocess.run([path, "--port", "0", "--tls-port", "0", "--save", ""], capture_output=True, text=True,
                          timeout=10)
    return "Bad directive" not in proc.stdout + proc.stderr


class RedisServer:
    """One ``redis-server`` process from the PATH; ``start()`` on entering the context, ``stop()`` on exit."""

    def __init__(self, *, startup_timeout_s: float = 10.0, executable: str = "redis-server",
                 password: str | None = None, tls: bool = False) -> None:
        """``password``: ``requirepass`` (clients must AUTH). ``tls``: TLS only on ``port`` (see the module
        docstring); a ``redis-server`` built without TLS then fails :meth:`start` with its log."""
        path = shutil.which(executable)
        if path is None:
            raise RuntimeError(f"{executable!r} is not on the PATH; install Redis to run these tests")
        self.executable = path
        self.startup_timeout_s = startup_timeout_s
        self.password, self.tls = password, tls
        self.port = free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
        self.tls_files: ServerCertFiles | None = write_test_certs(self._dir) if tls else None
        self._proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def url(self) -> str:
        """The URL clients connect with: the password and, with TLS, ``rediss://`` and the CA included."""
        return self.url_with(password=self.password)

    def url_with(self, *, password: str | None) -> str:
        """:attr:`url` with another password (None: none), e.g. to check that a wrong one is refused."""
        auth = "" if password is None else f":{urllib.parse.quote(password, safe='')}@"
        if self.tls_files is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        ca = urllib.parse.quote(str(self.tls_files.ca_cert))
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={ca}"

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
        port = str(self.port)
        listen = ["--port", port] if self.tls_files is None else ["--port", "0", "--tls-port", port]  # TLS only
        # fmt: off
        args = [
            self.executable, *listen, "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(self._dir), "--daemonize", "no",
            # SIGTERM is acted on in the server's cron, which runs hz times a second: 100 (default 10)
            # makes stop() take ~10 ms instead of ~100 ms.
            "--hz", "100",
        ]
        # fmt: on
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.tls_files is not None:
            f = self.tls_files
            args += ["--tls-cert-file", str(f.server_cert), "--tls-key-file", str(f.server_key),
                     "--tls-ca-cert-file", str(f.ca_cert), "--tls-auth-clients", "no"]
        self._log_file = open(self.log_path, "ab")
        self._proc = subprocess.Popen(args, stdout=self._log_file, stderr=subprocess.STDOUT, cwd=self._dir)
        client = redis.Redis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5)
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
