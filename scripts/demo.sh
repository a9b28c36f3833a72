#!/usr/bin/env bash
# The README's run command: start a local cluster (Redis, router, prefill and decode workers) serving the
# model in $1, stream one generation through the router, then stop everything. Nothing is left running.
set -euo pipefail
model=$1
prompt=${2:-The class statement}
bin=$(dirname "$0")/../.venv/bin
out=$(mktemp)
"$bin/pdserve" up --model "$model" --prefill 1 --decode 1 --worker-arg=--kv-cache-memory=2e8 >"$out" &
up_pid=$!
trap 'kill -INT $up_pid 2>/dev/null; wait $up_pid 2>/dev/null; rm -f "$out"' EXIT
for _ in $(seq 1 240); do
  grep -q '^pdserve ready:' "$out" && break
  kill -0 $up_pid 2>/dev/null || { echo "pdserve up failed" >&2; exit 1; }
  sleep 0.5
done
grep '^pdserve ready:' "$out" >&2 || { echo "pdserve up did not become ready" >&2; exit 1; }
router=$(awk '/^pdserve ready:/{print $3}' "$out")
"$bin/pdserve" generate "$prompt" --router "$router" --max-tokens 32
