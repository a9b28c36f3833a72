"""``pdserve status --k8s``: the pools' EndpointSlices and replicas, merged with the Redis registry.

No Kubernetes API server can run on these machines, so the command runs the real ``kubernetes`` client, through
a real kubeconfig file, against a small fake of the API (:mod:`tests.fake_k8s_api`: EndpointSlices, Services,
Deployments, StatefulSets); the registry is a real redis-server.
"""

from __future__ import annotations

import json

import pytest

from common.state.redis_client import connect
from common.state.registry import WorkerRegistry
from tests.cli import pdserve
from tests.fake_k8s_api import FakeK8sApi, endpoint
from tests.pdserve.test_cli_status import make_info, run_in_process
from tests.redis_server import RedisServer

NS = "serving"
DECODE_LABELS = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": "decode"}


@pytest.fixture(autouse=True)
def no_ambient_settings(monkeypatch):
    for var in ("PDSERVE_REDIS_URL", "PDSERVE_K8S_NAMESPACE", "PDSERVE_K8S_PREFILL_SERVICE",
                "PDSERVE_K8S_DECODE_SERVICE", "KUBERNETES_SERVICE_HOST"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def api():
    """Prefill: one ready pod, one not ready, and no Service object (so no replicas). Decode: a StatefulSet of 3
    with 2 ready; pods ready, terminating, and ready but unregistered."""
    with FakeK8sApi() as fake:
        fake.set_endpoints(NS, "pdserve-prefill", [endpoint("prefill-0", "10.0.1.1"),
                                                   endpoint("prefill-1", "10.0.1.2", ready=False, serving=False)])
        fake.set_endpoints(NS, "pdserve-decode", [
            endpoint("decode-0", "10.0.0.1", node="node-b"),
            endpoint("decode-1", "10.0.0.2", ready=False, serving=True, terminating=True, node="node-b"),
            endpoint("decode-2", "10.0.0.3"),
        ], slices=2)  # fmt: skip
        fake.add_service(NS, "pdserve-decode", DECODE_LABELS)
        fake.add_workload(NS, "statefulsets", "pdserve-decode", labels=DECODE_LABELS, replicas=3, ready_replicas=2)
        yield fake


@pytest.fixture
def kubeconfig(api, tmp_path):
    return api.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


@pytest.fixture
def registered(redis_url):
    """prefill-0, decode-0 and decode-1 on their pods (by name); w-7 and decode-x (at 127.0.0.1) on none."""
    client = connect(redis_url)
    client.flushdb()
    registry = WorkerRegistry(client, ttl_s=60.0)
    for info in (make_info("prefill-0", "prefill", 50061), make_info("w-7", "prefill", 50061),
                 make_info("decode-0", "decode", 50061), make_info("decode-1", "decode", 50061),
                 make_info("decode-x", "decode", 1)):  # fmt: skip
        registry.register(info)
    client.close()


def test_text_merged_with_the_registry(api, kubeconfig, redis_url, registered, capsys):
    assert run_in_process("--k8s", "--kubeconfig", kubeconfig, "--redis-url", redis_url) == 0
    table, prefill, decode = capsys.readouterr().out.rstrip("\n").split("\n\n")
    assert [line.split()[:2] for line in table.splitlines()[1:]] == [
        ["decode", "decode-0"], ["decode", "decode-1"], ["decode", "decode-x"], ["prefill", "prefill-0"],
        ["prefill", "w-7"],
    ]  # the registry table, as without --k8s
    assert prefill.splitlines() == [
        "prefill pool: Service 'pdserve-prefill' in namespace 'serving': 1 ready, 1 not ready, 0 terminating",
        f"  replicas unknown: cannot read Service 'pdserve-prefill' in namespace 'serving' at {api.url}: HTTP 404 "
        'Not Found: services "pdserve-prefill" not found',
        "  POD        ADDRESS   STATE      NODE    WORKER",
        "  prefill-0  10.0.1.1  ready      node-a  prefill-0",
        "  prefill-1  10.0.1.2  not_ready  node-a  -",
        "  registered but on no endpoint: w-7",
    ]  # make_info's address is 127.0.0.1:PORT, so w-7 is on no pod
    assert decode.splitlines() == [
        "decode pool: Service 'pdserve-decode' in namespace 'serving': 2 ready, 0 not ready, 1 terminating",
        "  StatefulSet pdserve-decode: 3 desired, 2 ready",
        "  POD       ADDRESS   STATE        NODE    WORKER",
        "  decode-0  10.0.0.1  ready        node-b  decode-0",
        "  decode-1  10.0.0.2  terminating  node-b  decode-1",
        "  decode-2  10.0.0.3  ready        node-a  -",
        "  registered but on no endpoint: decode-x",
    ]
    assert api.unexpected == []


def test_a_worker_is_matched_by_ip_and_port_too(api, kubeconfig, redis_url, registered, capsys):
    WorkerRegistry(connect(redis_url), ttl_s=60.0).register(make_info("w-7", "prefill", 0, address="10.0.1.2:50061"))
    assert run_in_process("--k8s", "--json", "--kubeconfig", kubeconfig, "--redis-url", redis_url) == 0
    prefill = json.loads(capsys.readouterr().out)["k8s"]["pools"]["prefill"]
    assert [(e["pod"], e["worker_id"]) for e in prefill["endpoints"]] == [("prefill-0", "prefill-0"),
                                                                          ("prefill-1", "w-7")]  # fmt: skip
    assert prefill["unmatched_workers"] == []


def test_json_merged_with_the_registry(api, kubeconfig, redis_url, registered, capsys):
    assert run_in_process("--k8s", "--json", "--kubeconfig", kubeconfig, "--redis-url", redis_url) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    shown = json.loads(out)
    assert list(shown) == ["workers", "k8s"]
    assert [w["id"] for w in shown["workers"]] == ["decode-0", "decode-1", "decode-x", "prefill-0", "w-7"]
    grpc = [{"name": "grpc", "port": 50061, "protocol": "TCP"}]

    def ep(pod, ip, state, worker_id, node="node-a", ready=True, serving=True, terminating=False):
        return {"pod": pod, "addresses": [ip], "ready": ready, "serving": serving, "terminating": terminating,
                "node": node, "ports": grpc, "state": state, "worker_id": worker_id}

    assert shown["k8s"] == {
        "namespace": "serving",
        "server": api.url,
        "pools": {
            "prefill": {
                "service": "pdserve-prefill", "num_slices": 1, "num_ready": 1, "num_not_ready": 1,
                "num_terminating": 0,
                "endpoints": [ep("prefill-0", "10.0.1.1", "ready", "prefill-0"),
                              ep("prefill-1", "10.0.1.2", "not_ready", None, ready=False, serving=False)],
                "workloads": None,
                "workloads_error": f"cannot read Service 'pdserve-prefill' in namespace 'serving' at {api.url}: "
                                   'HTTP 404 Not Found: services "pdserve-prefill" not found',
                "unmatched_workers": ["w-7"],
            },
            "decode": {
                "service": "pdserve-decode", "num_slices": 2, "num_ready": 2, "num_not_ready": 0,
                "num_terminating": 1,
                "endpoints": [ep("decode-0", "10.0.0.1", "ready", "decode-0", node="node-b"),
                              ep("decode-1", "10.0.0.2", "terminating", "decode-1", node="node-b", ready=False,
                                 terminating=True),
                              ep("decode-2", "10.0.0.3", "ready", None)],
                "workloads": [{"kind": "StatefulSet", "name": "pdserve-decode", "desired_replicas": 3,
                               "ready_replicas": 2}],
                "workloads_error": None,
                "unmatched_workers": ["decode-x"],
            },
        },
    }  # fmt: skip


def test_without_a_redis_url_only_kubernetes_is_read(api, kubeconfig, capsys):
    assert run_in_process("--k8s", "--json", "--kubeconfig", kubeconfig) == 0
    shown = json.loads(capsys.readouterr().out)
    assert list(shown) == ["k8s"]
    decode = shown["k8s"]["pools"]["decode"]
    assert [e["worker_id"] for e in decode["endpoints"]] == [None, None, None]
    assert decode["unmatched_workers"] is None
    assert run_in_process("--k8s", "--kubeconfig", kubeconfig) == 0
    out = capsys.readouterr().out
    assert out.startswith("prefill pool: ")
    assert "  decode-2  10.0.0.3  ready        node-a  ?\n" in out  # the registry was not read


def test_service_names_and_namespace_from_flags_and_environment(api, kubeconfig, monkeypatch, capsys):
    api.set_endpoints("blue", "p", [endpoint("p-0", "10.1.0.1")])
    api.set_endpoints("blue", "d", [])
    monkeypatch.setenv("PDSERVE_K8S_DECODE_SERVICE", "d")
    assert run_in_process("--k8s", "--json", "--kubeconfig", kubeconfig, "--namespace", "blue",
                          "--prefill-service", "p") == 0  # fmt: skip
    shown = json.loads(capsys.readouterr().out)["k8s"]
    assert shown["namespace"] == "blue"
    assert [(role, pool["service"], pool["num_slices"], [e["pod"] for e in pool["endpoints"]])
            for role, pool in shown["pools"].items()] == [("prefill", "p", 1, ["p-0"]), ("decode", "d", 1, [])]


def test_an_api_failure_is_one_line_and_exit_1(api, kubeconfig, capsys):
    api.fail_status = 403
    assert run_in_process("--k8s", "--json", "--kubeconfig", kubeconfig) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"pdserve status: error: cannot read EndpointSlices of Service 'pdserve-prefill' in "
                            f"namespace 'serving' at {api.url}: HTTP 403 Forbidden: injected failure\n")  # fmt: skip


def test_no_kubeconfig_is_one_line_and_exit_1(tmp_path, capsys):
    assert run_in_process("--k8s", "--kubeconfig", str(tmp_path / "missing")) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve status: error: no usable Kubernetes configuration from kubeconfig "
                          f"{tmp_path / 'missing'}: ") and err.count("\n") == 1  # fmt: skip


def test_cli_json(api, kubeconfig, redis_url, registered):
    proc = pdserve("status", "--k8s", "--json", "--kubeconfig", kubeconfig, "--redis-url", redis_url, timeout_s=60)
    shown = json.loads(proc.stdout)
    assert [w["id"] for w in shown["workers"]] == ["decode-0", "decode-1", "decode-x", "prefill-0", "w-7"]
    assert [(e["pod"], e["state"], e["worker_id"]) for e in shown["k8s"]["pools"]["decode"]["endpoints"]] == [
        ("decode-0", "ready", "decode-0"), ("decode-1", "terminating", "decode-1"), ("decode-2", "ready", None)]
