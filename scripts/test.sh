#!/usr/bin/env bash
# Set everything up, then run the default test suite (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_WAIT_POLICY=PASSIVE
exec .venv/bin/python -m pytest "$@"
