"""Reading EndpointSlices and workloads (:mod:`common.cluster.k8s`).

No Kubernetes API server can run on these machines, so these tests run the real ``kubernetes`` client, through
a real kubeconfig file, against a small fake of the API (:mod:`tests.fake_k8s_api`) that answers the reads
the module makes with the API server's JSON. Only the server is fake.
"""

from __future__ import annotations

import pytest

from common.cluster.k8s import (
    EndpointIndex,
    EndpointPort,
    K8sError,
    K8sReader,
    PodEndpoint,
    ServiceEndpoints,
    WorkloadReplicas,
    split_host_port,
)
from tests.fake_k8s_api import FakeK8sApi, endpoint

GRPC = (EndpointPort("grpc", 50061, "TCP"),)


@pytest.fixture
def api():
    with FakeK8sApi() as fake:
        yield fake


@pytest.fixture
def reader(api, tmp_path):
    r = K8sReader.connect(kubeconfig=api.write_kubeconfig(tmp_path / "kubeconfig", namespace="serving"))
    yield r
    r.close()


def pod(name: str, ip: str, *, ready=True, serving=True, terminating=False, ports=GRPC, node="node-a"):
    return PodEndpoint(name, (ip,), ready, serving, terminating, node, ports)


def test_endpoints_of_a_service_across_slices_one_per_pod_with_their_states(api, reader):
    api.set_endpoints("serving", "pdserve-decode", [
        endpoint("decode-2", "10.0.0.3", ready=False, serving=False),  # not yet ready
        endpoint("decode-0", "10.0.0.1", ready=True, serving=True, terminating=False),
        endpoint("decode-1", "10.0.0.2", ready=False, serving=True, terminating=True),  # draining
        endpoint("decode-3", "10.0.0.4", ready=None),  # conditions left out: ready, as the API defines
    ], slices=5)  # fmt: skip
    # 5 slices for 4 endpoints: one slice holds "endpoints": null, as the API server writes an empty one
    api.set_endpoints("serving", "pdserve-prefill", [endpoint("prefill-0", "10.0.1.1")])
    api.set_endpoints("other", "pdserve-decode", [endpoint("decode-9", "10.0.9.9")])

    found = reader.service_endpoints("pdserve-decode")

    assert found == ServiceEndpoints("serving", "pdserve-decode", 5, (
        pod("decode-0", "10.0.0.1"),
        pod("decode-1", "10.0.0.2", ready=False, terminating=True),
        pod("decode-2", "10.0.0.3", ready=False, serving=False),
        pod("decode-3", "10.0.0.4"),
    ))  # fmt: skip
    assert [e.state for e in found.endpoints] == ["ready", "terminating", "not_ready", "ready"]
    assert (found.num_in("ready"), found.num_in("not_ready"), found.num_in("terminating")) == (2, 1, 1)
    assert api.requests == [
        "/apis/discovery.k8s.io/v1/namespaces/serving/endpointslices"
        "?labelSelector=kubernetes.io/service-name%3Dpdserve-decode"
    ]
    assert api.unexpected == []


def test_ready_but_not_serving_is_not_ready(api, reader):
    """A Service with publishNotReadyAddresses lists every endpoint as ready; serving tells the truth."""
    api.set_endpoints("serving", "svc", [endpoint("decode-0", "10.0.0.1", ready=True, serving=False)])
    (only,) = reader.service_endpoints("svc").endpoints
    assert (only.ready, only.serving, only.state) == (True, False, "not_ready")


def test_a_pod_in_two_slices_is_one_endpoint_with_the_cautious_conditions(api, reader):
    api.set_endpoints("serving", "svc", [endpoint("decode-0", "10.0.0.1", ready=True, node=""),
                                         endpoint("decode-0", "fd00::1", ready=False, node="node-b")], slices=2)
    found = reader.service_endpoints("svc")
    assert found.endpoints == (
        PodEndpoint("decode-0", ("10.0.0.1", "fd00::1"), False, True, False, "node-b", GRPC),
    )
    assert found.endpoints[0].to_dict() == {
        "pod": "decode-0", "addresses": ["10.0.0.1", "fd00::1"], "ready": False, "serving": True,
        "terminating": False, "node": "node-b", "ports": [{"name": "grpc", "port": 50061, "protocol": "TCP"}],
        "state": "not_ready",
    }  # fmt: skip


def test_a_service_without_slices_has_no_endpoints(reader):
    assert reader.service_endpoints("nope") == ServiceEndpoints("serving", "nope", 0, ())


def test_workloads_are_those_running_the_pods_the_service_selects(api, reader):
    decode = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": "decode"}
    api.add_service("serving", "pdserve-decode", decode)
    api.add_workload("serving", "statefulsets", "pdserve-decode", labels=decode | {"extra": "x"}, replicas=3,
                     ready_replicas=2)
    api.add_workload("serving", "deployments", "pdserve-decode-canary", labels=decode, replicas=None,
                     ready_replicas=None)  # defaults: 1 desired, none ready
    api.add_workload("serving", "deployments", "pdserve-prefill", replicas=2, ready_replicas=2,
                     labels={"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": "prefill"})
    api.add_workload("other", "deployments", "pdserve-decode", labels=decode, replicas=5, ready_replicas=5)

    assert reader.workloads("pdserve-decode") == [
        WorkloadReplicas("Deployment", "pdserve-decode-canary", 1, 0),
        WorkloadReplicas("StatefulSet", "pdserve-decode", 3, 2),
    ]
    assert api.requests == ["/api/v1/namespaces/serving/services/pdserve-decode",
                            "/apis/apps/v1/namespaces/serving/deployments",
                            "/apis/apps/v1/namespaces/serving/statefulsets"]  # fmt: skip


def test_a_missing_service_is_an_error_naming_it(reader, api):
    with pytest.raises(K8sError) as err:
        reader.workloads("nope")
    assert str(err.value) == (f"cannot read Service 'nope' in namespace 'serving' at {api.url}: "
                              'HTTP 404 Not Found: services "nope" not found')  # fmt: skip


def test_an_api_error_is_one_line_naming_the_read(api, reader):
    api.fail_status = 403
    with pytest.raises(K8sError) as err:
        reader.service_endpoints("pdserve-decode")
    assert str(err.value) == (f"cannot read EndpointSlices of Service 'pdserve-decode' in namespace 'serving' at "
                              f"{api.url}: HTTP 403 Forbidden: injected failure")  # fmt: skip


def test_an_unreachable_server_is_an_error(tmp_path):
    with FakeK8sApi() as gone:
        kubeconfig = gone.write_kubeconfig(tmp_path / "kubeconfig")
    reader = K8sReader.connect(kubeconfig=kubeconfig, timeout_s=1.0)
    with pytest.raises(K8sError) as err:
        reader.service_endpoints("svc")
    message = str(err.value)
    assert message.startswith(f"cannot read EndpointSlices of Service 'svc' in namespace 'default' at {gone.url}: ")
    assert "\n" not in message


def test_the_token_of_the_kubeconfig_is_sent(api, tmp_path):
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    text = (tmp_path / "kubeconfig").read_text().replace("fake-token", "wrong-token")
    (tmp_path / "kubeconfig").write_text(text)
    reader = K8sReader.connect(kubeconfig=kubeconfig)
    with pytest.raises(K8sError, match="HTTP 401 Unauthorized"):
        reader.service_endpoints("svc")


def test_namespace_flag_then_kubeconfig_context_then_default(api, tmp_path, monkeypatch):
    with_ns = api.write_kubeconfig(tmp_path / "a", namespace="serving")
    without = api.write_kubeconfig(tmp_path / "b")
    assert K8sReader.connect(kubeconfig=with_ns).namespace == "serving"
    assert K8sReader.connect(kubeconfig=with_ns, namespace="blue").namespace == "blue"
    assert K8sReader.connect(kubeconfig=without).namespace == "default"
    monkeypatch.setenv("KUBECONFIG", with_ns)  # no file given: $KUBECONFIG
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    reader = K8sReader.connect()
    assert (reader.namespace, reader.server) == ("serving", api.url)


def test_no_usable_configuration_is_an_error(tmp_path, monkeypatch):
    missing = tmp_path / "missing"
    with pytest.raises(K8sError, match=f"^no usable Kubernetes configuration from kubeconfig {missing}: "):
        K8sReader.connect(kubeconfig=str(missing))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")  # "in a pod", but no service account files
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(K8sError, match="^no usable Kubernetes configuration from the pod's service account: "):
        K8sReader.connect()


def test_index_matches_pod_name_first_then_ip_and_port():
    ready = pod("decode-0", "10.0.0.1")
    other = pod("decode-1", "10.0.0.2", terminating=True)
    portless = pod("", "10.0.0.3", ports=())
    index = EndpointIndex([ready, other, portless])
    assert index.find("decode-0", "10.0.0.2:50061") is ready  # the name wins over the address
    assert index.find("worker-a", "10.0.0.2:50061") is other
    assert index.find("worker-a", "10.0.0.2:50062") is None  # not a port of the slice
    assert index.find("worker-a", "10.0.0.3:7000") is portless  # a slice without ports: any port
    assert index.find("worker-a", "decode-1.pdserve-decode:50061") is None
    v6 = pod("", "fd00::5")
    assert EndpointIndex([v6]).find("w", "[fd00::5]:50061") is v6


@pytest.mark.parametrize(("address", "expected"), [
    ("10.0.0.5:50061", ("10.0.0.5", 50061)), ("[fd00::5]:50061", ("fd00::5", 50061)), ("fd00::5", ("fd00::5", None)),
    ("host", ("host", None)), ("host:grpc", ("host", None)), ("pod.svc.cluster.local:1", ("pod.svc.cluster.local", 1)),
])  # fmt: skip
def test_split_host_port(address, expected):
    assert split_host_port(address) == expected
