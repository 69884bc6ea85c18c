#!/usr/bin/env bash
# The device script: on one H200, in about 5-8 minutes, (1) every kernel test and the CUDA-path tests on
# CUDA (TRITON_INTERPRET=0), the INT8 and group-quantized (int4 / GGUF formats) weight kernels included,
# (2) the decode-step benchmark on a Llama-3-8B-shaped random-weight model in bfloat16 (batch 1/16/64/256,
# 512-1536 tokens of context; CUDA graphs on/off x stream overlap on/off,
# and async scheduling on/off with both on). tests/gpu also holds the swap tier's pinned pages and copy
# stream and the KV cache sized from free device memory (test_cuda_swap_and_sizing.py, issue 19), and
# (3) the memory-pressure benchmark: swap vs recompute vs static (bench_swap.py; OUTPUT_DIR/bench_swap.json).
#
#   tests/gpu/run.sh [OUTPUT_DIR]     # default: $OUT if set, else ./gpu-output
#
# Installs nothing: it needs python3 with torch (CUDA), triton, pytest and numpy, which the device image
# carries; the repository is put on PYTHONPATH instead of `pip install -e .`. Everything printed goes to
# OUTPUT_DIR/gpu_run.log; the benchmark rows also to OUTPUT_DIR/bench_decode.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUTPUT_DIR="${1:-${OUT:-./gpu-output}}"
mkdir -p "$OUTPUT_DIR"
LOG="$OUTPUT_DIR/gpu_run.log"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0

run() {
  local started=$SECONDS
  echo "== $(date -u +%H:%M:%S) $*"
  "$@"
  local rc=$?
  echo "== rc=$rc after $((SECONDS - started)) s"
  return $rc
}

{
  echo "tokenmill device script, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name())"
  status=0
  # tests/worker/test_kernel_backend.py and test_decode_graph_buffers.py stay out: they run the kernels
  # on CPU tensors, which only the interpreter takes; tests/gpu/test_cuda_paths.py is their CUDA twin.
  # --noconftest: tests/conftest.py pulls in the Redis fixtures, which the device image lacks (no redis
  # client); none of these tests use them. -p no:cacheprovider: the checkout may be read-only.
  run timeout 240 "$PYTHON" -m pytest -q --noconftest -p no:cacheprovider -o addopts="" \
      tests/worker/kernels tests/gpu || status=1
  run timeout 330 "$PYTHON" -m tests.gpu.bench_decode --output "$OUTPUT_DIR/bench_decode.json" || status=1
  # issue 19: memory pressure on the GPU, preemption by swap (pinned host pages, copy stream) vs recompute vs static
  run timeout 240 "$PYTHON" -m tests.gpu.bench_swap --output "$OUTPUT_DIR/bench_swap.json" || status=1
  echo "== done: status=$status"
  exit $status
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
