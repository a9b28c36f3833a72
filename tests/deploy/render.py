"""The Helm chart ``helm/pdserve`` rendered offline with ``helm-python-sdk`` (Helm's own Go engine, no helm binary,
no cluster), and what the deployment tests ask of the result: objects by kind, component and name, pod specs,
containers, and which pods a label selector picks.

``render(values)`` is ``helm template RELEASE helm/pdserve -n NAMESPACE -f values`` plus the test hook's pod: the
schema is checked first (a bad value raises ``helm_python.HelmValuesError``), ``lookup`` finds nothing."""

from __future__ import annotations

import functools
import re
import shlex
from base64 import b64decode
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdserve"
RELEASE = "rel"
NAMESPACE = "llm"
COMPONENT = "app.kubernetes.io/component"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
DIGEST = "sha256:" + "ab" * 32

# The value sets the chart is tested with: what an operator would install.
VALUE_SETS: dict[str, dict] = {
    # the CPU demo: tiny model built in each pod, bundled Redis with a generated password
    "default": {},
    # GPUs, a real checkpoint on a PVC, a pinned image, tuned workers, a longer decode drain
    "gpu": {
        "gpu": {"enabled": True, "runtimeClassName": "nvidia"},
        "image": {"repository": "registry.example/pdserve", "digest": DIGEST},
        "model": {"path": "/models/llama-3.1-8b", "dtype": "bfloat16", "quantization": "int8-dynamic",
                  "servedModelName": "llama-3.1-8b",
                  "volume": {"type": "persistentVolumeClaim", "claimName": "llama-weights"},
                  "buildTiny": {"enabled": False}},
        "prefill": {"replicas": 2, "settings": {"kv-cache-memory": 0.85, "max-num-batched-tokens": 8192}},
        "decode": {"replicas": 4, "drainTimeoutS": 120, "settings": {"kv-cache-memory": 0.9, "max-num-seqs": 128}},
    },
    # HPAs on prometheus-adapter's metrics for every pool, with the monitoring objects
    "hpa": {
        "router": {"autoscaling": {"enabled": True}},
        "prefill": {"autoscaling": {"enabled": True}},
        "decode": {"autoscaling": {"enabled": True}},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
                    "prometheusRule": {"enabled": True}, "grafanaDashboard": {"enabled": True}},
    },
    # KEDA instead, prefill also on TTFT, decode on KV usage alone
    "keda": {
        "autoscaling": {"engine": "keda", "keda": {"authenticationRef": "prometheus-auth"}},
        "router": {"autoscaling": {"enabled": True}},
        "prefill": {"autoscaling": {"enabled": True, "ttft": {"enabled": True}}},
        "decode": {"autoscaling": {"enabled": True, "runningRequests": {"enabled": False}}},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    # every security value: mTLS, public TLS, API keys, JWTs, KV encryption, rate limits, a given Redis password
    "tls": {
        "tls": {"enabled": True, "cert": "CERT PEM", "key": "KEY PEM", "ca": "CA PEM"},
        "router": {"publicTls": {"enabled": True, "existingSecret": "public-cert"},
                   "rateLimit": {"requestsPerMin": 600, "tokensPerMin": 100000}},
        "auth": {"apiKeys": ["key-one", "key-two"],
                 "jwt": {"existingSecret": "jwt", "publicKeyKey": "jwt.pem", "issuer": "https://id.example",
                         "audience": "pdserve"}},
        "kvEncryption": {"existingSecret": "kv-key"},
        "redis": {"auth": {"password": "p@ss word/1"}},
    },
    # an external Redis, API keys from an existing Secret, the routers reachable only from a gateway namespace
    "external-redis": {
        "redis": {"enabled": False, "external": {"url": "rediss://:s3cret@redis.example:6380/0"}},
        "auth": {"existingSecret": "my-keys"},
        "networkPolicy": {"routerIngressFrom": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}]},
    },
}


def merge(base: dict, override: dict) -> dict:
    """``override`` merged into a copy of ``base`` (maps recursively; everything else replaced), as Helm does."""
    out = dict(base)
    for key, value in override.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@dataclass
class Rendered:
    """One rendering: ``values`` as given, ``merged`` (chart defaults + values), ``manifests`` (template path ->
    text), ``objects`` (every Kubernetes object, the test pod included) and ``notes`` (NOTES.txt)."""

    values: dict
    merged: dict
    manifests: dict[str, str]
    objects: list[dict] = field(default_factory=list)
    notes: str = ""

    def kinds(self) -> set[str]:
        return {o["kind"] for o in self.objects}

    def of(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def named(self, kind: str, name: str) -> dict:
        found = [o for o in self.of(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
        return found[0]

    def component(self, kind: str, component: str) -> dict:
        """The one object of ``kind`` labelled with ``component`` (router, prefill, decode, redis, test)."""
        found = [o for o in self.of(kind) if o["metadata"].get("labels", {}).get(COMPONENT) == component]
        assert len(found) == 1, f"{kind} of component {component}: {len(found)} rendered"
        return found[0]

    def workloads(self) -> list[dict]:
        return [o for o in self.objects if o["kind"] in WORKLOAD_KINDS]

    def pods(self) -> list[tuple[str, dict, dict]]:
        """(where, pod metadata, pod spec) of every workload's pod template and of every bare Pod."""
        out = []
        for o in self.workloads():
            t = o["spec"]["template"]
            out.append((f"{o['kind']}/{o['metadata']['name']}", t["metadata"], t["spec"]))
        for o in self.of("Pod"):
            out.append((f"Pod/{o['metadata']['name']}", o["metadata"], o["spec"]))
        return out

    def pod_of(self, component: str) -> tuple[dict, dict]:
        """(metadata, spec) of the pods of ``component``."""
        found = [(m, s) for _, m, s in self.pods() if m.get("labels", {}).get(COMPONENT) == component]
        assert len(found) == 1, f"pods of component {component}: {len(found)} templates"
        return found[0]

    def container(self, component: str, name: str | None = None) -> dict:
        """The main container of ``component``'s pods (named ``name``, default: the component)."""
        _, spec = self.pod_of(component)
        (found,) = [c for c in spec["containers"] if c["name"] == (name or component)]
        return found

    def secret_value(self, name: str, key: str) -> str:
        """A key of a Secret the chart rendered, decoded."""
        return b64decode(self.named("Secret", name)["data"][key]).decode()

    def env_value(self, container: dict, name: str) -> str:
        """An environment variable's value: literal (after Kubernetes' $(VAR) expansion from the container's other
        variables) or from a Secret the chart rendered."""
        (entry,) = [e for e in container["env"] if e["name"] == name]
        if "value" in entry:
            return re.sub(r"\$\((\w+)\)", lambda m: self.env_value(container, m[1]), entry["value"])
        ref = entry["valueFrom"]["secretKeyRef"]
        return self.secret_value(ref["name"], ref["key"])


def pdserve_argvs(r: Rendered) -> list[tuple[str, list[str]]]:
    """(where, argv after `pdserve`) of every container that runs pdserve, the test pod's shell line included."""
    out = []
    for where, _, spec in r.pods():
        for c in spec.get("initContainers", []) + spec["containers"]:
            command, args = c.get("command", []), c.get("args", [])
            if command == ["pdserve"]:
                out.append((f"{where}/{c['name']}", args))
            elif command == ["sh", "-c"] and "exec pdserve " in args[0]:
                words = shlex.split(args[0].split("exec pdserve ", 1)[1])
                out.append((f"{where}/{c['name']}", words))
    return out


def matches(selector: dict, labels: dict) -> bool:
    """Whether a LabelSelector (matchLabels and matchExpressions) selects ``labels``; {} selects everything."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


@functools.cache
def rendered(name: str) -> Rendered:
    """``render(VALUE_SETS[name])``, once per process."""
    return render(VALUE_SETS[name])


def render(values: dict | None = None) -> Rendered:
    """Render the chart as an install of release ``rel`` in namespace ``llm``."""
    import helm_python

    values = values or {}
    chart = helm_python.Chart.load(CHART)
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    out = Rendered(values=values, merged=chart.merge_values(values), manifests=manifests)
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            out.notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                out.objects.append(doc)
    return out
