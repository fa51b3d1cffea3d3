#!/usr/bin/env bash
# Set everything up, then run the default test suite (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_WAIT_POLICY=PASSIVE
# Two pytest processes, a test file at a time each (pytest-xdist): the suite waits on worker processes and
# timers much of the time, so two keep both cores busy. `-n 0` (after these) runs it in one process.
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
