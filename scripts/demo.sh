#!/usr/bin/env bash
# Start inferd in the background on a private runtime dir with two models (the
# demo model on ONNX Runtime, and the same model configured for TensorRT, which
# this machine lacks, so it fails over), send a few requests with inferctl,
# print results, status and the flight-data-recorder entries, and stop it cleanly.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${INFERD_BIN:-.venv/bin}
work=$(mktemp -d /tmp/inferd-demo.XXXXXX)
log="$work/inferd.log"
"$BIN/inferd" demo-model "$work/demo.onnx" >/dev/null
cat >"$work/inferd.toml" <<TOML
[daemon]
state_dir = "$work/state"
runtime_dir = "$work/run"

[[models]]
name = "demo"
path = "demo.onnx"

[[models]]
name = "demo-trt"
path = "demo.onnx"
runtime = "tensorrt"
TOML
ctl() { "$BIN/inferctl" --infer-endpoint "ipc://$work/run/infer.sock" \
  --control-endpoint "ipc://$work/run/control.sock" \
  --events-endpoint "ipc://$work/run/events.sock" "$@"; }

"$BIN/inferd" run --config "$work/inferd.toml" >"$log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -rf "$work"' EXIT

# `inferctl health` exits 4 while not serving, as when demo-trt is degraded: read
# the state it prints rather than its exit code.
ready=""
for _ in $(seq 100); do
  health=$(ctl --json --timeout 0.5 health 2>/dev/null || true)
  if grep -q '"state": "\(serving\|degraded\)"' <<<"$health"; then ready=yes; break; fi
  sleep 0.2
done
if [ -z "$ready" ]; then
  echo "inferd did not become ready; its log:" >&2; cat "$log" >&2; exit 1
fi

echo "== models"; ctl models
for seed in 1 2; do
  echo "== infer demo (seed $seed)"; ctl infer --model demo --random --seed "$seed"
done
echo "== infer demo-trt: configured for TensorRT, served by ONNX Runtime (its fallback)"
ctl infer --model demo-trt --random --seed 1
echo "== status"; ctl status
kill -TERM $pid
wait $pid && echo "== inferd stopped cleanly (exit 0)"
trap 'rm -rf "$work"' EXIT
echo "== flight data recorder"; "$BIN/inferd" fdr dump --dir "$work/state/fdr"
echo "== daemon log"; cat "$log"
