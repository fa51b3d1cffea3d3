#!/usr/bin/env bash
# Set everything up, then start the local 1P1D cluster on http://127.0.0.1:8000 (Ctrl-C stops it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/xpyd up "$@"
