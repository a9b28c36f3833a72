"""Runs checkov (the IaC scanner) as a process: from ``build/checkov`` (``make build/checkov``: a
virtual environment of its own, since checkov's pins conflict with .venv's), else from PATH, else the calling test
skips. What the deployment tests use for the rendered chart (and any other manifests or Dockerfiles)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCAL_CHECKOV = ROOT / "build" / "checkov" / "bin" / "checkov"
TIMEOUT_S = 300


@dataclass(frozen=True)
class Finding:
    check_id: str
    check_name: str
    resource: str  # "Kind.namespace.name", as checkov names it
    file: str


@dataclass(frozen=True)
class Report:
    passed: int
    failed: list[Finding]
    skipped: list[Finding]


def checkov() -> str:
    if LOCAL_CHECKOV.is_file() and os.access(LOCAL_CHECKOV, os.X_OK):
        return str(LOCAL_CHECKOV)
    found = shutil.which("checkov")
    if found:
        return found
    pytest.skip("checkov unavailable: build/checkov is missing (`make build/checkov/bin/checkov` pip-installs it "
                "into its own virtual environment, which failed or was not run) and none is on PATH")


def run_checkov(directory: Path, *, framework: str, config_file: Path | None = None) -> Report:
    """``checkov -d directory --framework framework [--config-file F] -o json``: every check's outcome."""
    cmd = [checkov(), "-d", str(directory), "--framework", framework, "-o", "json", "--compact", "--skip-download"]
    if config_file is not None:
        cmd += ["--config-file", str(config_file)]
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"}
    # Run in the scanned folder: checkov also reads a .checkov.yaml from its working directory (the repository's
    # is the kustomize and Dockerfile scan's), and only the given config file may decide what is skipped.
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=directory)
    # Exit 1 means "some check failed"; anything else but 0 is checkov itself failing.
    assert result.returncode in (0, 1), f"checkov exited {result.returncode}:\n{result.stderr[-4000:]}"
    reports = json.loads(result.stdout) if result.stdout.strip() else []
    reports = reports if isinstance(reports, list) else [reports]
    passed, failed, skipped = 0, [], []
    for report in reports:
        if not isinstance(report, dict) or "results" not in report:  # "no files found" answers a bare summary
            continue
        passed += report["summary"]["passed"]
        for bucket, key in ((failed, "failed_checks"), (skipped, "skipped_checks")):
            bucket.extend(Finding(f["check_id"], f["check_name"], f["resource"], f["file_path"])
                          for f in report["results"].get(key, []))
    return Report(passed, failed, skipped)
