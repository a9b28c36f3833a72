"""``pdserve status --k8s``: the prefill and decode pools as Kubernetes sees them.

Per pool: the endpoints of its headless Service's EndpointSlices (ready / not ready / terminating, each pod's
state: :mod:`common.cluster.k8s`), and the desired and ready replicas of the Deployments and StatefulSets the
Service selects; with the Redis registry read, which pods are registered (matched as the router matches them:
worker id == pod name, else IP:port) and which registry workers match no endpoint.

The ``k8s`` object of ``--json`` (keys are never dropped; later versions may add some)::

    {"namespace": "ns", "server": "https://10.96.0.1:443",
     "pools": {"prefill": POOL, "decode": POOL}}
    POOL = {"service": "pdserve-prefill", "num_slices": 1,
            "num_ready": 2, "num_not_ready": 0, "num_terminating": 1,
            "endpoints": [{"pod": "prefill-0", "addresses": ["10.0.0.4"], "ready": true, "serving": true,
                           "terminating": false, "node": "node-a",
                           "ports": [{"name": "grpc", "port": 50061, "protocol": "TCP"}],
                           "state": "ready" | "not_ready" | "terminating",
                           "worker_id": "prefill-0" | null}],
            "workloads": [{"kind": "Deployment" | "StatefulSet", "name": "pdserve-prefill",
                           "desired_replicas": 3, "ready_replicas": 2}] | null,
            "workloads_error": null | "cannot read ...",
            "unmatched_workers": ["prefill-9"] | null}

``worker_id`` is the registry worker on that pod (null: none, or the registry was not read);
``unmatched_workers`` lists the registry workers of that role matching no endpoint (null: registry not read);
``workloads`` is null when they could not be read (RBAC without ``apps`` reads), with ``workloads_error`` why.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from common.cluster.k8s import K8sReader, PodEndpoint, ServiceEndpoints, WorkloadReplicas
    from common.state.registry import WorkerInfo

NAMESPACE_ENV = "PDSERVE_K8S_NAMESPACE"  # the router's --k8s-* settings' variables, shared
SERVICE_ENV = {"prefill": "PDSERVE_K8S_PREFILL_SERVICE", "decode": "PDSERVE_K8S_DECODE_SERVICE"}
DEFAULT_SERVICE = {"prefill": "pdserve-prefill", "decode": "pdserve-decode"}
K8S_TIMEOUT_S = 5.0  # per API read
_COLUMNS = ("POD", "ADDRESS", "STATE", "NODE", "WORKER")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Kubernetes (--k8s)")
    g.add_argument("--k8s", action="store_true",
                   help="also show each pool as Kubernetes sees it: its headless Service's EndpointSlices and its "
                        "workload's replicas (the registry is then read only with --redis-url or "
                        "$PDSERVE_REDIS_URL). With --json a top-level \"k8s\" key: {namespace, server, pools: "
                        "{prefill|decode: {service, num_slices, num_ready, num_not_ready, num_terminating, "
                        "endpoints: [{pod, addresses, ready, serving, terminating, node, ports, state, worker_id}], "
                        "workloads: [{kind, name, desired_replicas, ready_replicas}] | null, workloads_error, "
                        "unmatched_workers}}}")  # fmt: skip
    g.add_argument("--namespace", default=None,
                   help=f"namespace of the Services (default: ${NAMESPACE_ENV}, else the pod's own, else the "
                        "kubeconfig context's, else default)")  # fmt: skip
    for role in ("prefill", "decode"):
        g.add_argument(f"--{role}-service", default=None, metavar="NAME",
                       help=f"headless Service of the {role} pods (default: ${SERVICE_ENV[role]}, "
                            f"else {DEFAULT_SERVICE[role]})")  # fmt: skip
    g.add_argument("--kubeconfig", default="", metavar="FILE",
                   help="kubeconfig file (default: the service account in a pod, else $KUBECONFIG or ~/.kube/config)")


@dataclass(frozen=True)
class PoolStatus:
    role: str
    endpoints: ServiceEndpoints
    workloads: list[WorkloadReplicas] | None  # None: could not be read (workloads_error says why)
    workloads_error: str
    worker_ids: tuple[str | None, ...]  # per endpoint: the registry worker on it (None: none, or not read)
    unmatched_workers: list[str] | None  # registry workers of the role on no endpoint; None: registry not read


def connect(args: argparse.Namespace) -> K8sReader:
    """The reader for the flags (K8sError when no Kubernetes configuration is usable)."""
    from common.cluster.k8s import K8sReader

    namespace = args.namespace or os.environ.get(NAMESPACE_ENV, "")
    return K8sReader.connect(namespace=namespace, kubeconfig=args.kubeconfig, timeout_s=K8S_TIMEOUT_S)


def read_pools(reader: K8sReader, args: argparse.Namespace, workers: list[WorkerInfo] | None) -> list[PoolStatus]:
    """Both pools, merged with the registry's ``workers`` (None: not read). K8sError when an EndpointSlice list
    fails; a workload read failure is reported in the pool instead."""
    from common.cluster.k8s import EndpointIndex, K8sError

    pools = []
    for role in ("prefill", "decode"):
        service = getattr(args, f"{role}_service") or os.environ.get(SERVICE_ENV[role]) or DEFAULT_SERVICE[role]
        found = reader.service_endpoints(service)
        try:
            workloads, error = reader.workloads(service), ""
        except K8sError as e:
            workloads, error = None, str(e)
        worker_ids: list[str | None] = [None] * len(found.endpoints)
        unmatched = None
        if workers is not None:
            index, position = EndpointIndex(found.endpoints), {e: i for i, e in enumerate(found.endpoints)}
            unmatched = []
            for w in (w for w in workers if w.role == role):
                e = index.find(w.id, w.address)
                if e is None:
                    unmatched.append(w.id)
                elif worker_ids[position[e]] is None:
                    worker_ids[position[e]] = w.id
        pools.append(PoolStatus(role, found, workloads, error, tuple(worker_ids), unmatched))
    return pools


def to_json(reader: K8sReader, pools: list[PoolStatus]) -> dict[str, Any]:
    """The ``k8s`` object of ``--json`` (shape in the module docstring)."""
    return {"namespace": reader.namespace, "server": reader.server, "pools": {p.role: _pool_json(p) for p in pools}}


def _pool_json(p: PoolStatus) -> dict[str, Any]:
    found = p.endpoints
    return {
        "service": found.service,
        "num_slices": found.num_slices,
        **{f"num_{state}": found.num_in(state) for state in ("ready", "not_ready", "terminating")},
        "endpoints": [{**e.to_dict(), "worker_id": w} for e, w in zip(found.endpoints, p.worker_ids)],
        "workloads": None if p.workloads is None else [asdict(w) for w in p.workloads],
        "workloads_error": p.workloads_error or None,
        "unmatched_workers": p.unmatched_workers,
    }


def format_pools(reader: K8sReader, pools: list[PoolStatus]) -> str:
    """The pools for people: a summary line, the workloads' replicas, and a table of endpoints per pool."""
    blocks = []
    for p in pools:
        found = p.endpoints
        lines = [f"{p.role} pool: Service {found.service!r} in namespace {found.namespace!r}: "
                 f"{found.num_in('ready')} ready, {found.num_in('not_ready')} not ready, "
                 f"{found.num_in('terminating')} terminating"]  # fmt: skip
        if p.workloads is None:
            lines.append(f"  replicas unknown: {p.workloads_error}")
        elif not p.workloads:
            lines.append("  no Deployment or StatefulSet runs the pods this Service selects")
        for w in p.workloads or ():
            lines.append(f"  {w.kind} {w.name}: {w.desired_replicas} desired, {w.ready_replicas} ready")
        if found.num_slices == 0:
            lines.append(f"  no EndpointSlices (no Service {found.service!r}, or one without a selector?)")
        elif found.endpoints:
            lines.append(_table([_row(e, w, p.unmatched_workers is not None)
                                 for e, w in zip(found.endpoints, p.worker_ids)]))  # fmt: skip
        if p.unmatched_workers:
            lines.append(f"  registered but on no endpoint: {', '.join(p.unmatched_workers)}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _row(e: PodEndpoint, worker_id: str | None, registry_read: bool) -> tuple[str, ...]:
    worker = (worker_id or "-") if registry_read else "?"
    return (e.pod or "-", ",".join(e.addresses) or "-", e.state, e.node or "-", worker)


def _table(rows: list[tuple[str, ...]]) -> str:
    rows = [_COLUMNS, *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    return "\n".join(("  " + "  ".join(c.ljust(n) for c, n in zip(row, widths))).rstrip() for row in rows)
