#!/usr/bin/env bash
# The GPU check in one command (benchmarks/gpu_check.py; its docstring says what each section measures).
#
#   benchmarks/gpu_check.sh [gpu_check.py flags]      e.g. --size 1b, --deadline-s 150, --device cpu --quick
#
# Offline (no hub, no pip install): runs the repository's own code from its root on PYTHONPATH, with the first of
# .venv/bin/python, python3, python whose torch sees a CUDA device (else the first that imports torch). Stops it
# after GPU_CHECK_LIMIT_S seconds (default 240; the script's own --deadline-s, default 220, skips the sections that
# would start later). When $OUT is set, the table is also written to $OUT/gpu_check.txt and the JSON to
# $OUT/gpu_check.json. Exit status: the script's (0: every section ran; a missed target is a result, not an
# error), 124 when the time limit stopped it, 2 without torch; with GPU_CHECK_TESTS=1 (below), where the check's
# is 0, pytest's.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

PY=""  # the first whose torch sees a CUDA device (a checkout's .venv holds the CPU build); else the first with torch
for candidate in "$ROOT/.venv/bin/python" python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" >/dev/null 2>&1; then
        if "$candidate" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1; then
            PY="$candidate"
            break
        fi
        PY="${PY:-$candidate}"
    fi
done
if [ -z "$PY" ]; then
    echo "gpu_check: no python that imports torch (tried .venv/bin/python, python3, python)" >&2
    exit 2
fi

args=("$@")
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    args+=(--json-out "$OUT/gpu_check.json")
fi
echo "gpu_check: $("$PY" -c 'import sys, torch; print(sys.executable, sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.cuda.is_available())'), repo $ROOT"
timeout -k 10 "${GPU_CHECK_LIMIT_S:-240}" "$PY" "$ROOT/benchmarks/gpu_check.py" "${args[@]}" 2>&1 |
    if [ -n "${OUT:-}" ]; then tee "$OUT/gpu_check.txt"; else cat; fi
status=${PIPESTATUS[0]}

# GPU_CHECK_TESTS=1: then the tests marked gpu (tests/gpu) in the same call, stopped after GPU_TESTS_LIMIT_S
# (default 180), where this Python sees CUDA and has pytest; their output also in $OUT/gpu_tests.txt.
if [ "${GPU_CHECK_TESTS:-0}" = 1 ]; then
    if "$PY" -c "import sys, pytest, torch; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1; then
        echo "gpu_check: the tests marked gpu, at most ${GPU_TESTS_LIMIT_S:-180} s"
        (cd "$ROOT" && timeout -k 10 "${GPU_TESTS_LIMIT_S:-180}" "$PY" -m pytest -q -m gpu -p no:cacheprovider \
            tests/gpu 2>&1) | if [ -n "${OUT:-}" ]; then tee "$OUT/gpu_tests.txt"; else cat; fi
        tests=${PIPESTATUS[0]}
        [ "$status" = 0 ] && status=$tests
    else
        echo "gpu_check: tests not run: $PY has no pytest or sees no CUDA device"
    fi
fi
exit "$status"
