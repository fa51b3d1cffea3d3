#!/usr/bin/env bash
# The prefix-cache suite against one OpenAI-compatible server (xpyd, vLLM, ...), cold cache at the start:
#   shared-prefix: 4 prefixes of 1,024 tokens, 64-token suffixes, 32 output tokens, 32 requests, concurrency 2
#                  (the shape of `vllm bench serve --dataset-name prefix_repetition` in the KV-reuse issue)
#   multi-turn:    4 chats of 4 turns, 512-token contexts, 64-token questions, 32-token answers, 1 s think
#                  time, 2 chats at a time
#   scripts/bench_prefix.sh URL NAME [OUTDIR]  ->  OUTDIR/NAME_{shared,multiturn}.json (default docs/bench)
# Compare two runs with: .venv/bin/python scripts/ratio_table.py OUTDIR/A OUTDIR/B
set -euo pipefail
cd "$(dirname "$0")/.."
url=$1 name=$2 out=${3:-docs/bench}
mkdir -p "$out"
tok=$(.venv/bin/python -c "from xpyd.model.loader import ensure_converted; print(ensure_converted(None).path)")
bench=(.venv/bin/xpyd bench --url "$url" --tokenizer "$tok" --no-progress --seed 7)
"${bench[@]}" --workload shared-prefix --num-prefixes 4 --prefix-len 1024 --input-len 64 --output-len 32 \
  --num-requests 32 --concurrency 2 --json "$out/${name}_shared.json" > /dev/null
"${bench[@]}" --endpoint chat --workload multi-turn --conversations 4 --turns 4 --prefix-len 512 \
  --input-len 64 --output-len 32 --think-time 1 --concurrency 2 --json "$out/${name}_multiturn.json" > /dev/null
echo "wrote $out/${name}_{shared,multiturn}.json"
