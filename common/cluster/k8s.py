"""The cluster's own view of the worker pools, read from the Kubernetes API: EndpointSlices and workloads.

What :class:`K8sReader` reads (``get``/``list`` in one namespace; the RBAC a reader needs):

- the EndpointSlices (``discovery.k8s.io/v1``) of a Service, by the label ``kubernetes.io/service-name=<name>``
  that the EndpointSlice controller puts on every slice it manages: :meth:`K8sReader.service_endpoints`;
- the Service (``v1``) and the Deployments and StatefulSets (``apps/v1``) whose pod template carries every
  label of the Service's selector: :meth:`K8sReader.workloads` (desired and ready replicas).

What an endpoint's conditions mean here (:attr:`PodEndpoint.state`): ``terminating`` when the API says so (the
pod is being deleted; it drains and must get no new request); else ``ready`` when it is both ready and serving
(a missing condition counts as true for both, as the API defines; requiring serving too keeps a Service with
``publishNotReadyAddresses``, whose endpoints are all "ready", honest); else ``not_ready``. A pod listed in
several slices (dual-stack, a slice being split) is one endpoint holding the addresses of all; a condition the
slices disagree on takes the cautious value (not ready, terminating).

Which endpoint is a registry worker's pod (:class:`EndpointIndex`): the endpoint whose pod name is the worker's
id (the chart runs workers with ``--worker-id $(POD_NAME)``); else the endpoint one of whose addresses, with one
of its ports (any port when its slice defines none), is the worker's registry address ``host:port``; else none.

Connection (:meth:`K8sReader.connect`): the kubeconfig file when one is given; else the pod's service account
when running in a pod (``$KUBERNETES_SERVICE_HOST``); else ``$KUBECONFIG`` or ``~/.kube/config``. The
namespace when none is given: the pod's own, else the kubeconfig context's, else ``default``.

The ``kubernetes`` package (about a second to import) is imported only when a reader is built, so importing
this module is cheap. Every read blocks for one HTTP round trip per object kind (at most ``timeout_s`` each) and
raises :class:`K8sError` naming what it read and why it failed. Nothing is cached; nothing is global.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
ENDPOINT_STATES = ("ready", "not_ready", "terminating")
IN_CLUSTER_ENV = "KUBERNETES_SERVICE_HOST"
_POD_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class K8sError(Exception):
    """A Kubernetes API read failed: no usable configuration, the server unreachable, or an error status."""


@dataclass(frozen=True)
class EndpointPort:
    name: str
    port: int | None  # None: every port of the address
    protocol: str  # TCP | UDP | SCTP


@dataclass(frozen=True)
class PodEndpoint:
    """One endpoint of a Service: a pod, where it listens, and its conditions as the API reports them."""

    pod: str  # targetRef.name; "" when the endpoint names no object
    addresses: tuple[str, ...]  # IPs
    ready: bool
    serving: bool
    terminating: bool
    node: str  # "" when not reported
    ports: tuple[EndpointPort, ...]  # of its slice(s); empty: none defined

    @property
    def state(self) -> str:
        """One of ENDPOINT_STATES (see the module docstring)."""
        if self.terminating:
            return "terminating"
        return "ready" if self.ready and self.serving else "not_ready"

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable: every field (tuples as lists), plus ``state``."""
        return {**asdict(self), "addresses": list(self.addresses), "ports": [asdict(p) for p in self.ports],
                "state": self.state}  # fmt: skip


@dataclass(frozen=True)
class ServiceEndpoints:
    """Every endpoint of one Service's EndpointSlices, one per pod, sorted by pod name then address."""

    namespace: str
    service: str
    num_slices: int  # 0: the Service has no EndpointSlices (no such Service, or no selector)
    endpoints: tuple[PodEndpoint, ...]

    def num_in(self, state: str) -> int:
        if state not in ENDPOINT_STATES:
            raise ValueError(f"endpoint state must be one of {ENDPOINT_STATES}, got {state!r}")
        return sum(1 for e in self.endpoints if e.state == state)


@dataclass(frozen=True)
class WorkloadReplicas:
    kind: str  # Deployment | StatefulSet
    name: str
    desired_replicas: int  # spec.replicas (the API's default, 1, when unset)
    ready_replicas: int  # status.readyReplicas (0 when unset)


def split_host_port(address: str) -> tuple[str, int | None]:
    """``"10.0.0.5:50061"`` → ``("10.0.0.5", 50061)``; ``"[fd00::5]:50061"`` → ``("fd00::5", 50061)``; a missing
    or non-numeric port is None."""
    host, sep, port = address.rpartition(":")
    if not sep or (host.count(":") and not host.startswith("[")):  # no port, or a bare IPv6 address
        return address.strip("[]"), None
    return host.strip("[]"), int(port) if port.isdigit() else None


class EndpointIndex:
    """Finds a registry worker's pod among one pool's endpoints, by the module's rule. Immutable; :meth:`find`
    is two or three dict lookups, cheap enough for every routing decision."""

    def __init__(self, endpoints: Iterable[PodEndpoint]) -> None:
        self._by_pod: dict[str, PodEndpoint] = {}
        self._by_address: dict[tuple[str, int], PodEndpoint] = {}
        self._by_ip: dict[str, PodEndpoint] = {}  # endpoints whose slice defines no port: any port matches
        for e in endpoints:
            if e.pod:
                self._by_pod.setdefault(e.pod, e)
            numbered = [p.port for p in e.ports if p.port is not None]
            for ip in e.addresses:
                if numbered and len(numbered) == len(e.ports):
                    for port in numbered:
                        self._by_address.setdefault((ip, port), e)
                else:
                    self._by_ip.setdefault(ip, e)

    def find(self, worker_id: str, address: str) -> PodEndpoint | None:
        """The endpoint of the worker with this registry id and ``host:port`` address, or None."""
        found = self._by_pod.get(worker_id)
        if found is not None:
            return found
        host, port = split_host_port(address)
        return (self._by_address.get((host, port)) if port is not None else None) or self._by_ip.get(host)


def merge_slices(namespace: str, service: str, slices: Iterable[Any]) -> ServiceEndpoints:
    """Build :class:`ServiceEndpoints` from the client's ``V1EndpointSlice`` objects (any object with the same
    attributes): one endpoint per pod across slices, as the module docstring says."""
    slices = list(slices)
    merged: dict[tuple[str, str], PodEndpoint] = {}
    for s in slices:
        ports = tuple(EndpointPort(p.name or "", p.port, p.protocol or "TCP") for p in s.ports or ())
        for e in s.endpoints or ():
            c = e.conditions
            ref = e.target_ref
            pod = ref.name if ref is not None and (ref.kind or "Pod") == "Pod" and ref.name else ""
            new = PodEndpoint(
                pod=pod,
                addresses=tuple(e.addresses or ()),
                ready=c is None or c.ready is not False,
                serving=c is None or c.serving is not False,
                terminating=c is not None and c.terminating is True,
                node=e.node_name or "",
                ports=ports,
            )
            key = (pod, "") if pod else ("", ",".join(new.addresses))
            old = merged.get(key)
            merged[key] = new if old is None else PodEndpoint(
                pod=pod,
                addresses=old.addresses + tuple(a for a in new.addresses if a not in old.addresses),
                ready=old.ready and new.ready,
                serving=old.serving and new.serving,
                terminating=old.terminating or new.terminating,
                node=old.node or new.node,
                ports=old.ports + tuple(p for p in new.ports if p not in old.ports),
            )  # fmt: skip
    endpoints = sorted(merged.values(), key=lambda e: (e.pod, e.addresses))
    return ServiceEndpoints(namespace, service, len(slices), tuple(endpoints))


class K8sReader:
    """Reads EndpointSlices, Services and workloads of one namespace through one ``kubernetes`` ApiClient.

    Built by an entry point (:meth:`connect`) and passed down; thread-safe for concurrent reads (the
    client's connection pool is); :meth:`close` when done.
    """

    def __init__(self, api_client: Any, namespace: str, *, timeout_s: float = 5.0) -> None:
        from kubernetes import client

        if not namespace:
            raise ValueError("namespace must be a non-empty string")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.namespace = namespace
        self.server = api_client.configuration.host
        self._timeout = (timeout_s, timeout_s)  # connect, read
        self._api_client = api_client
        self._discovery = client.DiscoveryV1Api(api_client)
        self._core = client.CoreV1Api(api_client)
        self._apps = client.AppsV1Api(api_client)

    @classmethod
    def connect(cls, *, namespace: str = "", kubeconfig: str = "", timeout_s: float = 5.0) -> K8sReader:
        """A reader for ``namespace`` (default: see the module docstring) of the cluster found as the module
        docstring says. K8sError when no configuration is usable (no kubeconfig, a bad one, not in a pod)."""
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException

        configuration = client.Configuration()
        configuration.retries = 1  # one quick retry of a dropped connection; callers poll or report
        in_cluster = not kubeconfig and bool(os.environ.get(IN_CLUSTER_ENV))
        try:
            if in_cluster:
                config.load_incluster_config(client_configuration=configuration)
            else:
                path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
                config.load_kube_config(config_file=path, client_configuration=configuration, persist_config=False)
        except (ConfigException, OSError, ValueError, TypeError) as e:
            source = "the pod's service account" if in_cluster else f"kubeconfig {path}"
            raise K8sError(f"no usable Kubernetes configuration from {source}: {e}") from None
        namespace = namespace or _default_namespace(None if in_cluster else path)
        return cls(client.ApiClient(configuration), namespace, timeout_s=timeout_s)

    def close(self) -> None:
        self._api_client.close()

    def service_endpoints(self, service: str) -> ServiceEndpoints:
        """Every endpoint of ``service``'s EndpointSlices (none when it has no slices: no such Service)."""
        what = f"EndpointSlices of Service {service!r} in namespace {self.namespace!r}"
        with _reading(what, self.server):
            slices = self._discovery.list_namespaced_endpoint_slice(
                self.namespace, label_selector=f"{SERVICE_NAME_LABEL}={service}", _request_timeout=self._timeout
            ).items
        return merge_slices(self.namespace, service, slices)

    def workloads(self, service: str) -> list[WorkloadReplicas]:
        """The Deployments and StatefulSets whose pods ``service`` selects (their pod template carries every
        label of its selector), sorted by kind then name; none for a Service without a selector. Three reads."""
        with _reading(f"Service {service!r} in namespace {self.namespace!r}", self.server):
            svc = self._core.read_namespaced_service(service, self.namespace, _request_timeout=self._timeout)
        wanted = dict((svc.spec.selector if svc.spec else None) or {})
        if not wanted:
            return []
        found = []
        for kind, list_fn in (("Deployment", self._apps.list_namespaced_deployment),
                              ("StatefulSet", self._apps.list_namespaced_stateful_set)):  # fmt: skip
            with _reading(f"{kind}s in namespace {self.namespace!r}", self.server):
                items = list_fn(self.namespace, _request_timeout=self._timeout).items
            for w in items:
                template = w.spec.template.metadata if w.spec and w.spec.template else None
                labels = (template.labels if template else None) or {}
                if all(labels.get(k) == v for k, v in wanted.items()):
                    desired = w.spec.replicas if w.spec.replicas is not None else 1
                    ready = (w.status.ready_replicas if w.status else None) or 0
                    found.append(WorkloadReplicas(kind, w.metadata.name, desired, ready))
        return sorted(found, key=lambda w: (w.kind, w.name))


def _default_namespace(kubeconfig: str | None) -> str:
    """The pod's own namespace (``kubeconfig`` None: in a pod), else the kubeconfig context's, else default."""
    if kubeconfig is None:
        try:
            with open(_POD_NAMESPACE_FILE, encoding="utf-8") as f:
                return f.read().strip() or "default"
        except OSError:
            return "default"
    from kubernetes import config

    try:
        _, current = config.list_kube_config_contexts(kubeconfig)
    except Exception:  # noqa: BLE001 - it loaded a moment ago; a context without namespace is the same
        return "default"
    return (current or {}).get("context", {}).get("namespace") or "default"


@contextmanager
def _reading(what: str, server: str) -> Iterator[None]:
    """Turns any failure of the client's call inside into a one-line K8sError naming ``what`` and ``server``."""
    from kubernetes.client.exceptions import ApiException

    try:
        yield
    except ApiException as e:
        try:
            message = json.loads(e.body or "").get("message", "")
        except (ValueError, AttributeError):
            message = ""
        reason = f"HTTP {e.status} {e.reason}" + (f": {message}" if message else "")
        raise K8sError(f"cannot read {what} at {server}: {reason}") from e
    except Exception as e:  # noqa: BLE001 - unreachable, timed out, an answer that does not parse
        reason = f"{type(e).__name__}: {getattr(e, 'reason', None) or e}"
        raise K8sError(f"cannot read {what} at {server}: {reason}") from e
