#!/usr/bin/env bash
# `xpyd plan`'s predictions against the simulated cluster: replay one trace on `xpyd up --engine sim` for each
# split and keep the bench's JSON next to the planner's.
#   scripts/plan_vs_sim.sh TRACE OUTDIR TIME_SCALE SLO SPLIT...   (SPLIT: 1P1D, 2P1D, ...)
# Extra `xpyd up` options in UP_ARGS, extra `xpyd bench` options in BENCH_ARGS (e.g. --trace-block-size 32
# --tokenizer PATH). Ports 18000 (proxy), 18100+ (prefill), 18200+ (decode), 12379 (etcd).
set -euo pipefail
trace=$1 out=$2 scale=$3 slo=$4
shift 4
py=${PYTHON:-python}
mkdir -p "$out"
for split in "$@"; do
  x=${split%%P*} rest=${split#*P} y=${rest%D}
  log="$out/up_$split.log"
  $py -m xpyd up --engine sim --prefill "$x" --decode "$y" --port 18000 --prefill-port 18100 \
      --decode-port 18200 --etcd-port 12379 ${UP_ARGS:-} >"$log" 2>&1 &
  up=$!
  for _ in $(seq 1 240); do
    if curl -sf http://127.0.0.1:18000/v1/models >/dev/null 2>&1; then break; fi
    sleep 1
  done
  sleep 5  # every worker registered and seen by the proxy
  echo "== $split: $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
  $py -m xpyd bench --url http://127.0.0.1:18000 --trace "$trace" --time-scale "$scale" --slo "$slo" \
      --no-progress --json "$out/bench_$split.json" ${BENCH_ARGS:-} | tail -40
  echo "== $split done: $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
  kill -TERM "$up"
  wait "$up" || true
done
