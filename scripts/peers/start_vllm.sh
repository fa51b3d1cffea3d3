#!/usr/bin/env bash
# Start vLLM CPU (from scripts/peers/setup_peers.sh) the way the side-by-side comparisons expect it, in the
# foreground: float32, 127.0.0.1 only, the model answering to NAME, request-level chat templates allowed and
# a tool-call parser set (so chat_template and tool_choice requests are answered, not refused).
#   scripts/peers/start_vllm.sh MODEL_DIR PORT [NAME]      (ready after ~80-130 s: GET /v1/models answers)
# VLLM_CPU_KVCACHE_SPACE (GiB, default 2 here): vLLM's default asks for most of the machine's memory.
set -euo pipefail
MODEL_DIR="${1:?usage: start_vllm.sh MODEL_DIR PORT [NAME]}"
PORT="${2:?usage: start_vllm.sh MODEL_DIR PORT [NAME]}"
NAME="${3:-smollm2}"
VLLM="${PEERS_DIR:-/work/.venvs}/vllm"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
exec "$VLLM/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --dtype float32 \
    --host 127.0.0.1 --port "$PORT" --served-model-name "$NAME" --max-model-len 4096 \
    --trust-request-chat-template --enable-auto-tool-choice --tool-call-parser hermes "${@:4}"
