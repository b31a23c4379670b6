#!/usr/bin/env bash
# Start inferd in the background on a private runtime dir, send a few requests
# with inferctl, print the results and the status, then stop it cleanly.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
work=$(mktemp -d /tmp/inferd-demo.XXXXXX)
export INFERD_RUNTIME_DIR="$work/run" INFERD_STATE_DIR="$work/state"
log="$work/inferd.log"

"$BIN/inferd" run >"$log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -rf "$work"' EXIT

for _ in $(seq 100); do
  "$BIN/inferctl" --timeout 0.5 health >/dev/null 2>&1 && break
  sleep 0.2
done

echo "== models"; "$BIN/inferctl" models
for seed in 1 2 3; do
  echo "== infer demo (seed $seed)"; "$BIN/inferctl" infer --model demo --random --seed "$seed"
done
echo "== status"; "$BIN/inferctl" status
kill -TERM $pid
wait $pid && echo "== inferd stopped cleanly (exit 0)"
trap 'rm -rf "$work"' EXIT
echo "== daemon log"; cat "$log"
