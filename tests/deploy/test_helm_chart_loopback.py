"""The chart's own command lines run as processes on loopback: what the kubelet would run, minus Kubernetes.

The default values (with API keys, and every port moved to a free one so that the pods fit on one host) are
rendered; then, in order: the init container's command builds the tiny model, the Redis container's command
starts redis-server, the decode, prefill and router containers' commands start the services (with their --config
file from the ConfigMap and their environment from the Secrets), the readiness probes are run as the kubelet runs
them (gRPC health, HTTP GET, exec) until every pod is ready, and then the `helm test` pod's command, both its gRPC
form and its HTTP form (the one rendered with router.publicTls), must generate through the router. Last, SIGTERM
to the decode worker must end it within its grace period. Pod-only paths are mapped into a temporary folder
(/models, /etc/pdserve/..., /data), $(POD_IP) is 127.0.0.1, Service names resolve to 127.0.0.1, and 0.0.0.0 becomes
127.0.0.1: nothing listens beyond loopback."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch.utils.cpp_extension import get_default_build_root

from tests.deploy.render import VALUE_SETS, Rendered, merge, render
from tests.redis_server import free_port

pytest.importorskip("helm_python", reason="helm-python-sdk (pip install -e '.[test]')")

READY_TIMEOUT_S = 180
API_KEY = "loopback-test-key"
SERVICES = ("decode", "prefill", "router")  # start order: the router needs workers to be ready


class Pods:
    """The rendered pods' commands as local processes; ``local(text)`` maps pod paths and names to this host."""

    def __init__(self, r: Rendered, root: Path) -> None:
        self.r, self.root = r, root
        self.procs: dict[str, subprocess.Popen] = {}
        self.pod_names = {"decode": "rel-pdserve-decode-0", "prefill": "rel-pdserve-prefill-6f7d8-x1y2z",
                          "router": "rel-pdserve-router-6f7d8-a1b2c", "redis": "rel-pdserve-redis-0"}
        self.paths = {p: root / p.strip("/").replace("/", "_") for p in
                      ("/models", "/etc/pdserve/config", "/etc/pdserve/auth", "/data", "/tmp")}
        for path in self.paths.values():
            path.mkdir()
        for role in SERVICES:
            config = r.named("ConfigMap", "rel-pdserve-config")["data"][f"{role}.yaml"]
            (self.paths["/etc/pdserve/config"] / f"{role}.yaml").write_text(config)
        (self.paths["/etc/pdserve/auth"] / "api-keys").write_text(r.secret_value("rel-pdserve-auth", "api-keys"))

    def local(self, text: str, component: str = "") -> str:
        text = text.replace("$(POD_IP)", "127.0.0.1").replace("$(POD_NAME)", self.pod_names.get(component, ""))
        text = text.replace("0.0.0.0", "127.0.0.1").replace("redis-server ", "redis-server --bind 127.0.0.1 ")
        text = re.sub(r"\brel-pdserve-(router|redis)\b(?=[:/])", "127.0.0.1", text)
        pod_paths = "|".join(re.escape(p) for p in sorted(self.paths, key=len, reverse=True))
        return re.sub(rf"(?<![\w/])({pod_paths})(?=/|\b)", lambda m: str(self.paths[m[1]]), text)  # one pass

    def env(self, component: str, container: dict) -> dict[str, str]:
        bin_dir = os.path.dirname(sys.executable)  # `pdserve` in a shell line is the venv's
        env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "KUBECONFIG": str(self.root / "no-kubeconfig"),
               "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE", ""),
               # the image's prebuilt CPU kernels (its ENV, not the chart's): here this host's kernel build, else
               # every worker pod would compile its own into its HOME=/tmp (~35 s of the module's setup)
               "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()}
        for e in container.get("env", []):
            if "fieldRef" in e.get("valueFrom", {}):
                continue  # POD_NAME, POD_IP: substituted in the arguments
            env[e["name"]] = self.local(self.r.env_value(container, e["name"]), component)
        return {k: v for k, v in env.items() if v != ""}

    def argv(self, component: str, container: dict) -> list[str]:
        command = container["command"]
        if command == ["pdserve"]:
            command = [sys.executable, "-m", "pdserve"]
        return command + [self.local(a, component) for a in container.get("args", [])]

    def run(self, component: str, container: dict, timeout_s: float) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(component, container), env=self.env(component, container),
                              capture_output=True, text=True, timeout=timeout_s, cwd=self.paths["/tmp"])

    def start(self, component: str, container: dict) -> None:
        log = open(self.root / f"{component}.log", "w")
        self.procs[component] = subprocess.Popen(self.argv(component, container), env=self.env(component, container),
                                                 stdout=log, stderr=subprocess.STDOUT, cwd=self.paths["/tmp"],
                                                 start_new_session=True)  # stop() ends what a `sh -c` started too

    def log(self, component: str) -> str:
        return (self.root / f"{component}.log").read_text()[-3000:]

    def probe(self, component: str, probe: dict) -> bool:
        """One probe, as the kubelet runs it against the pod."""
        timeout_s = probe.get("timeoutSeconds", 1)
        try:
            if "grpc" in probe:
                with grpc.insecure_channel(f"127.0.0.1:{probe['grpc']['port']}") as channel:
                    response = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")), timeout=timeout_s)
                return response.status == health_pb2.HealthCheckResponse.SERVING
            if "httpGet" in probe:
                url = f"http://127.0.0.1:{probe['httpGet']['port']}{probe['httpGet']['path']}"
                with urllib.request.urlopen(url, timeout=timeout_s) as response:
                    return 200 <= response.status < 400
            if "exec" in probe:
                container = self.r.container(component)
                argv = [self.local(a, component) for a in probe["exec"]["command"]]
                return subprocess.run(argv, env=self.env(component, container), capture_output=True,
                                      timeout=10).returncode == 0
            with socket.create_connection(("127.0.0.1", probe["tcpSocket"]["port"]), timeout=timeout_s):
                return True
        except (OSError, grpc.RpcError, subprocess.TimeoutExpired):
            return False

    def wait_ready(self, component: str) -> None:
        probe = self.r.container(component)["readinessProbe"]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.probe(component, probe):
            proc = self.procs[component]
            assert proc.poll() is None, f"{component} exited {proc.returncode}:\n{self.log(component)}"
            assert time.monotonic() < deadline, f"{component} not ready in {READY_TIMEOUT_S} s:\n{self.log(component)}"
            time.sleep(0.2)

    def stop(self) -> None:
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
            _signal_group(proc, signal.SIGKILL)  # a child left behind by a shell that already exited


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to the process group of ``proc`` (started with ``start_new_session``); gone already: nothing."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def loopback_values() -> dict:
    """The default values with API keys on and every port a free one (the pods share this host)."""
    p = {name: free_port() for name in ("router", "router_http", "prefill", "prefill_metrics", "decode",
                                        "decode_metrics", "redis")}
    return merge(VALUE_SETS["default"], {
        "auth": {"apiKeys": [API_KEY]},
        "redis": {"port": p["redis"]},
        "router": {"grpcPort": p["router"], "httpPort": p["router_http"],
                   "service": {"grpcPort": p["router"], "httpPort": p["router_http"]}},
        "prefill": {"grpcPort": p["prefill"], "metricsPort": p["prefill_metrics"]},
        "decode": {"grpcPort": p["decode"], "metricsPort": p["decode_metrics"]},
    })


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed")
    values = loopback_values()
    r = render(values)
    pods = Pods(r, tmp_path_factory.mktemp("loopback"))
    try:
        _, router_spec = r.pod_of("router")
        (init,) = router_spec["initContainers"]
        built = pods.run("router", init, timeout_s=300)  # every pod's init container builds the same model
        assert built.returncode == 0, built.stdout + built.stderr
        pods.start("redis", r.container("redis"))
        pods.wait_ready("redis")
        for role in SERVICES:
            pods.start(role, r.container(role))
        for role in SERVICES:
            pods.wait_ready(role)
        yield pods
    finally:
        pods.stop()


def test_every_probe_passes_against_the_running_services(pods):
    for component in ("redis",) + SERVICES:
        container = pods.r.container(component)
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert pods.probe(component, container[kind]), (component, kind, pods.log(component))


def test_the_helm_test_pod_generates_through_the_router_with_the_api_key(pods):
    (test,) = pods.r.named("Pod", "rel-pdserve-test-generate")["spec"]["containers"]
    assert test["command"] == ["sh", "-c"]  # the gRPC form with the first key of the mounted key file
    result = pods.run("test", test, timeout_s=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip(), "no text generated"


def test_the_http_form_of_the_helm_test_pod_generates_too(pods):
    """With router.publicTls the test pod uses the plaintext HTTP front: its script, run against this router."""
    tls_values = merge(pods.r.values, {"router": {"publicTls": {"enabled": True, "existingSecret": "public-cert"}}})
    (test,) = render(tls_values).named("Pod", "rel-pdserve-test-generate")["spec"]["containers"]
    assert test["command"] == ["python", "-c"]
    result = pods.run("test", {**test, "command": [sys.executable, "-c"]}, timeout_s=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip(), "no text generated"


def test_a_request_without_the_key_is_refused(pods):
    (test,) = pods.r.named("Pod", "rel-pdserve-test-generate")["spec"]["containers"]
    unauthenticated = {**test, "args": [test["args"][0].replace("/auth/api-keys", "/auth/missing")]}
    result = pods.run("test", unauthenticated, timeout_s=120)
    assert result.returncode != 0 and "UNAUTHENTICATED" in result.stderr, result.stdout + result.stderr


def test_sigterm_ends_a_worker_within_its_grace_period(pods):
    _, spec = pods.r.pod_of("decode")
    grace_s = spec["terminationGracePeriodSeconds"]
    proc = pods.procs["decode"]
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=grace_s) == 0, pods.log("decode")
    assert time.monotonic() - start < grace_s
    assert "draining" in pods.log("decode")


@pytest.mark.parametrize("password", ['p@ss "word" \\/1', None], ids=["password", "no-auth"])
def test_the_bundled_redis_command_runs_a_real_redis_that_the_rendered_url_reaches(password, tmp_path):
    """The Redis container's own command line (its /data a temp folder), run with a local redis-server: the URL the
    services get authenticates, the readiness probe's command passes, a client without the password is refused."""
    redis = pytest.importorskip("redis")
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("redis-server and redis-cli are not installed")
    port = free_port()
    auth = {"enabled": True, "password": password} if password else {"enabled": False}
    r = render(merge(VALUE_SETS["default"], {"redis": {"port": port, "auth": auth}}))
    c = r.container("redis")
    assert c["command"] == ["sh", "-c"] and " --dir /data " in c["args"][0]
    env = {"PATH": os.environ["PATH"], **{e["name"]: r.env_value(c, e["name"]) for e in c.get("env", [])}}
    line = c["args"][0].replace("--dir /data", f"--dir {tmp_path}")
    line = line.replace("redis-server ", "redis-server --bind 127.0.0.1 ")  # a test's server: loopback only
    proc = subprocess.Popen(["sh", "-c", line], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # the pipe keeps `sh` as redis-server's parent: end the group
    try:
        url = r.env_value(r.container("router"), "PDSERVE_REDIS_URL").replace("@rel-pdserve-redis:", "@127.0.0.1:")
        url = url.replace("//rel-pdserve-redis:", "//127.0.0.1:")
        client = redis.Redis.from_url(url, socket_timeout=2)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert client.ping() is True
                break
            except redis.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
                time.sleep(0.05)
        probe = subprocess.run(c["readinessProbe"]["exec"]["command"], env=env, timeout=10)
        assert probe.returncode == 0
        if password:
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(port=port, socket_timeout=2).ping()
            assert redis.Redis(port=port, password=password, socket_timeout=2).ping() is True
    finally:
        _signal_group(proc, signal.SIGTERM)
        proc.wait(timeout=10)
        _signal_group(proc, signal.SIGKILL)
