"""Several hosts on one machine, for tests of what crosses a network between pdserve's services.

Each host is a network namespace (its own interfaces, addresses and ports) whose processes also get their own
hostname, IPC, ``/dev/shm`` and PID namespace: nothing joins two hosts but the network (and the filesystem, which
holds the model and the logs). UCX cannot take a shared-memory or cross-memory-attach shortcut between them, and
pdserve's same-host checks (the hostname) see two hosts. The hosts hang on one bridge in a switch namespace of
their own; the test process reaches them through one more port of that bridge, its own namespace getting the
subnet's first address. Nothing listens outside the private namespaces, and the subnet has no route anywhere else.

    with VirtualHosts(["svc", "p1", "d1"]) as hosts:
        proc = hosts["p1"].popen([sys.executable, "-m", "pdserve", "prefill", "--host", hosts["p1"].ip, ...])
        hosts.partition("d1")      # its port on the bridge goes down: packets to and from it vanish silently
        hosts.heal("d1")

Needs root, iproute2's ``ip`` and util-linux's ``unshare``: :func:`unavailable_reason` says why not.
"""

from __future__ import annotations

import functools
import ipaddress
import itertools
import os
import random
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

_PREFIX = "pdt"  # namespace names: pdt-<creator pid>-<n>-<host>, so a crashed run's leftovers can be told and removed
_NOBODY_MAC = "02:00:00:00:00:01"  # locally administered; no virtual host gets it (the kernel picks random ones)
# What this process's environment may say of its own host that a virtual host's processes must not inherit: the
# NIXL tests put UCX on the loopback device only (os.environ.setdefault at import), where no other host is reached.
HOST_LOCAL_ENV = ("UCX_NET_DEVICES",)
_instances = itertools.count()
MIN_BURST_BYTES = 256 << 10  # of a shaped link (see VirtualHosts.shape): what passes at once before the rate holds


def _ip(*args: str) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


@functools.cache
def unavailable_reason() -> str:
    """'' when network namespaces can be made here, else why not (for test skips)."""
    if os.geteuid() != 0:
        return "virtual hosts need root (network namespaces)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"virtual hosts need {tool} on the PATH"
    name = f"{_PREFIX}-{os.getpid()}-probe"
    try:
        _ip("netns", "add", name)
        try:  # what Host.popen does, with a command that only succeeds
            probe = Host("probe", name, "", "")
            proc = probe.popen(["true"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            _, err = proc.communicate(timeout=30)
            if proc.returncode != 0:
                return f"cannot start a process on a virtual host here: {err.strip()}"
        finally:
            _ip("netns", "del", name)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot make a network namespace here: {exc}"
    return ""


def remove_stale() -> None:
    """Delete the namespaces of earlier runs whose creating process is gone."""
    for line in _ip("netns", "list").splitlines():
        match = re.match(rf"({_PREFIX}-(\d+)-\S+)", line)
        if match and not Path(f"/proc/{match.group(2)}").exists():
            subprocess.run(["ip", "netns", "del", match.group(1)], capture_output=True, timeout=30)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no address of this namespace lies in."""
    taken = [ipaddress.ip_interface(a).network for a in re.findall(r"inet (\S+)", _ip("-4", "addr"))]
    while True:
        net = ipaddress.ip_network(f"10.{random.randrange(100, 255)}.{random.randrange(0, 256)}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net


def parse_rate(rate: str) -> int:
    """Bits per second of a tc rate such as ``"10gbit"``, ``"500mbit"``, ``"64kbit"``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)?bit", rate.strip().lower())
    if not match:
        raise ValueError(f"not a rate: {rate!r} (e.g. 10gbit, 500mbit)")
    return int(float(match.group(1)) * {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)])


class Host:
    """One virtual host: ``name``, its namespace ``netns``, address ``ip`` and ``hostname``."""

    def __init__(self, name: str, netns: str, ip: str, port: str) -> None:
        self.name, self.netns, self.ip, self.hostname = name, netns, ip, f"host-{name}"
        self._port = port  # its interface on the bridge (in the switch namespace)

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on this host (``subprocess.Popen``'s keywords pass through). The process runs as the child of
        an ``unshare`` that holds its namespaces; :func:`inner_pid` finds it for signals (killing the returned
        process kills it too)."""
        if "env" not in kwargs:  # a host of its own: not the loopback-only UCX device that one-host tests set here
            kwargs["env"] = {k: v for k, v in os.environ.items() if k not in HOST_LOCAL_ENV}
        setup = 'hostname "$0" && mount -t tmpfs -o size=1g tmpfs /dev/shm && exec "$@"'
        unshare = ["unshare", "--uts", "--ipc", "--mount", "--pid", "--fork", "--kill-child"]
        argv = ["ip", "netns", "exec", self.netns, *unshare, "sh", "-c", setup, self.hostname, *argv]
        return subprocess.Popen(argv, **kwargs)


def inner_pid(proc: subprocess.Popen, timeout_s: float = 10.0) -> int:
    """The pid (in this namespace) of the command a :meth:`Host.popen` started: ``unshare``'s one child."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        except OSError:
            children = []
        if children:
            return int(children[0])
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no process under unshare {proc.pid} (exit status {proc.returncode})")
        time.sleep(0.05)


def signal_inner(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the command a :meth:`Host.popen` started (``unshare`` itself would die of it and take the
    command down with SIGKILL: no graceful stop)."""
    os.kill(inner_pid(proc), sig)


class VirtualHosts:
    """Hosts on one bridge (see the module's docstring); a context manager that removes everything on exit."""

    def __init__(self, names: Sequence[str]) -> None:
        self._number = next(_instances)  # several sets of hosts may live in one process at once
        self._tag = f"{_PREFIX}-{os.getpid()}-{self._number}"
        self._switch = f"{self._tag}-switch"
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self.hosts: dict[str, Host] = {}
        self._names = list(names)
        self._client_link = ""

    def __enter__(self) -> VirtualHosts:
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def _netns(self, name: str) -> str:
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def _build(self) -> None:
        net = _free_subnet()
        addresses = net.hosts()
        self._netns(self._switch)
        _ip("-n", self._switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self._switch, "link", "set", "br0", "up")
        suffix = f"{os.getpid() % 100000}x{self._number % 1000}"
        # The test process's own port: an address on the subnet in this namespace (interface names <= 15 chars)
        self._client_link = f"pdc{suffix}"
        _ip("link", "add", self._client_link, "type", "veth", "peer", "name", "sw0", "netns", self._switch)
        _ip("addr", "add", f"{next(addresses)}/{net.prefixlen}", "dev", self._client_link)
        _ip("link", "set", self._client_link, "up")
        self._attach("sw0")
        for i, name in enumerate(self._names, start=1):
            netns = self._netns(f"{self._tag}-{name}")
            port = f"sw{i}"
            _ip("-n", netns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self._switch)
            ip = str(next(addresses))
            _ip("-n", netns, "addr", "add", f"{ip}/{net.prefixlen}", "dev", "eth0")
            _ip("-n", netns, "link", "set", "eth0", "up")
            self._attach(port)
            self.hosts[name] = Host(name, netns, ip, port)

    def _attach(self, port: str) -> None:
        _ip("-n", self._switch, "link", "set", port, "master", "br0")
        _ip("-n", self._switch, "link", "set", port, "up")

    def popen(self, host: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """:meth:`Host.popen`, the process then stopped (SIGTERM, then SIGKILL) when the hosts close."""
        proc = self.hosts[host].popen(argv, **kwargs)
        self._procs.append(proc)
        return proc

    def partition(self, host: str) -> None:
        """Cut ``host`` off the network: its port on the bridge goes down, so whatever it or others send to each other
        is dropped without a word (no reset, no error: a silent split, as a failed switch port or cable gives)."""
        _ip("-n", self._switch, "link", "set", self.hosts[host]._port, "down")

    def heal(self, host: str) -> None:
        _ip("-n", self._switch, "link", "set", self.hosts[host]._port, "up")

    def split(self, a: str, b: str) -> None:
        """Cut hosts ``a`` and ``b`` off each other only (both still reach every other host), silently: each one's
        neighbour entry for the other names a MAC no host has, so the bridge floods their frames to no taker."""
        for x, y in ((a, b), (b, a)):
            _ip("-n", self.hosts[x].netns, "neigh", "replace", self.hosts[y].ip, "lladdr", _NOBODY_MAC, "nud",
                "permanent", "dev", "eth0")  # fmt: skip

    def join(self, a: str, b: str) -> None:
        """Undo :meth:`split`."""
        for x, y in ((a, b), (b, a)):
            _ip("-n", self.hosts[x].netns, "neigh", "del", self.hosts[y].ip, "dev", "eth0")

    def shape(self, host: str, rate: str) -> None:
        """Limit ``host``'s link to ``rate`` bits/s each way (``"10gbit"``, ``"500mbit"``; ``""``: unlimited): tc's
        token bucket on its interface and on its port of the bridge, bursts of 10 ms (at least :data:`MIN_BURST_BYTES`:
        veth hands the qdisc segments of up to 64 KiB)."""
        h = self.hosts[host]
        for netns, dev in ((h.netns, "eth0"), (self._switch, h._port)):
            if not rate:
                subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", dev, "root"],
                               capture_output=True, timeout=30)  # fmt: skip
                continue
            burst = max(parse_rate(rate) // 8 // 100, MIN_BURST_BYTES)
            proc = subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                                   "rate", rate, "burst", str(burst), "latency", "100ms"],
                                  capture_output=True, text=True, timeout=30)  # fmt: skip
            if proc.returncode != 0:
                raise RuntimeError(f"tc tbf on {host}: {proc.stderr.strip()}")

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    signal_inner(proc, signal.SIGTERM)
                except (RuntimeError, OSError):
                    proc.kill()
        deadline = time.monotonic() + 5  # then SIGKILL: a draining worker may take its --drain-timeout-s
        for proc in self._procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()  # unshare --kill-child: the command dies with it
                proc.wait(10)
        self._procs.clear()
        if self._client_link:
            subprocess.run(["ip", "link", "del", self._client_link], capture_output=True, timeout=30)
            self._client_link = ""
        for netns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)
        self._namespaces.clear()


# -- a pdserve cluster over virtual hosts -------------------------------------------------------------------

GRPC_PORT, HTTP_PORT, REDIS_PORT = 50051, 8080, 6379  # the same on every host: each has its own ports


def start_pdserve(hosts: VirtualHosts, model_dir: str, workers: dict[str, tuple[str, str, list[str]]], logs: Path,
                  router_args: Sequence[str] = ()) -> dict:  # fmt: skip
    """Redis and the router on host ``svc``; each worker (``worker id -> (role, host, extra flags)``) on its host.
    Returns the addresses: ``redis`` (URL), ``router``, ``http`` (the router's), ``metrics`` (worker id -> its
    HTTP address). Each process writes ``logs/NAME.log``; the hosts stop them when they close. Does not wait."""
    import sys

    svc = hosts["svc"].ip
    redis_url = f"redis://{svc}:{REDIS_PORT}/0"
    repo = Path(__file__).resolve().parents[1]

    def start(host: str, name: str, argv: list[str]) -> None:
        log = open(Path(logs) / f"{name}.log", "w")  # noqa: SIM115 - the process writes it until the hosts close
        hosts.popen(host, argv, stdout=log, stderr=log, cwd=repo)

    start("svc", "redis", ["redis-server", "--bind", svc, "--port", str(REDIS_PORT), "--save", "", "--appendonly",
                           "no", "--protected-mode", "no"])  # fmt: skip
    py = [sys.executable, "-m", "pdserve", "--log-level", "INFO"]
    for worker_id, (role, host, extra) in workers.items():
        start(host, worker_id, [*py, role, "--model", model_dir, "--host", hosts[host].ip, "--port", str(GRPC_PORT),
                                "--metrics-port", str(HTTP_PORT), "--redis-url", redis_url, "--worker-id", worker_id,
                                *extra])  # fmt: skip
    start("svc", "router", [*py, "router", "--model", model_dir, "--host", svc, "--port", str(GRPC_PORT),
                            "--http-port", str(HTTP_PORT), "--redis-url", redis_url, *router_args])  # fmt: skip
    return {"redis": redis_url, "router": f"{svc}:{GRPC_PORT}", "http": f"{svc}:{HTTP_PORT}",
            "metrics": {w: f"{hosts[host].ip}:{HTTP_PORT}" for w, (_, host, _) in workers.items()}}  # fmt: skip


def wait_serving(info: dict, worker_ids, logs: Path, timeout_s: float = 180) -> None:
    """Until every worker of ``worker_ids`` is registered and the router counts each ready (after
    :func:`start_pdserve`); the logs printed and AssertionError if not within ``timeout_s``."""
    from tests.services.probe import metric, wait_for, workers

    try:
        wait_for(lambda: set(workers(info["redis"])) == set(worker_ids), timeout_s, "every worker registered")
        wait_for(lambda: metric(info["http"], "pdserve:workers", state="ready") == len(worker_ids), 60,
                 "the router counts every worker ready")  # fmt: skip
    except AssertionError:
        print_logs(logs)
        raise


def print_logs(logs: Path, tail: int = 3000) -> None:
    for path in sorted(Path(logs).iterdir()):
        print(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
