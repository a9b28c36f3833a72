"""The Helm chart ``helm/pdserve`` with real tools, offline: rendered by Helm's own engine (``helm-python-sdk``) for
six value sets (``render.VALUE_SETS``); ``helm lint --strict`` against Kubernetes 1.29 and 1.33; every rendered
object validated by ``kubernetes-validate --strict`` against 1.29 and 1.33, and the custom resources (ServiceMonitor,
PrometheusRule, ScaledObject) against models generated from their CRDs; checkov over everything rendered, with
each skip reasoned and scoped; the values schema refusing bad values; values.yaml documented key by key; the
chart's copies of the dashboard and alert rules equal to deploy/'s. What the rendered objects *mean* is
tests/deploy/test_helm_chart_wiring.py (selectors, ports, flags, autoscaling targets) and test_helm_chart_values.py
(what each value does to the pods); test_helm_chart_loopback.py runs the rendered command lines."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from tests.deploy.checkov import checkov, run_checkov
from tests.deploy.render import CHART, NAMESPACE, ROOT, VALUE_SETS, render, rendered

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk ('.[test]')")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate ('.[test]')")

KUBE_VERSIONS = ("1.29", "1.33")
CHECKOV_CONFIG = CHART / ".checkov.yaml"
# The only objects ("Kind/name") each skipped checkov check may fail on; None: any object (a chart-wide choice).
CHECKOV_SKIP_SCOPE: dict[str, set[str] | None] = {
    "CKV_K8S_43": None,  # image digests: image.digest at deploy time
    "CKV_K8S_15": None,  # imagePullPolicy IfNotPresent
    "CKV_K8S_11": None,  # no CPU limits
    "CKV_K8S_35": None,  # the Redis URL from a Secret as an environment variable
    "CKV_K8S_8": {"Pod/rel-pdserve-test-generate"},  # the helm test pod has no liveness probe
    "CKV_K8S_9": {"Pod/rel-pdserve-test-generate"},  # ... nor a readiness probe
    "CKV_K8S_38": {"Deployment/rel-pdserve-router"},  # the router's token (EndpointSlice discovery)
}
COPIES = {  # the chart's copy -> the original (Helm reads no file outside the chart)
    CHART / "files" / "pdserve-dashboard.json": ROOT / "deploy" / "grafana" / "pdserve-dashboard.json",
    CHART / "files" / "pdserve-alerts.yml": ROOT / "deploy" / "prometheus" / "pdserve-alerts.yml",
    CHART / "files" / "adapter-rules.yml": ROOT / "deploy" / "prometheus" / "adapter-rules.yml",
}
CUSTOM_KINDS = ("ServiceMonitor", "PrometheusRule", "ScaledObject")


def crd_models() -> dict[tuple[str, str], type]:
    """(apiVersion, kind) -> a pydantic model generated from that resource's CRD (cloudcoil's model packages)."""
    keda = pytest.importorskip("cloudcoil.models.keda.v1alpha1", reason="cloudcoil-models-keda ('.[test]')")
    prom = pytest.importorskip("cloudcoil.models.prometheus_operator.v1",
                               reason="cloudcoil-models-prometheus-operator ('.[test]')")
    return {
        ("keda.sh/v1alpha1", "ScaledObject"): keda.ScaledObject,
        ("monitoring.coreos.com/v1", "ServiceMonitor"): prom.ServiceMonitor,
        ("monitoring.coreos.com/v1", "PrometheusRule"): prom.PrometheusRule,
    }


# -- rendering and lint --------------------------------------------------------------------------------------------


def test_every_value_set_renders_the_objects_it_turns_on():
    core = {"ConfigMap", "Deployment", "StatefulSet", "Service", "Secret", "ServiceAccount", "Role", "RoleBinding",
            "NetworkPolicy", "PodDisruptionBudget", "Pod"}
    assert rendered("default").kinds() == core
    assert rendered("hpa").kinds() == core | {"HorizontalPodAutoscaler", "ServiceMonitor", "PrometheusRule"}
    assert rendered("keda").kinds() == core | {"ScaledObject", "ServiceMonitor"}
    assert len(rendered("hpa").of("HorizontalPodAutoscaler")) == 3
    assert len(rendered("keda").of("ScaledObject")) == 3
    names = {(o["kind"], o["metadata"]["name"]) for o in rendered("default").objects}
    assert {("Deployment", "rel-pdserve-router"), ("Service", "rel-pdserve-router"),
            ("Deployment", "rel-pdserve-prefill"), ("Service", "rel-pdserve-prefill"),
            ("StatefulSet", "rel-pdserve-decode"), ("Service", "rel-pdserve-decode"),
            ("StatefulSet", "rel-pdserve-redis"), ("Service", "rel-pdserve-redis")} <= names
    for name in VALUE_SETS:
        r = rendered(name)
        assert all(o["metadata"]["namespace"] == NAMESPACE for o in r.objects), name
        keys = [(o["kind"], o["metadata"]["name"]) for o in r.objects]
        assert len(keys) == len(set(keys)), f"{name}: an object rendered twice"
        assert "rel-pdserve-router" in r.notes, name


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_helm_lint_strict_passes(name, kube_version):
    report = helm_python.lint(CHART, VALUE_SETS[name], strict=True, namespace=NAMESPACE,
                              kube_version=f"v{kube_version}.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2: warning, 3: error
    assert report["errors"] == [] and problems == [], problems
    assert report["total_charts_linted"] == 1


# -- schemas of the rendered objects -------------------------------------------------------------------------------


def unique_objects(kinds_left_out: tuple[str, ...] = ()) -> dict[str, dict]:
    """Every object rendered by any value set, once ("where" -> object); equal objects are checked once."""
    out = {}
    for name in VALUE_SETS:
        for o in rendered(name).objects:
            if o["kind"] not in kinds_left_out:
                out.setdefault(json.dumps(o, sort_keys=True), (f"{name}: {o['kind']}/{o['metadata']['name']}", o))
    return dict(out.values())


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_core_object_validates_strictly_against_the_kubernetes_schema(kube_version):
    objects = unique_objects(CUSTOM_KINDS)
    assert len(objects) >= 45  # of about 150 rendered, the rest repeat across value sets
    errors = []
    for where, obj in objects.items():
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(f"{where}: {e.message}")
    assert errors == []


def test_custom_resources_validate_against_their_crd_models():
    models = crd_models()
    objects = {w: o for w, o in unique_objects().items() if o["kind"] in CUSTOM_KINDS}
    assert {o["kind"] for o in objects.values()} == set(CUSTOM_KINDS)
    for where, obj in objects.items():
        model = models[(obj["apiVersion"], obj["kind"])].model_validate(obj)  # types, enums, required fields
        # The models ignore unknown fields; a field that does not survive the round trip is one the CRD lacks.
        assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == obj, where


def test_the_crd_models_refuse_what_the_api_server_would():
    models = crd_models()
    so = rendered("keda").component("ScaledObject", "decode")
    with pytest.raises(ValueError, match="triggers"):
        models[("keda.sh/v1alpha1", "ScaledObject")].model_validate({**so, "spec": {"scaleTargetRef": {"name": "x"}}})
    bad = json.loads(json.dumps(so))
    bad["spec"]["maxReplicaCount"] = "many"
    with pytest.raises(ValueError, match="maxReplicaCount"):
        models[("keda.sh/v1alpha1", "ScaledObject")].model_validate(bad)
    sm = json.loads(json.dumps(rendered("hpa").of("ServiceMonitor")[0]))
    sm["spec"]["endpoints"][0]["interval"] = "soon"  # the CRD's pattern for a duration
    with pytest.raises(ValueError, match="interval"):
        models[("monitoring.coreos.com/v1", "ServiceMonitor")].model_validate(sm)


# -- checkov -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkov_findings(tmp_path_factory):
    """checkov over every value set's rendering, without the skip file: all findings."""
    folder = tmp_path_factory.mktemp("rendered")
    for name in VALUE_SETS:
        (folder / f"{name}.yaml").write_text(yaml.safe_dump_all(rendered(name).objects, sort_keys=False))
    return run_checkov(folder, framework="kubernetes")


def skipped_checks() -> list[str]:
    return yaml.safe_load(CHECKOV_CONFIG.read_text())["skip-check"]


def test_checkov_fails_only_skipped_checks_and_only_where_their_reason_applies(checkov_findings):
    assert checkov_findings.passed > 1000  # every value set was scanned
    skips = set(skipped_checks())
    assert skips == set(CHECKOV_SKIP_SCOPE), "helm/pdserve/.checkov.yaml and CHECKOV_SKIP_SCOPE disagree"
    unexpected = []
    for f in checkov_findings.failed:
        kind, _, name = f.resource.split(".", 2)
        scope = CHECKOV_SKIP_SCOPE.get(f.check_id, set())
        if f.check_id not in skips or (scope is not None and f"{kind}/{name}" not in scope):
            unexpected.append(f"{f.check_id} {f.resource} ({f.file}): {f.check_name}")
    assert unexpected == [], "fix these, or skip them with a reason in helm/pdserve/.checkov.yaml"
    stale = skips - {f.check_id for f in checkov_findings.failed}
    assert stale == set(), f"skipped checks that no longer fail anywhere: drop them from .checkov.yaml: {stale}"


def test_every_checkov_skip_has_a_written_reason_and_checkov_reads_the_file():
    lines = CHECKOV_CONFIG.read_text().splitlines()
    for check in skipped_checks():
        i = lines.index(f"  - {check}")
        reason = []
        for line in reversed(lines[:i]):  # the comment block right above the entry
            if not line.strip().startswith("#"):
                break
            reason.append(line.strip(" #"))
        assert len(" ".join(reason)) >= 60, f"{check} has no reason above it in {CHECKOV_CONFIG}"
    shown = subprocess.run([checkov(), "--config-file", str(CHECKOV_CONFIG), "--show-config"],
                           capture_output=True, text=True, timeout=120, cwd=CHART)
    assert shown.returncode == 0, shown.stderr
    assert f"Config File ({CHECKOV_CONFIG})" in shown.stdout
    assert re.search(r"skip-check:\s+\[" + ", ".join(f"'{c}'" for c in skipped_checks()) + r"\]", shown.stdout)


# -- the values schema ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, message",
    [
        ({"decode": {"replicas": -1}}, "/decode/replicas"),
        ({"decode": {"replica": 2}}, "replica"),  # a misspelled key
        ({"autoscaling": {"engine": "cpu"}}, "/autoscaling/engine"),
        ({"prefill": {"settings": {"port": 6000}}}, "invalid propertyName 'port'"),  # a flag the chart sets
        ({"decode": {"autoscaling": {"kvCacheUsage": {"averageValue": 70}}}}, "averageValue"),  # 0-1
        ({"router": {"grpcPort": 70000}}, "/router/grpcPort"),
        ({"model": {"volume": {"type": "nfs"}}}, "/model/volume/type"),
        ({"model": {"quantization": "int4"}}, "/model/quantization"),
        ({"decode": {"settings": {"quantization": "int8-dynamic"}}}, "invalid propertyName 'quantization'"),
        ({"image": {"digest": "latest"}}, "/image/digest"),
        ({"redis": {"external": {"url": "http://redis"}}}, "/redis/external/url"),
    ],
)
def test_the_values_schema_refuses_bad_values(values, message):
    with pytest.raises(helm_python.HelmValuesError, match=re.escape(message)):
        render(values)
    report = helm_python.lint(CHART, values, strict=True)
    assert any(m["severity"] == 3 and message in m["error"] for m in report["messages"]), report


@pytest.mark.parametrize(
    "values, message",
    [
        ({"prefill": {"autoscaling": {"enabled": True, "ttft": {"enabled": True}}}}, "needs autoscaling.engine=keda"),
        ({"decode": {"autoscaling": {"enabled": True, "kvCacheUsage": {"enabled": False},
                                     "runningRequests": {"enabled": False}}}}, "at least one of its signals"),
        ({"redis": {"enabled": False}}, "redis.external.url or redis.external.existingSecret"),
        ({"model": {"volume": {"type": "persistentVolumeClaim"}, "buildTiny": {"enabled": False}}},
         "model.volume.claimName is required"),
        ({"model": {"volume": {"type": "hostPath", "hostPath": "/srv/models"}}}, "model.buildTiny.enabled needs"),
        ({"tls": {"enabled": True}}, "tls.existingSecret, or tls.cert"),
        ({"router": {"publicTls": {"enabled": True}}}, "router.publicTls.existingSecret is required"),
    ],
)
def test_values_that_contradict_each_other_fail_with_a_message_naming_them(values, message):
    with pytest.raises(helm_python.HelmError, match=re.escape(message)):
        render(values)


def test_the_schema_covers_exactly_the_keys_of_values_yaml():
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"

    def walk(values: dict, node: dict, path: str) -> None:
        assert node.get("type") == "object", path
        props = node.get("properties", {})
        if node.get("additionalProperties") is False:
            assert set(values) == set(props), path  # nothing undocumented, nothing unused
            assert set(node.get("required", props)) == set(props), path
        for key, value in values.items():
            if isinstance(value, dict) and key in props and "properties" in props[key]:
                walk(value, props[key], f"{path}.{key}")

    walk(yaml.safe_load((CHART / "values.yaml").read_text()), schema, "values")


# -- values.yaml and the shipped files -----------------------------------------------------------------------------


def test_every_key_of_values_yaml_has_a_comment():
    """Each key line (at any depth, list items' own fields aside) has a comment line right above it."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    key = re.compile(r"^(\s*)([A-Za-z0-9_.\-/\"]+):(\s|$)")
    undocumented, list_indent = [], None
    for i, line in enumerate(lines):
        indent = len(line) - len(line.lstrip())
        if line.lstrip().startswith("- "):
            list_indent = indent if list_indent is None else min(list_indent, indent)
            continue
        if list_indent is not None and line.strip() and indent > list_indent:
            continue  # a field of a list item
        list_indent = None if line.strip() else list_indent
        m = key.match(line)
        if m and not lines[i - 1].strip().startswith("#") and "#" not in line.split(":", 1)[1]:
            undocumented.append(f"values.yaml:{i + 1}: {line.strip()}")
    assert undocumented == []


@pytest.mark.parametrize("copy", list(COPIES), ids=lambda p: p.name)
def test_the_chart_ships_exact_copies_of_the_observability_assets(copy):
    original = COPIES[copy]
    assert copy.read_bytes() == original.read_bytes(), f"cp {original.relative_to(ROOT)} {copy.relative_to(ROOT)}"


def test_the_dashboard_and_alerts_reach_their_objects_unchanged():
    r = rendered("hpa")
    (dashboard,) = [c for c in r.of("ConfigMap") if c["metadata"]["name"] == "rel-pdserve-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["pdserve-dashboard.json"]) == json.loads(COPIES[
        CHART / "files" / "pdserve-dashboard.json"].read_text())
    (rule,) = r.of("PrometheusRule")
    alerts = yaml.safe_load((ROOT / "deploy" / "prometheus" / "pdserve-alerts.yml").read_text())
    assert rule["spec"] == alerts  # {{ $value }} in the annotations left to Prometheus
    assert "{{ $value" in json.dumps(rule["spec"])
