#!/usr/bin/env bash
# Installs everything, then starts the cluster (redis-server, scheduler, worker, gateway) serving the
# default model. Extra arguments go to `tokenmill serve` (see `tokenmill serve --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/tokenmill serve "$@"
