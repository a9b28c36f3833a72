"""How the rendered chart's objects connect (render.VALUE_SETS, rendered offline by tests/deploy/render.py): every
container argument is a flag of the ``pdserve`` CLI (from its ``--help``), and each service's command line, with
its --config file and environment, resolves through the services' own config loader to the ports its pod declares;
Services, probes and NetworkPolicies use those ports; each NetworkPolicy admits exactly the pods it means; each
PodDisruptionBudget, HPA, ScaledObject and the ServiceMonitor finds its own pods, on metrics they expose. What each
value does to the pods is tests/deploy/test_helm_chart_values.py; the command lines run for real in
tests/deploy/test_helm_chart_loopback.py."""

from __future__ import annotations

import argparse
import re
from urllib.parse import urlsplit

import pytest
import yaml

from common.config.loader import add_config_args, resolve_config
from common.metrics.names import ROUTER_METRICS, WORKER_METRICS, exposed_names
from services.router.config import RouterConfig
from services.worker.config import WorkerConfig
from tests.deploy.cli_flags import bad_args, flag_value
from tests.deploy.render import CHART, NAMESPACE, VALUE_SETS, Rendered, matches, pdserve_argvs, rendered

pytest.importorskip("helm_python", reason="helm-python-sdk (pip install -e '.[test]')")

SERVICES = ("router", "prefill", "decode")
WORKERS = ("prefill", "decode")
SCRAPERS = "scrapers"  # the peers of networkPolicy.metrics (Prometheus in another namespace)
ADAPTER_RULES = yaml.safe_load((CHART / "files" / "adapter-rules.yml").read_text())
POD_ENV = {"POD_IP": "10.244.1.7", "POD_NAME": "rel-pdserve-decode-0"}  # what the downward API gives


def exposed_by(role: str) -> set[str]:
    specs = ROUTER_METRICS if role == "router" else WORKER_METRICS
    return {n for spec in specs for n in exposed_names(spec)}


def container_ports(spec: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}


def expand(arg: str) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: POD_ENV[m[1]], arg)


# -- command lines -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_container_argument_is_a_flag_the_pdserve_cli_accepts(name):
    argvs = pdserve_argvs(rendered(name))
    assert {argv[0] for _, argv in argvs} >= {"router", "prefill", "decode"}
    for where, argv in argvs:
        if argv[0] == "generate":  # its one positional argument, the prompt, first
            argv = argv[:1] + argv[2:]
        assert bad_args(argv) == [], where


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_each_service_command_line_resolves_through_its_config_loader(name, tmp_path):
    """The rendered flags, the --config file of the ConfigMap and the environment give a valid config whose ports,
    addresses and Redis URL are the ones the pod and the Services use."""
    r = rendered(name)
    config_map = r.named("ConfigMap", "rel-pdserve-config")
    for role in SERVICES:
        c = r.container(role)
        schema = RouterConfig if role == "router" else WorkerConfig
        parser = argparse.ArgumentParser()
        add_config_args(parser, schema)
        config_file = tmp_path / f"{role}.yaml"
        config_file.write_text(config_map["data"][f"{role}.yaml"])
        assert flag_value(c["args"], "--config") == f"/etc/pdserve/config/{role}.yaml"
        argv = [expand(a) for a in c["args"][1:]] + [f"--config={config_file}"]
        env = {e["name"]: r.env_value(c, e["name"]) for e in c["env"] if e["name"].startswith("PDSERVE_")}
        config = resolve_config(schema, parser.parse_args(argv), env=env).config

        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert (config.host, config.port) == ("0.0.0.0", ports["grpc"])
        assert config.model == r.merged["model"]["path"]
        redis = urlsplit(config.redis_url)
        if r.merged["redis"]["enabled"]:
            service = r.named("Service", "rel-pdserve-redis")
            assert (redis.hostname, redis.port) == ("rel-pdserve-redis", service["spec"]["ports"][0]["port"])
        else:
            assert config.redis_url == r.merged["redis"]["external"]["url"]
        if role == "router":
            assert config.http_port == ports["http"]
        else:
            assert config.metrics_port == ports["metrics"]
            assert (config.advertise_host, config.worker_id) == (POD_ENV["POD_IP"], POD_ENV["POD_NAME"])
            assert config.device == ("cuda" if r.merged["gpu"]["enabled"] else "cpu")
            for key, value in r.merged[role]["settings"].items():
                assert getattr(config, key.replace("-", "_")) == value, (role, key)


def test_the_downward_api_gives_the_workers_their_pod_ip_and_pod_name():
    r = rendered("default")
    for role in WORKERS:
        env = {e["name"]: e for e in r.container(role)["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        args = r.container(role)["args"]
        assert flag_value(args, "--advertise-host") == "$(POD_IP)"
        assert flag_value(args, "--worker-id") == "$(POD_NAME)"  # the decode StatefulSet's stable names


def test_the_decode_statefulset_is_governed_by_its_headless_service_and_the_router_watches_both_pools():
    r = rendered("default")
    sts = r.named("StatefulSet", "rel-pdserve-decode")
    svc = r.named("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    router_args = r.container("router")["args"]
    for role in WORKERS:
        service = r.named("Service", flag_value(router_args, f"--k8s-{role}-service"))
        assert service["spec"]["clusterIP"] == "None"
        meta, _ = r.pod_of(role)
        assert matches({"matchLabels": service["spec"]["selector"]}, meta["labels"])


# -- ports, Services, probes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_services_target_ports_the_selected_pods_listen_on(name):
    r = rendered(name)
    for svc in r.of("Service"):
        selected = [(m, s) for _, m, s in r.pods() if matches({"matchLabels": svc["spec"]["selector"]}, m["labels"])]
        assert len(selected) == 1, svc["metadata"]["name"]
        ports = container_ports(selected[0][1])
        for p in svc["spec"]["ports"]:
            target = p["targetPort"]
            assert target in ports if isinstance(target, str) else target in ports.values(), (svc, p)
            if svc["spec"].get("clusterIP") == "None":
                assert p["port"] == ports[target]  # headless: clients dial the pod's own port


def probes(container: dict) -> dict[str, dict]:
    return {k: container[k] for k in ("startupProbe", "livenessProbe", "readinessProbe") if k in container}


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_service_container_has_its_three_probes(name):
    r = rendered(name)
    for role in SERVICES + (("redis",) if r.merged["redis"]["enabled"] else ()):
        found = probes(r.container(role))
        assert set(found) == {"startupProbe", "livenessProbe", "readinessProbe"}, (name, role)


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_probes_ask_the_ports_the_services_serve_on(name):
    """gRPC probes hit the service's --port (grpc.health.v1), HTTP probes its /healthz and /readyz on --http-port
    (router) or --metrics-port (workers); a port with TLS is never probed over gRPC (kubelet speaks plaintext)."""
    r = rendered(name)
    for role in SERVICES:
        c = r.container(role)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        grpc_port = int(flag_value(c["args"], "--port"))
        http_port = int(flag_value(c["args"], "--http-port" if role == "router" else "--metrics-port"))
        assert (ports["grpc"], ports["http" if role == "router" else "metrics"]) == (grpc_port, http_port)
        tls = r.merged["router"]["publicTls"]["enabled"] if role == "router" else r.merged["tls"]["enabled"]
        for kind, probe in probes(c).items():
            if "grpc" in probe:
                assert not tls, (role, kind)
                assert probe["grpc"]["port"] == grpc_port, (role, kind)
            else:
                assert probe["httpGet"]["port"] == http_port, (role, kind)
                assert probe["httpGet"]["path"] == ("/readyz" if kind == "readinessProbe" else "/healthz")
        startup = probes(c)["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= (300 if role != "router" else 60)


def test_probes_switch_to_http_where_the_grpc_port_has_tls():
    for role in SERVICES:
        assert "grpc" in rendered("default").container(role)["readinessProbe"]
        assert "httpGet" in rendered("tls").container(role)["readinessProbe"]


# -- NetworkPolicies -----------------------------------------------------------------------------------------------


def pod_components(r: Rendered) -> dict[str, dict]:
    """component -> its pods' labels."""
    return {m["labels"]["app.kubernetes.io/component"]: m["labels"] for _, m, _ in r.pods()}


def admitted(r: Rendered, peers: list[dict] | None) -> set[str]:
    """Which sources a rule's "from" admits: components of this namespace, SCRAPERS, or "anyone"."""
    if not peers:
        return {"anyone"}
    out = set()
    for peer in peers:
        if "namespaceSelector" in peer or "ipBlock" in peer:
            out.add(SCRAPERS if peer == {"namespaceSelector": r.merged["networkPolicy"]["metrics"]["namespaceSelector"],
                                         "podSelector": r.merged["networkPolicy"]["metrics"]["podSelector"]}
                    else "listed namespaces")
        else:
            out |= {c for c, labels in pod_components(r).items() if matches(peer["podSelector"], labels)}
    return out


def ingress_by_port(r: Rendered, component: str) -> dict[str, set[str]]:
    """The one NetworkPolicy selecting ``component``'s pods, as port name -> admitted sources."""
    labels = pod_components(r)[component]
    (policy,) = [p for p in r.of("NetworkPolicy") if matches(p["spec"]["podSelector"], labels)]
    selected = {c for c, lbl in pod_components(r).items() if matches(policy["spec"]["podSelector"], lbl)}
    assert selected == {component}, policy["metadata"]["name"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    _, spec = r.pod_of(component)
    out: dict[str, set[str]] = {}
    for rule in policy["spec"].get("ingress", []):
        for port in rule["ports"]:
            assert port["port"] in container_ports(spec), (component, port)  # a named port of these pods
            out.setdefault(port["port"], set()).update(admitted(r, rule.get("from")))
    return out


def test_network_policies_admit_exactly_the_pods_they_mean():
    r = rendered("default")
    assert ingress_by_port(r, "prefill") == {"grpc": {"router"}, "metrics": {SCRAPERS}}
    assert ingress_by_port(r, "decode") == {"grpc": {"router", "prefill"}, "metrics": {SCRAPERS}}
    assert ingress_by_port(r, "redis") == {"redis": {"router", "prefill", "decode"}}
    assert ingress_by_port(r, "router") == {"grpc": {"anyone"}, "http": {"anyone"}}
    assert ingress_by_port(r, "test") == {}  # the helm test pod accepts nothing
    assert set(pod_components(r)) == {"router", "prefill", "decode", "redis", "test"}  # every pod has its policy


def test_router_ingress_can_be_narrowed_and_still_admits_the_test_pod_and_the_scrapers():
    r = rendered("external-redis")
    assert ingress_by_port(r, "router") == {"grpc": {"listed namespaces", "test"},
                                            "http": {"listed namespaces", "test", SCRAPERS}}
    assert not [p for p in r.of("NetworkPolicy") if p["metadata"]["name"] == "rel-pdserve-redis"]


def test_the_pod_disruption_budgets_select_their_pools():
    r = rendered("default")
    for pdb in r.of("PodDisruptionBudget"):
        selected = {c for c, labels in pod_components(r).items() if matches(pdb["spec"]["selector"], labels)}
        assert selected == {pdb["metadata"]["labels"]["app.kubernetes.io/component"]}
        assert pdb["spec"]["maxUnavailable"] == 1
    assert {p["metadata"]["name"] for p in r.of("PodDisruptionBudget")} == {f"rel-pdserve-{c}" for c in SERVICES}


# -- autoscaling ---------------------------------------------------------------------------------------------------


def adapter_pods_metrics() -> dict[str, str]:
    """HPA `Pods` metric name -> the pdserve series prometheus-adapter computes it from (files/adapter-rules.yml)."""
    out = {}
    for rule in ADAPTER_RULES["rules"]:
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}  # a per-pod figure
        (series,) = re.findall(r"pdserve:[a-z_:]+", rule["seriesQuery"])
        out[rule["name"]["as"]] = series
    return out


def test_each_hpa_scales_its_own_workload_on_a_metric_its_pods_expose():
    r = rendered("hpa")
    expected = {"router": {"pdserve_requests_per_second"}, "prefill": {"pdserve_num_requests_waiting"},
                "decode": {"pdserve_kv_cache_usage_perc", "pdserve_num_requests_running"}}
    adapter = adapter_pods_metrics()
    for role in SERVICES:
        hpa = r.component("HorizontalPodAutoscaler", role)
        target = hpa["spec"]["scaleTargetRef"]
        workload = r.named(target["kind"], target["name"])
        assert workload["metadata"]["labels"]["app.kubernetes.io/component"] == role
        kind = "StatefulSet" if role == "decode" else "Deployment"
        assert (target["apiVersion"], target["kind"]) == ("apps/v1", kind)
        assert "replicas" not in workload["spec"]  # the HPA owns it
        a = r.merged[role]["autoscaling"]
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (a["minReplicas"], a["maxReplicas"])
        assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == a["scaleDownStabilizationS"]
        names = set()
        for m in hpa["spec"]["metrics"]:
            assert m["type"] == "Pods" and m["pods"]["target"]["type"] == "AverageValue"
            name = m["pods"]["metric"]["name"]
            assert name in adapter, f"{role}: {name} is not served by prometheus-adapter's rules"
            series = adapter[name]
            assert series in exposed_by(role) or series + "_total" in exposed_by(role), (role, name, series)
            names.add(name)
        assert names == expected[role]
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"]
               for m in r.component("HorizontalPodAutoscaler", "decode")["spec"]["metrics"]}
    assert targets == {"pdserve_kv_cache_usage_perc": "700m", "pdserve_num_requests_running": "48"}
    assert not rendered("default").of("HorizontalPodAutoscaler")
    assert rendered("default").named("StatefulSet", "rel-pdserve-decode")["spec"]["replicas"] == 1


def test_each_scaled_object_queries_series_of_its_own_pods():
    r = rendered("keda")
    assert not r.of("HorizontalPodAutoscaler")  # KEDA makes its own
    pods = {"router": "rel-pdserve-router-5d9c7b-x2x4z", "prefill": "rel-pdserve-prefill-7f8c9d-abcde",
            "decode": "rel-pdserve-decode-3"}
    expected = {"router": {"requests-per-second"}, "prefill": {"queue-depth", "ttft"}, "decode": {"kv-cache-usage"}}
    for role in SERVICES:
        so = r.component("ScaledObject", role)
        target = so["spec"]["scaleTargetRef"]
        assert r.named(target["kind"], target["name"])["metadata"]["labels"]["app.kubernetes.io/component"] == role
        assert so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"][
            "stabilizationWindowSeconds"] == r.merged[role]["autoscaling"]["scaleDownStabilizationS"]
        assert {t["name"] for t in so["spec"]["triggers"]} == expected[role]
        for t in so["spec"]["triggers"]:
            assert t["type"] == "prometheus" and t["authenticationRef"] == {"name": "prometheus-auth"}
            query = t["metadata"]["query"]
            assert t["metadata"]["serverAddress"] == r.merged["autoscaling"]["keda"]["serverAddress"]
            source = "router" if t["name"] == "ttft" else role  # TTFT is measured at the routers
            (series,) = re.findall(r"pdserve:[a-z_:]+", query)
            assert series in exposed_by(source), (role, t["name"], series)
            assert f'namespace="{NAMESPACE}"' in query
            (pod_re,) = re.findall(r'pod=~"([^"]+)"', query)
            assert {c for c, pod in pods.items() if re.fullmatch(pod_re, pod)} == {source}, (role, t["name"])
            float(t["metadata"]["threshold"])
            assert t["metricType"] == ("Value" if t["name"] == "ttft" else "AverageValue")


def test_keda_queries_parse_as_promql(tmp_path):
    from tests.deploy.test_observability_assets import run_promtool

    queries = [t["metadata"]["query"] for so in rendered("keda").of("ScaledObject") for t in so["spec"]["triggers"]]
    rules = [{"record": f"pdserve_check:keda_{i}", "expr": q} for i, q in enumerate(queries)]
    path = tmp_path / "keda.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "keda", "rules": rules}]}))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_the_service_monitor_scrapes_every_metrics_port_with_pod_labels():
    r = rendered("hpa")
    (sm,) = r.of("ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    scraped = [s for s in r.of("Service") if matches(sm["spec"]["selector"], s["metadata"]["labels"])]
    assert {s["metadata"]["name"] for s in scraped} == {f"rel-pdserve-{c}" for c in SERVICES}
    endpoint_ports = {e["port"] for e in sm["spec"]["endpoints"]}
    for s in scraped:
        ports = {p["name"] for p in s["spec"]["ports"]}
        assert len(ports & endpoint_ports) == 1, s["metadata"]["name"]  # exactly one of its ports is scraped
        assert ports & endpoint_ports <= {"http", "metrics"}
    assert all(e["path"] == "/metrics" for e in sm["spec"]["endpoints"])
