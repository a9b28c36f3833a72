"""The kustomize tree k8s/: each overlay builds with ``kubectl kustomize``, every object it makes is valid for the
Kubernetes 1.29 and 1.33 schemas (``kubernetes-validate --strict``), and the objects mean what they should:
selectors of Services, NetworkPolicies, PDBs and HPAs find the workloads they are for, Service and probe ports are
ports the containers listen on, container args are flags the ``pdserve`` CLI accepts, gpu-prod asks for GPUs and
cpu-dev doesn't. cpu-dev is compared with the Helm chart's default render (helm/pdserve through ``helm_python``).
No cluster runs here: nothing is applied."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.cli_flags import bad_args, flag_value

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = {"cpu-dev": "pdserve-dev", "gpu-prod": "pdserve"}  # overlay -> its namespace
K8S_VERSIONS = ("1.29.0", "1.33.0")
CHART = ROOT / "helm" / "pdserve"
ADAPTER_RULES = ROOT / "deploy" / "prometheus" / "adapter-rules.yml"
ROLES = ("router", "prefill", "decode")
COMPONENT = "app.kubernetes.io/component"
GPU = "nvidia.com/gpu"
KUBECTL = shutil.which("kubectl")
TIMEOUT_S = 60
# Who may open a connection to whom (NetworkPolicy ingress on the gRPC / Redis port); None: anyone.
ALLOWED_CLIENTS = {"router": None, "prefill": {"router"}, "decode": {"router", "prefill"},
                   "redis": {"router", "prefill", "decode"}}

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: `kubectl kustomize` builds the "
                                                        "overlays (apt-get install kubectl, or a release binary)")


def kustomize(overlay: str) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(ROOT / "k8s" / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def built() -> dict[str, list[dict]]:
    return {overlay: kustomize(overlay) for overlay in OVERLAYS}


# -- helpers over a list of objects -------------------------------------------------------------------------


def by_kind(objects: list[dict], *kinds: str) -> list[dict]:
    return [o for o in objects if o["kind"] in kinds]


def one(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: found {len(found)}"
    return found[0]


def workloads(objects: list[dict]) -> list[dict]:
    return by_kind(objects, "Deployment", "StatefulSet")


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions; {} selects everything)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value, op = labels.get(e["key"]), e["operator"]
        if (op == "In" and value not in e["values"]) or (op == "NotIn" and value in e["values"]) \
                or (op == "Exists" and value is None) or (op == "DoesNotExist" and value is not None):
            return False
    return True


def selected(objects: list[dict], selector: dict) -> list[str]:
    """Names of the workloads whose pods ``selector`` selects."""
    return sorted(w["metadata"]["name"] for w in workloads(objects) if selects(selector, pod_labels(w)))


def pdserve_containers(workload: dict) -> list[dict]:
    spec = pod_spec(workload)
    return [c for c in spec.get("initContainers", []) + spec["containers"] if c.get("command") == ["pdserve"]]


def container_ports(workload: dict) -> dict[str, int]:
    """Port name -> number over the workload's containers."""
    return {p["name"]: p["containerPort"] for c in pod_spec(workload)["containers"] for p in c.get("ports", [])}


def resolve_port(port, workload: dict) -> int:
    """A named or numbered port of a Service, probe or NetworkPolicy, as the container port it means."""
    ports = container_ports(workload)
    if isinstance(port, str) and not port.isdigit():
        assert port in ports, f"{workload['metadata']['name']}: no container port named {port!r} ({ports})"
        return ports[port]
    assert int(port) in ports.values(), f"{workload['metadata']['name']}: nothing listens on {port} ({ports})"
    return int(port)


def component_workload(objects: list[dict], component: str) -> dict:
    (w,) = [w for w in workloads(objects) if pod_labels(w)[COMPONENT] == component]
    return w


# -- build and schemas -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_builds_the_whole_topology_in_its_namespace(built, overlay):
    objects = built[overlay]
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for role in ROLES:
        assert ("Service", f"pdserve-{role}") in kinds and ("NetworkPolicy", f"pdserve-{role}") in kinds
        assert ("PodDisruptionBudget", f"pdserve-{role}") in kinds
    assert {("Deployment", "pdserve-router"), ("Deployment", "pdserve-prefill"), ("StatefulSet", "pdserve-decode"),
            ("StatefulSet", "pdserve-redis"), ("Service", "pdserve-redis"), ("NetworkPolicy", "pdserve-redis"),
            ("ServiceAccount", "pdserve"), ("Role", "pdserve-router"), ("RoleBinding", "pdserve-router")} <= kinds
    assert [o["metadata"]["name"] for o in by_kind(objects, "ConfigMap")][0].startswith("pdserve-config-")
    for o in objects:
        assert o["metadata"].get("namespace") == OVERLAYS[overlay], f"{o['kind']}/{o['metadata']['name']}"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_for_the_kubernetes_schema(built, overlay, version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (test extras)")
    for o in built[overlay]:
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{overlay} {o['kind']}/{o['metadata']['name']} on {version}: {e.message} at {e.path}")


# -- meaning ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_select_their_pods_on_ports_the_containers_listen_on(built, overlay):
    objects = built[overlay]
    for service in by_kind(objects, "Service"):
        name = service["metadata"]["name"]
        targets = selected(objects, {"matchLabels": service["spec"]["selector"]})  # a Service's is plain labels
        assert targets == [name], f"Service {name} selects {targets}"
        workload = one(objects, next(w["kind"] for w in workloads(objects) if w["metadata"]["name"] == name), name)
        for port in service["spec"]["ports"]:
            assert resolve_port(port["targetPort"], workload) == port["port"], f"{name} {port['name']}"
    for role in ("prefill", "decode"):  # headless: one EndpointSlice entry per pod for the router's discovery
        assert one(objects, "Service", f"pdserve-{role}")["spec"]["clusterIP"] == "None"
    assert one(objects, "StatefulSet", "pdserve-decode")["spec"]["serviceName"] == "pdserve-decode"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ask_ports_the_containers_listen_on(built, overlay):
    for workload in workloads(built[overlay]):
        for c in pod_spec(workload)["containers"]:
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = c.get(kind)
                assert probe is not None, f"{workload['metadata']['name']}/{c['name']}: no {kind}"
                how = next(k for k in ("grpc", "httpGet", "tcpSocket", "exec") if k in probe)
                if how != "exec":
                    resolve_port(probe[how]["port"], workload)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_admit_exactly_the_intended_clients(built, overlay):
    objects = built[overlay]
    for component, allowed in ALLOWED_CLIENTS.items():
        policy = one(objects, "NetworkPolicy", f"pdserve-{component}")
        target = component_workload(objects, component)
        assert selected(objects, policy["spec"]["podSelector"]) == [target["metadata"]["name"]]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        main_port = {"router": "grpc", "redis": "redis"}.get(component, "grpc")
        (rule,) = [r for r in policy["spec"]["ingress"] if main_port in [p["port"] for p in r["ports"]]]
        for p in rule["ports"]:
            resolve_port(p["port"], target)
        if allowed is None:
            assert "from" not in rule, f"{component}: its API is for everyone"
            continue
        clients = set()
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, f"{component}: only pods of this namespace may connect"
            clients |= {pod_labels(w)[COMPONENT] for w in workloads(objects)
                        if selects(peer["podSelector"], pod_labels(w))}
        assert clients == allowed, f"{component} admits {clients}"
        for other in policy["spec"]["ingress"]:  # the rest opens only the metrics port, to Prometheus
            if other is not rule:
                assert [p["port"] for p in other["ports"]] == ["metrics"]
                assert other["from"][0]["namespaceSelector"]["matchLabels"] == {
                    "kubernetes.io/metadata.name": "monitoring"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pdbs_each_cover_one_pool(built, overlay):
    objects = built[overlay]
    for pdb in by_kind(objects, "PodDisruptionBudget"):
        assert selected(objects, pdb["spec"]["selector"]) == [pdb["metadata"]["name"]]
        assert pdb["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_container_args_are_flags_the_cli_accepts(built, overlay):
    checked = 0
    for workload in workloads(built[overlay]):
        for c in pdserve_containers(workload):
            assert bad_args(c["args"]) == [], f"{workload['metadata']['name']}/{c['name']}"
            checked += 1
    assert checked >= (3 if overlay == "gpu-prod" else 6)  # 3 services (+ 3 tiny-model init containers)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_are_wired_to_each_other(built, overlay):
    objects = built[overlay]
    services = {s["metadata"]["name"]: s for s in by_kind(objects, "Service")}
    config_map = by_kind(objects, "ConfigMap")[0]
    volumes_model = None
    for role in ROLES:
        workload = component_workload(objects, role)
        spec = pod_spec(workload)
        (c,) = [c for c in spec["containers"] if c["name"] == role]
        args = c["args"]
        assert args[0] == role
        assert flag_value(args, "--port") == str(container_ports(workload)["grpc"])
        http_flag = "--http-port" if role == "router" else "--metrics-port"
        assert flag_value(args, http_flag) == str(container_ports(workload)["http" if role == "router" else "metrics"])
        # the --config file is a key of the generated ConfigMap, mounted where the flag points
        config_path = flag_value(args, "--config")
        mount = next(m for m in c["volumeMounts"] if config_path.startswith(m["mountPath"] + "/"))
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["configMap"]["name"] == config_map["metadata"]["name"]
        settings = yaml.safe_load(config_map["data"][Path(config_path).name]) or {}
        assert bad_args([role, *(f"--{k}={v}" for k, v in settings.items())]) == [], f"{role} settings"
        # the model lies on the model volume; the same volume kind for every service
        model = flag_value(args, "--model")
        model_mount = next(m for m in c["volumeMounts"] if model.startswith(m["mountPath"] + "/"))
        model_volume = next(v for v in spec["volumes"] if v["name"] == model_mount["name"])
        assert model_mount["readOnly"] is True
        volumes_model = volumes_model or model_volume
        assert model_volume == volumes_model
        for init in spec.get("initContainers", []):
            assert flag_value(init["args"], "--out") == model
        # $(VAR) in args and env values refers to a variable defined before it in the same container
        defined = []
        for env in c.get("env", []):
            for ref in re.findall(r"\$\((\w+)\)", env.get("value", "")):
                assert ref in defined, f"{role}: {env['name']} uses $({ref}) before it is defined"
            defined.append(env["name"])
        for arg in args:
            for ref in re.findall(r"\$\((\w+)\)", arg):
                assert ref in defined, f"{role}: {arg} uses an undefined $({ref})"
        redis_url = next(e["value"] for e in c["env"] if e["name"] == "PDSERVE_REDIS_URL")
        assert re.fullmatch(r"redis://:\$\(REDIS_PASSWORD\)@pdserve-redis:6379/0", redis_url)
    router_args = pod_spec(component_workload(objects, "router"))["containers"][0]["args"]
    for role in ("prefill", "decode"):
        assert flag_value(router_args, f"--k8s-{role}-service") in services
    for role in ("prefill", "decode"):
        args = pod_spec(component_workload(objects, role))["containers"][0]["args"]
        assert flag_value(args, "--advertise-host") == "$(POD_IP)"
        assert flag_value(args, "--worker-id") == "$(POD_NAME)"
    redis = pod_spec(component_workload(objects, "redis"))["containers"][0]
    assert "--port 6379" in redis["args"][0] and "requirepass" in redis["args"][0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_router_mounts_its_service_account_token_and_may_list_endpointslices(built, overlay):
    objects = built[overlay]
    binding = one(objects, "RoleBinding", "pdserve-router")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pdserve", "namespace": OVERLAYS[overlay]}]
    role = one(objects, "Role", binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list"]}]
    assert one(objects, "ServiceAccount", "pdserve")["automountServiceAccountToken"] is False
    for workload in workloads(objects):
        spec = pod_spec(workload)
        assert spec["serviceAccountName"] == "pdserve"
        assert spec["automountServiceAccountToken"] is (workload["metadata"]["name"] == "pdserve-router")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_as_non_root_with_a_read_only_root(built, overlay):
    for workload in workloads(built[overlay]):
        spec = pod_spec(workload)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c["securityContext"]
            assert sc["runAsUser"] == 10001 and sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"]
            assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"]), f"{c['name']}: no writable /tmp"


def test_gpu_prod_asks_for_gpus_and_cpu_dev_does_not(built):
    for overlay, gpu in (("gpu-prod", True), ("cpu-dev", False)):
        for workload in workloads(built[overlay]):
            spec = pod_spec(workload)
            role = pod_labels(workload)[COMPONENT]
            worker = role in ("prefill", "decode")
            for c in spec.get("initContainers", []) + spec["containers"]:
                requests, limits = c["resources"].get("requests", {}), c["resources"].get("limits", {})
                wants = gpu and worker and c["name"] == role
                assert (requests.get(GPU), limits.get(GPU)) == ((1, 1) if wants else (None, None)), \
                    f"{overlay} {workload['metadata']['name']}/{c['name']}"
                if c.get("command") == ["pdserve"]:
                    assert c["image"] == ("pdserve:cuda" if gpu else "pdserve:cpu")
            if worker:
                args = spec["containers"][0]["args"]
                assert flag_value(args, "--device") == ("cuda" if gpu else "cpu")
                assert (spec.get("nodeSelector", {}).get("nvidia.com/gpu.present") == "true") is gpu
                assert any(t["key"] == GPU for t in spec.get("tolerations", [])) is gpu
            if gpu and role in ROLES:
                assert "initContainers" not in spec, "gpu-prod serves a checkpoint, not the tiny model"
                model = next(v for v in spec["volumes"] if v["name"] == "model")
                assert model["persistentVolumeClaim"] == {"claimName": "pdserve-models", "readOnly": True}


def test_gpu_prod_scales_each_pool_on_its_own_signal(built):
    objects = built["gpu-prod"]
    adapter = yaml.safe_load(ADAPTER_RULES.read_text())
    pods_metrics = {r["name"]["as"] for r in adapter["rules"]}
    expected = {"router": {"pdserve_requests_per_second"}, "prefill": {"pdserve_num_requests_waiting"},
                "decode": {"pdserve_kv_cache_usage_perc", "pdserve_num_requests_running"}}
    hpas = by_kind(objects, "HorizontalPodAutoscaler")
    assert sorted(h["metadata"]["name"] for h in hpas) == [f"pdserve-{r}" for r in sorted(ROLES)]
    for hpa in hpas:
        ref = hpa["spec"]["scaleTargetRef"]
        target = one(objects, ref["kind"], ref["name"])
        role = pod_labels(target)[COMPONENT]
        assert hpa["metadata"]["name"] == f"pdserve-{role}"
        names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
        assert all(m["type"] == "Pods" for m in hpa["spec"]["metrics"])
        assert names == expected[role] and names <= pods_metrics
        assert target["spec"]["replicas"] == hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
        assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
    assert not by_kind(built["cpu-dev"], "HorizontalPodAutoscaler")


# -- the same topology as the chart's defaults ------------------------------------------------------------


CHART_ONLY = {
    "Secret": "the chart generates the Redis password; kustomize expects the Secret pdserve-redis to exist",
    "Pod": "the chart's `helm test` pod",
}
CHART_ONLY_COMPONENTS = {"test": "the `helm test` pod's objects (its NetworkPolicy)"}


def _chart_default_render() -> list[dict]:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk (test extras) renders the chart")
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(None, name="pdserve", namespace=OVERLAYS["cpu-dev"])
    return [d for path, text in sorted(manifests.items()) if path.endswith((".yaml", ".yml"))
            for d in yaml.safe_load_all(text) if d]


def _key(o: dict) -> tuple[str, str]:
    name = o["metadata"]["name"]
    if o["kind"] == "ConfigMap":
        name = re.sub(r"-[a-z0-9]{10}$", "", name)  # kustomize's content hash
    return o["kind"], name


@pytest.mark.skipif(not (CHART / "Chart.yaml").exists(), reason="helm/pdserve is not in this checkout")
def test_cpu_dev_matches_the_chart_defaults(built):
    chart = {_key(o): o for o in _chart_default_render() if o["kind"] not in CHART_ONLY
             and o["metadata"].get("labels", {}).get(COMPONENT) not in CHART_ONLY_COMPONENTS}
    kust = {_key(o): o for o in built["cpu-dev"]}
    assert sorted(kust) == sorted(chart)
    for key, ours in kust.items():
        theirs = chart[key]
        if key[0] in ("Deployment", "StatefulSet"):
            assert ours["spec"]["selector"] == theirs["spec"]["selector"], key
            assert ours["spec"].get("replicas") == theirs["spec"].get("replicas"), key
            for part in ("initContainers", "containers"):
                a, b = (pod_spec(o).get(part, []) for o in (ours, theirs))
                assert [c["name"] for c in a] == [c["name"] for c in b], key
                for x, y in zip(a, b):
                    for field in ("image", "command", "args", "ports", "startupProbe", "livenessProbe",
                                  "readinessProbe", "securityContext", "resources", "volumeMounts"):
                        assert x.get(field) == y.get(field), f"{key} {x['name']}.{field}"
            assert [v["name"] for v in pod_spec(ours)["volumes"]] == [v["name"] for v in pod_spec(theirs)["volumes"]]
        elif key[0] in ("Service", "NetworkPolicy", "PodDisruptionBudget"):
            assert ours["spec"] == theirs["spec"], key
        elif key[0] == "ConfigMap":
            assert {k: yaml.safe_load(v) for k, v in ours["data"].items()} == \
                   {k: yaml.safe_load(v) for k, v in theirs["data"].items()}
        elif key[0] in ("Role", "RoleBinding"):
            assert ours.get("rules") == theirs.get("rules") and ours.get("subjects") == theirs.get("subjects"), key
