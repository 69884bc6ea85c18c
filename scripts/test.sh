#!/usr/bin/env bash
# Installs everything, then runs the whole test suite (what .ci/run calls).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # see tokenmill/cluster/specs.py torch_thread_env
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=20 "$@"  # the slowest 20: the suite must stay under ~15 min
