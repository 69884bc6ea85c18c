#!/usr/bin/env bash
# Installs everything, then runs the whole test suite (what .ci/run calls).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # see tokenmill/cluster/specs.py torch_thread_env
# One pytest worker a core, up to 4 (TEST_WORKERS overrides): run alone, the suite keeps about one core busy
# (most tests wait on a cluster's processes, a restart, a timeout), so on CI's 2 cores two workers take
# a third off it (1,613 -> 1,095 s on a 2-core EPYC; 817 s with the worker's lighter import and the rank tests'
# forkserver). A file stays on one worker: its module-scoped clusters start once.
workers="${TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}"
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile \
    --durations=20 "$@"  # the slowest 20: the suite must stay under ~15 min
