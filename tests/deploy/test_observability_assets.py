"""The observability assets under deploy/: the Grafana dashboard, the Prometheus alert rules (and their promtool
unit tests) and the prometheus-adapter rules use only metric names that ``common/metrics/names.py`` defines and
that a live cluster exposes; their PromQL parses; the alerts fire when they should and link to the runbook."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from common.metrics.names import ROUTER_METRICS, WORKER_METRICS, exposed_names

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "pdserve-alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "pdserve-alerts.test.yml"
ADAPTER = ROOT / "deploy" / "prometheus" / "adapter-rules.yml"
OPERATIONS = ROOT / "docs" / "operations.md"
LOCAL_PROMTOOL = ROOT / "build" / "promtool"  # `make build/promtool`

METRIC_NAME = re.compile(r"pdserve:[a-zA-Z0-9_:]+")
RATE_OF = re.compile(r"\b(?:rate|irate|increase)\(\s*(pdserve:[a-zA-Z0-9_:]+)")
HPA_METRIC_NAME = re.compile(r"[a-z][a-z0-9_]*")
# What the templates of an adapter metricsQuery expand to (for a syntax check only).
ADAPTER_TEMPLATE = {"<<.LabelMatchers>>": 'namespace="llm",pod=~"p0|p1"', "<<.GroupBy>>": "pod"}
RUNBOOK_PREFIX = "docs/operations.md#"
METRIC_TABLE_START = "<!-- metric table: generated"
METRIC_TABLE_END = "<!-- end of metric table -->"
REGENERATE_TABLE = ".venv/bin/python -m tests.deploy.test_observability_assets"


# -- the assets, as (where, text) pairs --------------------------------------------------------------------


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict]:
    """Every panel that shows data: rows left out, panels inside collapsed rows included."""
    out = []
    for p in dashboard()["panels"]:
        if p["type"] == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    return [
        (f"dashboard panel {p['title']!r} {t['refId']}", t["expr"])
        for p in dashboard_panels()
        for t in p.get("targets", [])
    ]


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def alert_texts() -> list[tuple[str, str]]:
    """Each rule's expression and annotations (names in the prose must exist too)."""
    out = []
    for r in alert_rules():
        out.append((f"alert {r['alert']} expr", r["expr"]))
        out.extend((f"alert {r['alert']} {k}", v) for k, v in r.get("annotations", {}).items())
    return out


def adapter_rules() -> list[tuple[str, dict]]:
    config = yaml.safe_load(ADAPTER.read_text())
    return [
        (f"adapter {section}[{i}]", r)
        for section in ("rules", "externalRules")
        for i, r in enumerate(config.get(section) or [])
    ]


def adapter_texts() -> list[tuple[str, str]]:
    return [(where, r[key]) for where, r in adapter_rules() for key in ("seriesQuery", "metricsQuery")] + [
        (where, r["name"]["matches"]) for where, r in adapter_rules()
    ]


def names_used() -> dict[str, set[str]]:
    """pdserve:* name -> where the assets use it."""
    used: dict[str, set[str]] = {}
    for where, text in dashboard_exprs() + alert_texts() + adapter_texts():
        for name in METRIC_NAME.findall(text):
            used.setdefault(name, set()).add(where)
    return used


def exposed() -> set[str]:
    return {n for spec in ROUTER_METRICS + WORKER_METRICS for n in exposed_names(spec)}


def metric_table() -> str:
    """The metric table of docs/operations.md, from names.py (the test below keeps the two in step)."""
    rows = ["| series | type | labels | where | meaning |", "| --- | --- | --- | --- | --- |"]
    for spec in dict.fromkeys(ROUTER_METRICS + WORKER_METRICS):
        first, *rest = exposed_names(spec)
        series = ", ".join([f"`{first}`"] + [f"`{n.removeprefix(spec.name)}`" for n in rest])
        where = ", ".join(w for w, specs in (("router", ROUTER_METRICS), ("workers", WORKER_METRICS)) if spec in specs)
        labels = ", ".join(f"`{label}`" for label in spec.labels)
        rows.append(f"| {series} | {spec.kind} | {labels} | {where} | {spec.help} |")
    return "\n".join(rows) + "\n"


def promtool() -> str:
    if LOCAL_PROMTOOL.is_file() and os.access(LOCAL_PROMTOOL, os.X_OK):
        return str(LOCAL_PROMTOOL)
    found = shutil.which("promtool")
    if found:
        return found
    pytest.skip(
        "promtool unavailable: build/promtool is missing (`make build/promtool` extracts it from Debian's "
        "prometheus package with apt-get download, which failed or is not available) and none is on PATH"
    )


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120)


def github_anchors(markdown: str) -> list[str]:
    """The anchors GitHub gives the headings of ``markdown`` (lower case, punctuation dropped, spaces -> '-')."""
    anchors = []
    for line in markdown.splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*$", line)
        if m:
            anchors.append(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    return anchors


# -- static checks ------------------------------------------------------------------------------------------


def test_dashboard_loads_and_every_panel_queries_the_datasource_variable():
    d = dashboard()
    assert d["schemaVersion"] >= 39 and d["uid"] == "pdserve-overview"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = dashboard_panels()
    assert len(panels) >= 20
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), ids
    for p in panels:
        assert p["targets"], f"panel {p['title']!r} has no targets"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"]["uid"] == "${datasource}", (p["title"], t)


def test_every_metric_name_the_assets_use_is_defined_in_names_py():
    used = names_used()
    # Each asset names metrics (the check below cannot pass on empty input).
    assert {w.split()[0] for ws in used.values() for w in ws} == {"dashboard", "alert", "adapter"}
    unknown = {name: sorted(where) for name, where in used.items() if name not in exposed()}
    assert not unknown, f"names not exposed according to common/metrics/names.py: {unknown}"


def test_rate_is_taken_only_of_counters_and_histogram_series():
    gauges = {spec.name for spec in ROUTER_METRICS + WORKER_METRICS if spec.kind == "gauge"}
    for where, text in dashboard_exprs() + alert_texts() + adapter_texts():
        for name in RATE_OF.findall(text):
            assert name not in gauges, f"{where}: rate() of the gauge {name}"


def test_alerts_carry_severity_summary_and_a_runbook_anchor_that_exists():
    anchors = github_anchors(OPERATIONS.read_text())
    rules = alert_rules()
    assert {r["alert"] for r in rules} >= {
        "HighTTFTP99",
        "LowGenerationThroughput",
        "HighKVCacheUsage",
        "NoReadyWorkers",
        "RedisUnreachable",
        "HighRepetition",
        "HighErrorRate",
    }
    for r in rules:
        assert r["labels"]["severity"] in ("critical", "warning"), r["alert"]
        notes = r["annotations"]
        assert notes["summary"] and notes["description"], r["alert"]
        assert notes["runbook_url"].startswith(RUNBOOK_PREFIX), (r["alert"], notes["runbook_url"])
        anchor = notes["runbook_url"].removeprefix(RUNBOOK_PREFIX)
        assert anchors.count(anchor) == 1, f"{r['alert']}: docs/operations.md has no single heading #{anchor}"


def test_operations_md_metric_table_is_generated_from_names_py():
    docs = OPERATIONS.read_text()
    start, end = docs.index(METRIC_TABLE_START), docs.index(METRIC_TABLE_END)
    table = docs[docs.index("\n", start) + 1 : end]
    assert table == metric_table(), f"regenerate the table: {REGENERATE_TABLE}"


def test_adapter_rules_expose_hpa_names_that_operations_md_documents():
    docs = OPERATIONS.read_text()
    seen = set()
    for where, r in adapter_rules():
        (series,) = METRIC_NAME.findall(r["seriesQuery"])
        assert re.search(r["name"]["matches"], series), (where, series)
        as_name = r["name"]["as"]
        assert HPA_METRIC_NAME.fullmatch(as_name), f"{where}: {as_name!r} is not a plain HPA metric name"
        assert r["resources"]["overrides"]["namespace"] == {"resource": "namespace"}, where
        assert f"`{as_name}`" in docs, f"{where}: {as_name} is not documented in docs/operations.md"
        seen.add((where.split("[")[0], as_name))
    assert ("adapter rules", "pdserve_requests_per_second") in seen
    assert ("adapter externalRules", "pdserve_pool_num_requests_waiting") in seen


# -- promtool -----------------------------------------------------------------------------------------------


def test_alert_rules_pass_promtool_check():
    result = run_promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_alert_rules_fire_as_their_promtool_unit_tests_expect():
    # Every alert has at least one case in which it fires (so its logic, not only its syntax, is tested).
    cases = [c for t in yaml.safe_load(ALERT_TESTS.read_text())["tests"] for c in t.get("alert_rule_test", [])]
    firing = {c["alertname"] for c in cases if c.get("exp_alerts")}
    assert firing == {r["alert"] for r in alert_rules()}
    result = run_promtool("test", "rules", str(ALERT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_and_adapter_queries_parse_as_promql(tmp_path):
    # promtool parses the expressions of recording rules without a server: wrap every query in one.
    exprs = [e.replace("$__rate_interval", "5m") for _, e in dashboard_exprs()]
    for _, r in adapter_rules():
        (series,) = METRIC_NAME.findall(r["seriesQuery"])
        query = r["metricsQuery"].replace("<<.Series>>", series)
        for template, value in ADAPTER_TEMPLATE.items():
            query = query.replace(template, value)
        assert "<<" not in query, query
        exprs.append(query)
    rules = [{"record": f"pdserve_check:query_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": rules}]}))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


# -- a live cluster -----------------------------------------------------------------------------------------


def scrape(address: str) -> set[str]:
    """Sample names on ``http://address/metrics`` (a labelled metric shows none until a label set exists)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_live_cluster_exposes_every_metric_name_the_assets_use(tiny_model_dir):
    from pdserve.client import Client
    from tests.services.inprocess import inprocess_cluster

    prefill, decode = [{"worker_id": "prefill-0"}], [{"worker_id": "decode-0"}]
    with inprocess_cluster(tiny_model_dir("llama"), prefill=prefill, decode=decode) as cluster:
        with Client(cluster.router, timeout_s=60) as client:
            for _ in range(2):
                client.generate([5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert set(cluster.metrics) == {"prefill-0", "decode-0"}
        scraped = {"router": scrape(cluster.router_http)}
        scraped.update((wid, scrape(address)) for wid, address in cluster.metrics.items())

    everywhere = set().union(*scraped.values())
    missing = {name: sorted(where) for name, where in names_used().items() if name not in everywhere}
    assert not missing, f"used by the assets but not in a live scrape: {missing}"
    # The assets tell a router's series from a worker's by this counter: only routers may expose it.
    assert "pdserve:requests_total" in scraped["router"]
    assert not [wid for wid in cluster.metrics if "pdserve:requests_total" in scraped[wid]]


if __name__ == "__main__":
    print(metric_table(), end="")
