#!/usr/bin/env bash
# Builds llama.cpp's OpenAI-compatible server, llama-server, for the peer comparison
# (scripts/peers/compare.sh): from the llama.cpp sources that the llama-cpp-python sdist on the package
# registry vendors (vendor/llama.cpp), with cmake, for this CPU (GGML_NATIVE: -march=native). No
# prebuilt binary is fetched. Outside CI: about 10 minutes on 2 cores (the sdist, 73 MB, downloads in
# ~30 s), too long for a test run that must stay under ~15 minutes, so tests/tokenmill/bench/test_bench_peers.py
# checks its steps with --dry-run only. Everything lands under .peers/ (git-ignored); a finished build is
# not repeated.
#
#   scripts/peers/setup_llama_server.sh              -> .peers/bin/llama-server
#   scripts/peers/setup_llama_server.sh --dry-run    prints the steps instead of running them
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 JOBS=2 scripts/peers/setup_llama_server.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

# shellcheck source=setup_steps.sh
source scripts/peers/setup_steps.sh "$@"  # DRY_RUN, --help, run

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-$(nproc)}"
PYTHON="${PYTHON:-.venv/bin/python}"
PEERS=.peers
SDIST_DIR="$PEERS/sdist"
SRC_DIR="$PEERS/src"
BUILD="$PEERS/build/llama.cpp-$VERSION"
BIN="$PEERS/bin/llama-server"
STAMP="$PEERS/bin/.llama-server-$VERSION"

if [ -x "$BIN" ] && [ -f "$STAMP" ] && [ "$DRY_RUN" = 0 ]; then
    echo "[peers] llama-server from llama-cpp-python $VERSION is already built: $BIN"
    exit 0
fi

# a C/C++ toolchain and cmake (Debian's, or the cmake wheel from the registry into our venv)
if ! command -v g++ >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    run $SUDO apt-get update -qq
    run env DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq build-essential
fi
CMAKE=cmake
if ! command -v cmake >/dev/null 2>&1; then
    run "$PYTHON" -m pip install -q cmake
    CMAKE="$(dirname "$PYTHON")/cmake"
fi

# the sdist only (--no-binary): its vendor/llama.cpp is the source; --no-deps: nothing else is wanted
run mkdir -p "$SDIST_DIR" "$SRC_DIR" "$PEERS/bin"
run "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$SDIST_DIR" "llama-cpp-python==$VERSION"
if [ "$DRY_RUN" = 1 ]; then
    SDIST="$SDIST_DIR/llama_cpp_python-$VERSION.tar.gz"
else
    SDIST=""  # the sdist's name has used both spellings (`ls` of the missing one would end the script under pipefail)
    for candidate in "$SDIST_DIR"/llama_cpp_python-"$VERSION".tar.gz "$SDIST_DIR"/llama-cpp-python-"$VERSION".tar.gz; do
        [ -f "$candidate" ] && { SDIST="$candidate"; break; }
    done
    [ -n "$SDIST" ] || { echo "[peers] no llama-cpp-python $VERSION sdist in $SDIST_DIR" >&2; exit 1; }
fi
run tar -xzf "$SDIST" -C "$SRC_DIR"
SOURCE="$SRC_DIR/$(basename "$SDIST" .tar.gz)/vendor/llama.cpp"

# Release, this CPU's instruction set, static libraries (one self-contained binary), only the server
# target (tests and examples would double the build time). Nothing fetched at build time: no prebuilt
# web UI (LLAMA_USE_PREBUILT_UI would download it; the server runs without one) and no npm build of it;
# no OpenSSL (the model is a local file).
run "$CMAKE" -S "$SOURCE" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF
run "$CMAKE" --build "$BUILD" --target llama-server -j "$JOBS"
run cp "$BUILD/bin/llama-server" "$BIN"
run "$BIN" --version
run touch "$STAMP"
echo "[peers] llama-server: $BIN"
