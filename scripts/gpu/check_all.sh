#!/usr/bin/env bash
# The H200 checks of issue #28 in named stages, each logged to $OUT/<stage>.log, a summary line each at the end.
#
#   bash scripts/gpu/check_all.sh setup tests exact attention transfer engine serve-exact serve-bench
#
# setup is implied. Each stage has its own time limit (seconds, in the table below) so that one command stays
# inside the device tool's 10 minutes and what ran comes back under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/xpyd-gpu-out}"
mkdir -p "$OUT"
source scripts/gpu/device_setup.sh > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
tail -n 8 "$OUT/setup.log"
M=/tmp/models
[ -d $M/small ] || {
  python3 scripts/gpu/make_shape_model.py $M/small --preset smollm2-135m >/dev/null &&
  # weights far from 0.02 so that outputs depend on the context (tokens decided by wide margins)
  python3 - <<'PY'
import json; p = "/tmp/models/small/config.json"; c = json.load(open(p)); c["initializer_range"] = 0.2
json.dump(c, open(p, "w"), indent=1)
PY
}
[ -d $M/llama3-8b ] || python3 scripts/gpu/make_shape_model.py $M/llama3-8b --preset llama3-8b >/dev/null
summary=()
run() {  # run NAME LIMIT CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$name: rc=$rc in $((SECONDS - t0))s :: $(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 | cut -c1-220)")
  echo "== $name rc=$rc ($((SECONDS - t0))s)"; tail -n 25 "$OUT/$name.log"
}
for stage in "$@"; do
  case $stage in
    setup) ;;
    tests) run tests 240 python3 -m pytest -q -x -p no:cacheprovider -o addopts= tests/gpu ;;
    exact) run exact 180 python3 scripts/gpu/exactness.py --model $M/small --dtype float32 --tokens 48 --json "$OUT/exact.json" ;;
    attention) run attention 120 python3 scripts/gpu/attention_bench.py ;;
    transfer) run transfer 150 python3 scripts/gpu/transfer_bench.py ;;
    transfer-spin) run transfer-spin 150 python3 scripts/gpu/transfer_bench.py --spin ;;
    transfer-mps) run transfer-mps 150 bash scripts/gpu/with_mps.sh python3 scripts/gpu/transfer_bench.py ;;
    tests-ipc) run tests-ipc 180 python3 -m pytest -q -x -p no:cacheprovider -o addopts= tests/gpu/test_cuda_ipc_transfer.py ;;
    events) run events 90 bash -c "python3 scripts/gpu/event_probe.py --reps 20 && python3 scripts/gpu/event_probe.py --orphan" ;;
    nixl) run nixl 120 python3 scripts/gpu/nixl_bench.py ;;
    engine) run engine 240 python3 scripts/gpu/engine_bench.py --model $M/llama3-8b --json "$OUT/engine.json" ;;
    serve-exact) run serve-exact 300 python3 scripts/gpu/serve_check.py exact --model $M/small --out "$OUT" ;;
    serve-bench) run serve-bench 480 python3 scripts/gpu/serve_check.py bench --model $M/llama3-8b --out "$OUT" ;;
    serve-gap) run serve-gap 300 python3 scripts/gpu/serve_check.py bench --gap-only --model $M/llama3-8b --out "$OUT" ;;
    serve-bench-pd) run serve-bench-pd 400 python3 scripts/gpu/serve_check.py bench --only pd --model $M/llama3-8b --out "$OUT" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "==== summary"
printf '%s\n' "${summary[@]}"
