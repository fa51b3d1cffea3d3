#!/usr/bin/env bash
# The serving comparison suite against one OpenAI-compatible server (xpyd, vLLM, llama.cpp ...):
#   concurrency 1 and 4 (256-token prompts, 64 output tokens) and the prefill-stall scenario.
#   scripts/bench_suite.sh URL NAME [OUTDIR]  ->  OUTDIR/NAME_{c1,c4,stall}.json (default docs/bench)
# Compare two runs with: .venv/bin/python scripts/ratio_table.py OUTDIR/A OUTDIR/B
set -euo pipefail
cd "$(dirname "$0")/.."
url=$1 name=$2 out=${3:-docs/bench}
mkdir -p "$out"
tok=$(.venv/bin/python -c "from xpyd.model.loader import ensure_converted; print(ensure_converted(None).path)")
bench=(.venv/bin/xpyd bench --url "$url" --tokenizer "$tok" --no-progress)
"${bench[@]}" --num-requests 20 --concurrency 1 --input-len 256 --output-len 64 --warmup 2 \
  --json "$out/${name}_c1.json" > /dev/null
"${bench[@]}" --num-requests 32 --concurrency 4 --input-len 256 --output-len 64 --warmup 2 \
  --json "$out/${name}_c4.json" > /dev/null
"${bench[@]}" --workload prefill-stall --num-requests 400 --duration 60 --seed 1 \
  --json "$out/${name}_stall.json" > /dev/null
echo "wrote $out/${name}_{c1,c4,stall}.json"
