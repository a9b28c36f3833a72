"""A small fake of the few Kubernetes API reads pdserve makes, for machines where no API server can run.

No Kubernetes API server (nor kind, k3s or envtest) can run here, so the tests of
:mod:`common.cluster.k8s`, the router's EndpointSlice discovery and ``pdserve status --k8s`` talk to this
instead: a real HTTP server on 127.0.0.1, reached through a real kubeconfig file by the real
``kubernetes`` client, so only the API server itself is stood in for. It answers, with the JSON the
API server sends:

- ``GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=k=v[,k=v...]``
- ``GET /api/v1/namespaces/{ns}/services/{name}``
- ``GET /apis/apps/v1/namespaces/{ns}/deployments`` and ``.../statefulsets``

Every request must carry ``Authorization: Bearer <token>`` (401 otherwise, as a real server). Any other
path is 404 and is recorded in ``unexpected`` so a test can assert the client made no other call.
``fail_status`` makes every request answer that status (an API server in trouble, RBAC refusing).
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import yaml

TOKEN = "fake-token"
_SLICES = re.compile(r"^/apis/discovery\.k8s\.io/v1/namespaces/([^/]+)/endpointslices$")
_SERVICE = re.compile(r"^/api/v1/namespaces/([^/]+)/services/([^/]+)$")
_WORKLOADS = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/(deployments|statefulsets)$")
_KINDS = {"deployments": "Deployment", "statefulsets": "StatefulSet"}


def endpoint(pod: str, ip: str, *, ready: bool | None = True, serving: bool | None = None,
             terminating: bool | None = None, node: str = "node-a") -> dict:
    """One EndpointSlice endpoint as the API server writes it (a condition left None is omitted)."""
    conditions = {k: v for k, v in (("ready", ready), ("serving", serving), ("terminating", terminating))
                  if v is not None}  # fmt: skip
    return {"addresses": [ip], "conditions": conditions, "nodeName": node,
            "targetRef": {"kind": "Pod", "name": pod, "namespace": "ns", "uid": f"uid-{pod}"}}


class FakeK8sApi:
    """``with FakeK8sApi() as api:`` serves on ``api.url``; ``api.write_kubeconfig(path)`` points a client at it.

    Objects are held as the API's JSON dicts, keyed by namespace; tests add them with the ``add_*``
    methods while the server runs (each request reads them under a lock).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.slices: dict[str, list[dict]] = {}
        self.services: dict[tuple[str, str], dict] = {}
        self.workloads: dict[tuple[str, str], list[dict]] = {}  # (ns, "deployments"|"statefulsets") -> objects
        self.fail_status: int | None = None
        self.requests: list[str] = []  # path?query of every request, in order
        self.unexpected: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-k8s-api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeK8sApi:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def write_kubeconfig(self, path: Path, *, namespace: str = "") -> str:
        """A kubeconfig whose current context is this server with a bearer token (and ``namespace``)."""
        context = {"cluster": "fake", "user": "fake"} | ({"namespace": namespace} if namespace else {})
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": TOKEN}}],
            "contexts": [{"name": "fake", "context": context}],
        }  # fmt: skip
        path.write_text(yaml.safe_dump(config))
        return str(path)

    def set_endpoints(self, namespace: str, service: str, endpoints: list[dict], *, port: int | None = 50061,
                      slices: int = 1) -> None:
        """Replace the Service's EndpointSlices with ``slices`` slices sharing ``endpoints`` round robin (the
        controller splits big Services; a slice may hold none), each with one TCP port ``port`` named grpc
        (None: a slice without ports)."""
        ports = [{"name": "grpc", "port": port, "protocol": "TCP"}] if port is not None else []
        with self._lock:
            kept = [s for s in self.slices.get(namespace, [])
                    if s["metadata"]["labels"]["kubernetes.io/service-name"] != service]  # fmt: skip
            for i in range(slices):
                kept.append({
                    "metadata": {"name": f"{service}-{i:05d}", "namespace": namespace,
                                 "labels": {"kubernetes.io/service-name": service,
                                            "endpointslice.kubernetes.io/managed-by": "endpointslice-controller"}},
                    "addressType": "IPv4",
                    "endpoints": endpoints[i::slices] or None,  # Go writes an empty list as null
                    "ports": ports or None,
                })  # fmt: skip
            self.slices[namespace] = kept

    def add_service(self, namespace: str, name: str, selector: dict[str, str]) -> None:
        with self._lock:
            self.services[(namespace, name)] = {
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"clusterIP": "None", "selector": selector, "ports": [{"name": "grpc", "port": 50061}]},
            }

    def add_workload(self, namespace: str, kind: str, name: str, *, labels: dict[str, str], replicas: int | None,
                     ready_replicas: int | None) -> None:
        """``kind``: "deployments" or "statefulsets"; None replicas / ready_replicas are omitted, as the
        API server omits them (spec default 1; status absent while none is ready)."""
        spec = {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels},
                "spec": {"containers": [{"name": "worker", "image": "pdserve"}]}}}  # fmt: skip
        if replicas is not None:
            spec["replicas"] = replicas
        status = {"replicas": replicas or 0} | ({"readyReplicas": ready_replicas} if ready_replicas is not None else {})
        if kind == "statefulsets":
            spec["serviceName"] = name
        with self._lock:
            self.workloads.setdefault((namespace, kind), []).append(
                {"metadata": {"name": name, "namespace": namespace}, "spec": spec, "status": status}
            )

    def _answer(self, method: str, target: str, auth: str | None) -> tuple[int, dict]:
        parts = urlsplit(target)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        with self._lock:
            self.requests.append(target)
            if auth != f"Bearer {TOKEN}":
                return 401, _status(401, "Unauthorized", "Unauthorized")
            if self.fail_status is not None:
                return self.fail_status, _status(self.fail_status, "InternalError", "injected failure")
            if method == "GET" and (m := _SLICES.match(parts.path)):
                wanted = _parse_selector(query.get("labelSelector", ""))
                if wanted is None:
                    return 400, _status(400, "BadRequest", f"unsupported labelSelector {query['labelSelector']!r}")
                items = [s for s in self.slices.get(m[1], [])
                         if all(s["metadata"]["labels"].get(k) == v for k, v in wanted.items())]  # fmt: skip
                return 200, _list("EndpointSliceList", "discovery.k8s.io/v1", items)
            if method == "GET" and (m := _SERVICE.match(parts.path)):
                found = self.services.get((m[1], m[2]))
                if found is None:
                    return 404, _status(404, "NotFound", f'services "{m[2]}" not found')
                return 200, {"apiVersion": "v1", "kind": "Service", **found}
            if method == "GET" and (m := _WORKLOADS.match(parts.path)):
                return 200, _list(f"{_KINDS[m[2]]}List", "apps/v1", self.workloads.get((m[1], m[2]), []))
            self.unexpected.append(f"{method} {target}")
            return 404, _status(404, "NotFound", "the server could not find the requested resource")

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self) -> None:
                code, body = fake._answer(self.command, self.path, self.headers.get("Authorization"))
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _reply

            def log_message(self, *args) -> None:
                pass

        return Handler


def _parse_selector(text: str) -> dict[str, str] | None:
    """Equality selectors only (``a=b,c=d``); None for anything else."""
    out = {}
    for term in filter(None, text.split(",")):
        key, sep, value = term.partition("=")
        if not sep or not key or value.startswith("=") or key.endswith("!"):
            return None
        out[key] = value
    return out


def _list(kind: str, api_version: str, items: list[dict]) -> dict:
    return {"apiVersion": api_version, "kind": kind, "metadata": {"resourceVersion": "1"}, "items": items}


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
