"""checkov over the Dockerfile and each kustomize overlay's output: no failed check, and every check pdserve skips
has its reason written down (.checkov.yaml for global skips, a ``checkov.io/skipN: ID=reason`` annotation for one
object). checkov lives in its own venv (``make build/checkov``): it pins packaging and networkx below what the
project's venv needs. The Helm chart's checkov run is the chart's own test."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / ".checkov.yaml"
OVERLAYS = ("cpu-dev", "gpu-prod")
LOCAL_CHECKOV = ROOT / "build" / "checkov" / "bin" / "checkov"  # `make build/checkov`
TIMEOUT_S = 120
MIN_REASON_CHARS = 40


def checkov_binary() -> str | None:
    return str(LOCAL_CHECKOV) if LOCAL_CHECKOV.exists() else shutil.which("checkov")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict[str, dict]:
    """checkov's JSON report by framework ("dockerfile", "kubernetes") over the Dockerfile and both overlays."""
    checkov, kubectl = checkov_binary(), shutil.which("kubectl")
    if checkov is None:
        pytest.skip("checkov is not installed: `make build/checkov` (a venv of its own under build/)")
    if kubectl is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` builds the overlays checkov reads")
    scan = tmp_path_factory.mktemp("checkov")
    shutil.copy(ROOT / "Dockerfile", scan / "Dockerfile")
    for overlay in OVERLAYS:
        out = subprocess.run([kubectl, "kustomize", str(ROOT / "k8s" / "overlays" / overlay)],
                             capture_output=True, text=True, timeout=TIMEOUT_S, check=True)
        (scan / overlay).mkdir()
        (scan / overlay / "all.yaml").write_text(out.stdout)
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"}  # offline
    out = subprocess.run([checkov, "--config-file", str(CONFIG), "-d", str(scan), "-o", "json"],
                         capture_output=True, text=True, timeout=TIMEOUT_S, cwd=scan, env=env)
    assert out.returncode in (0, 1), out.stderr  # 1: failed checks, reported below
    reports = json.loads(out.stdout)
    return {r["check_type"]: r for r in (reports if isinstance(reports, list) else [reports])}


def test_no_check_fails_on_the_dockerfile_and_the_manifests(report):
    assert set(report) == {"dockerfile", "kubernetes"}
    for framework, r in report.items():
        failed = [f"{c['check_id']} {c['resource']}: {c['check_name']}" for c in r["results"]["failed_checks"]]
        assert failed == [], f"{framework}: fix these or skip them with a reason in .checkov.yaml"
        assert r["summary"]["parsing_errors"] == 0
    assert report["dockerfile"]["summary"]["passed"] > 50
    assert report["kubernetes"]["summary"]["resource_count"] >= 2 * 19  # every object of both overlays


def test_every_skipped_check_has_a_written_reason():
    lines = CONFIG.read_text().splitlines()
    skips = yaml.safe_load(CONFIG.read_text())["skip-check"]
    assert skips, "nothing skipped: drop this test's reason check"
    for check in skips:
        i = next(n for n, line in enumerate(lines) if line.strip() == f"- {check}")
        reason = []
        for line in reversed(lines[:i]):  # the comment block right above the entry
            if not line.strip().startswith("#"):
                break
            reason.append(line.strip("# "))
        assert len(" ".join(reason)) >= MIN_REASON_CHARS, f"{check} in .checkov.yaml has no reason above it"
    for path in (ROOT / "k8s").rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict):
                continue
            for key, value in doc.get("metadata", {}).get("annotations", {}).items():
                if key.startswith("checkov.io/skip"):
                    assert re.fullmatch(rf"CKV2?_\w+=.{{{MIN_REASON_CHARS},}}", value), f"{path}: {key}: {value}"
