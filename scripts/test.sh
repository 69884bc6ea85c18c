#!/usr/bin/env bash
# Installs everything, then runs the whole test suite (what .ci/run calls).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
