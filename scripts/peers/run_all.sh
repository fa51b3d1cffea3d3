#!/usr/bin/env bash
# The whole side-by-side run: vLLM CPU and xpyd (colocated, 1P1D static, 2P2D through etcd), all float32 on the
# same model folder and model name, then scripts/compare_vllm.py and scripts/peers/lm_eval_compare.py against
# all of them; every server started here is stopped on exit (by its PID).
#   scripts/peers/setup_peers.sh                  # once
#   scripts/peers/run_all.sh [OUT_DIR]            # default /tmp/xpyd_peers; results: OUT_DIR/*.json, *.txt
# Environment: DEPLOYMENTS (default "colocated 1p1d 2p2d"), PORT_BASE (default 18700: vLLM +1, colocated +100,
# 1p1d +200, 2p2d +300..+379), LM_EVAL_LIMIT (questions; default all 40), MODEL_DIR (default xpyd's converted
# SmolLM2-135M-Instruct), NAME (default smollm2), READY_TIMEOUT (s, default 420).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-/tmp/xpyd_peers}"
DEPLOYMENTS="${DEPLOYMENTS:-colocated 1p1d 2p2d}"
B="${PORT_BASE:-18700}"
NAME="${NAME:-smollm2}"
PY=.venv/bin/python
MODEL_DIR="${MODEL_DIR:-$($PY -c 'from xpyd.model.loader import ensure_converted; print(ensure_converted(None, progress=False).path)')}"
mkdir -p "$OUT"
PIDS=()
stop_all() {
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do
        for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$pid" 2>/dev/null || true
    done
}
trap stop_all EXIT

wait_ready() {  # wait_ready URL PID NAME
    local deadline=$((SECONDS + ${READY_TIMEOUT:-420}))
    until curl -sf "$1/v1/models" >/dev/null; do
        kill -0 "$2" 2>/dev/null || { echo "$3 exited; see $OUT/$3.log" >&2; exit 1; }
        [ $SECONDS -lt $deadline ] || { echo "$3 not ready in time; see $OUT/$3.log" >&2; exit 1; }
        sleep 2
    done
    echo "$3 ready at $1"
}

XPYD=(--model "$MODEL_DIR" --dtype float32 --served-model-name "$NAME" --trust-request-chat-template)  # (as vLLM's start)
scripts/peers/start_vllm.sh "$MODEL_DIR" $((B + 1)) "$NAME" >"$OUT/vllm.log" 2>&1 &
PIDS+=($!); VLLM_PID=$!
CMP=(--vllm "vllm=http://127.0.0.1:$((B + 1))")
LME=(--server "vllm=http://127.0.0.1:$((B + 1))")
for d in $DEPLOYMENTS; do
    case "$d" in
        colocated) p=$((B + 100)); cmd=(up --colocated --port $p --decode-port $((p + 10))) ;;
        1p1d) p=$((B + 200)); cmd=(up --port $p --prefill-port $((p + 10)) --decode-port $((p + 20))) ;;
        2p2d) p=$((B + 300)); cmd=(up --prefill 2 --decode 2 --etcd-port $((p + 79)) --port $p
                                   --prefill-port $((p + 10)) --decode-port $((p + 30))) ;;
        *) echo "unknown deployment $d (colocated, 1p1d, 2p2d)" >&2; exit 2 ;;
    esac
    $PY -m xpyd "${cmd[@]}" "${XPYD[@]}" >"$OUT/xpyd-$d.log" 2>&1 &
    PIDS+=($!)
    wait_ready "http://127.0.0.1:$p" $! "xpyd-$d"
    CMP+=(--xpyd "$d=http://127.0.0.1:$p"); LME+=(--server "$d=http://127.0.0.1:$p")
done
wait_ready "http://127.0.0.1:$((B + 1))" "$VLLM_PID" vllm

echo "xpyd at $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- xpyd || echo ' (with uncommitted changes in xpyd/)')" | tee "$OUT/versions.txt"
$PY scripts/compare_vllm.py --model-dir "$MODEL_DIR" --served-model-name "$NAME" "${CMP[@]}" \
    --json "$OUT/compare_vllm.json" --progress | tee "$OUT/compare_vllm.txt"
$PY scripts/peers/lm_eval_compare.py --model-dir "$MODEL_DIR" --served-model-name "$NAME" "${LME[@]}" --hf-reference \
    --output-dir "$OUT/lm_eval" --json "$OUT/lm_eval_compare.json" ${LM_EVAL_LIMIT:+--limit "$LM_EVAL_LIMIT"} \
    | tee "$OUT/lm_eval_compare.txt"
