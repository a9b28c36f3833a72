"""The router's Kubernetes discovery (:mod:`services.router.k8s_discovery`): EndpointSlices veto registry workers.

No Kubernetes API server can run on these machines, so these tests run the real ``kubernetes`` client, through
a real kubeconfig file, against a small fake of the EndpointSlice API (:mod:`tests.fake_k8s_api`); the Redis
registry is a real redis-server, and the last test a whole in-process cluster.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

import pytest

from common.cluster.k8s import K8sReader
from common.state.redis_client import connect
from common.state.registry import WorkerInfo, WorkerRegistry
from pdserve.client import Client
from services.router.config import RouterConfig
from services.router.k8s_discovery import K8sDiscovery
from services.router.registry_view import RegistryView
from tests.fake_k8s_api import FakeK8sApi, endpoint
from tests.redis_server import RedisServer
from tests.services.inprocess import inprocess_cluster
from tests.services.probe import wait_for

NS = "serving"


def info(worker_id: str, role: str = "decode", address: str = "10.0.0.1:50061") -> WorkerInfo:
    return WorkerInfo(id=worker_id, role=role, address=address, host="h", pid=1, model="m", version="v",
                      num_requests_running=0, num_requests_waiting=0, kv_blocks_used=0, kv_blocks_total=8)


@pytest.fixture
def api():
    with FakeK8sApi() as fake:
        yield fake


@pytest.fixture
def kubeconfig(api, tmp_path):
    return api.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)


@pytest.fixture
def discovery(kubeconfig):
    d = K8sDiscovery(K8sReader.connect(kubeconfig=kubeconfig), {"decode": "pdserve-decode"}, refresh_s=60.0)
    yield d
    d.stop()


def test_not_ready_and_terminating_pods_are_vetoed_the_rest_routes(api, discovery):
    api.set_endpoints(NS, "pdserve-decode", [
        endpoint("decode-0", "10.0.0.1"),
        endpoint("decode-1", "10.0.0.2", ready=False, serving=True, terminating=True),
        endpoint("decode-2", "10.0.0.3", ready=False, serving=False),
        endpoint("decode-3", "10.0.0.4"),
    ])  # fmt: skip
    registered = [
        info("decode-0", address="10.0.0.1:50061"),
        info("decode-1", address="10.0.0.2:50061"),
        info("worker-x", address="10.0.0.3:50061"),  # no pod of that name: matched by IP:port to decode-2
        info("decode-9", address="10.0.9.9:50061"),  # on no endpoint: kept (the slices can only take away)
        info("decode-1", role="prefill"),  # an unwatched role: kept, though a decode pod shares its name
    ]
    discovery.start(lambda: registered)
    assert discovery.up
    assert [discovery.routable(w) for w in registered] == [True, False, False, True, True]
    assert discovery.details() == {"k8s": "ok", "k8s_excluded": ["decode-1", "worker-x"],
                                   "k8s_unregistered": ["decode/decode-3"]}  # fmt: skip


def test_an_api_failure_falls_back_to_the_registry_alone_logged_once(api, discovery, caplog):
    api.set_endpoints(NS, "pdserve-decode", [endpoint("decode-0", "10.0.0.1", terminating=True)])
    worker = info("decode-0")
    discovery.start(lambda: [worker])
    assert not discovery.routable(worker)
    api.fail_status = 503
    with caplog.at_level(logging.WARNING, logger="services.router.k8s_discovery"):
        assert not discovery.refresh() and not discovery.refresh()
    assert discovery.routable(worker) and not discovery.up
    assert discovery.details() == {"k8s": "unreachable", "k8s_excluded": [], "k8s_unregistered": []}
    failures = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert failures == [
        "Kubernetes discovery failed; routing on the Redis registry alone until it answers: cannot read "
        f"EndpointSlices of Service 'pdserve-decode' in namespace 'serving' at {api.url}: HTTP 503 Service "
        "Unavailable: injected failure"
    ]
    api.fail_status = None
    assert discovery.refresh() and discovery.up and not discovery.routable(worker)


def test_the_registry_view_filters_with_the_discovery(api, discovery):
    api.set_endpoints(NS, "pdserve-decode", [endpoint("decode-0", "10.0.0.1"),
                                             endpoint("decode-1", "10.0.0.2", ready=False, terminating=True)])
    with RedisServer() as redis:
        registry = WorkerRegistry(connect(redis.url), ttl_s=30.0)
        for w in (info("decode-0"), info("decode-1", address="10.0.0.2:50061"), info("prefill-0", "prefill")):
            registry.register(w)
        view = RegistryView(registry, routable=discovery.routable)
        assert view.refresh()
        discovery.start(view.all_workers)
        assert [w.id for w in view.workers()] == ["decode-0", "prefill-0"]
        assert [w.id for w in view.workers("decode")] == ["decode-0"]
        assert [w.id for w in view.all_workers()] == ["decode-0", "decode-1", "prefill-0"]  # metrics see all
        api.set_endpoints(NS, "pdserve-decode", [endpoint("decode-0", "10.0.0.1", ready=False),
                                                 endpoint("decode-1", "10.0.0.2")])
        assert discovery.refresh()  # takes effect at once, without a registry read
        assert [w.id for w in view.workers("decode")] == ["decode-1"]


def test_from_config(kubeconfig, tmp_path, caplog):
    assert K8sDiscovery.from_config(RouterConfig(k8s_namespace=NS, k8s_kubeconfig=kubeconfig)) is None  # off
    on = K8sDiscovery.from_config(RouterConfig(k8s_decode_service="d", k8s_prefill_service="p",
                                               k8s_kubeconfig=kubeconfig, k8s_refresh_s=0.5))  # fmt: skip
    assert (on.services, on.reader.namespace, on.refresh_s) == ({"prefill": "p", "decode": "d"}, NS, 0.5)
    on.stop()
    missing = tmp_path / "missing"
    with caplog.at_level(logging.ERROR, logger="services.router.k8s_discovery"):
        assert K8sDiscovery.from_config(RouterConfig(k8s_decode_service="d", k8s_kubeconfig=str(missing))) is None
    assert [r.getMessage() for r in caplog.records][-1].startswith(
        f"Kubernetes discovery off, routing on the Redis registry alone: no usable Kubernetes configuration from "
        f"kubeconfig {missing}: "
    )
    with pytest.raises(ValueError, match="k8s refresh_s must be a positive number of seconds, got 0.0"):
        K8sDiscovery.from_config(RouterConfig(k8s_decode_service="d", k8s_kubeconfig=kubeconfig, k8s_refresh_s=0.0))


def readyz(address: str) -> dict:
    try:
        with urllib.request.urlopen(f"http://{address}/readyz", timeout=10) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


def test_the_router_sends_no_request_to_a_terminating_decode_pod(api, kubeconfig, tiny_model_dir):
    api.set_endpoints(NS, "pdserve-decode", [endpoint("decode-0", "10.0.0.1", ready=False, terminating=True),
                                             endpoint("decode-1", "10.0.0.2")])
    router = {"k8s_decode_service": "pdserve-decode", "k8s_kubeconfig": kubeconfig, "k8s_refresh_s": 0.2}
    with inprocess_cluster(tiny_model_dir("llama"), prefill=[{"worker_id": "prefill-0"}],
                           decode=[{"worker_id": "decode-0"}, {"worker_id": "decode-1"}], router=router) as cluster:
        ready = readyz(cluster.router_http)
        assert (ready["status"], ready["decode_workers"], ready["k8s"]) == ("ready", 1, "ok")
        assert (ready["k8s_excluded"], ready["k8s_unregistered"]) == (["decode-0"], [])
        with Client(cluster.router, timeout_s=60) as client:
            for _ in range(2):  # round robin would send one of the two to decode-0
                assert client.generate([5, 6, 7], max_tokens=2, ignore_eos=True).decode_worker_id == "decode-1"
            api.set_endpoints(NS, "pdserve-decode", [endpoint("decode-0", "10.0.0.1"),
                                                     endpoint("decode-1", "10.0.0.2", terminating=True)])
            wait_for(lambda: readyz(cluster.router_http)["k8s_excluded"] == ["decode-1"], 10, "decode-1 vetoed")
            assert client.generate([5, 6, 7], max_tokens=2, ignore_eos=True).decode_worker_id == "decode-0"
    assert api.unexpected == []
