from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = "from common.malloc import tune_malloc; print(tune_malloc())"


def run(env_extra: dict[str, str]) -> str:
    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, check=True,
                          timeout=60).stdout.strip()


def test_glibc_takes_the_settings():
    assert run({}) == ("True" if sys.platform.startswith("linux") else "False")


def test_an_operators_malloc_environment_is_left_alone():
    assert run({"MALLOC_TRIM_THRESHOLD_": "1000000"}) == "False"
