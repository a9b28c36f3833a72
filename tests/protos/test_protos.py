"""The protos are lint-clean, the committed stubs are current, and no committed change broke the API."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUF = shutil.which("buf") or str(Path(sys.executable).parent / "buf")


def test_generated_stubs_are_current():
    proc = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_buf_lint_standard():
    proc = subprocess.run([BUF, "lint", "protos"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def test_buf_breaking_against_the_previous_protos():
    """The protos (working tree) against the last commit that changed them before them (FILE rules)."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    dirty = _git("status", "--porcelain", "--", "protos")
    commits = _git("log", "--format=%H", "--", "protos").split()
    earlier = commits if dirty else commits[1:]
    against = earlier[0] if earlier else None
    if against is None:
        pytest.skip("the protos have only one committed version")
    proc = subprocess.run([BUF, "breaking", "protos", "--against", f".git#ref={against},subdir=protos"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
