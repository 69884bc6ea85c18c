#!/usr/bin/env bash
# tokenmill vs vLLM's CPU backend vs llama.cpp's llama-server, on the same model (the default
# SmolLM2-135M-Instruct: its Q4_1 GGUF file for tokenmill and llama-server, the HF folder converted from
# it for vLLM), the same workload and the same client (`tokenmill bench --openai-url`, streamed
# /v1/completions), one server after the other in one run; then the side-by-side table, with each side's
# dtype / format and the CPU's flags (lscpu), goes into docs/benchmarks.md. Outside CI. Run on a quiet
# machine: every server gets all cores.
#
#   scripts/peers/setup_llama_server.sh && scripts/peers/setup_vllm_cpu.sh     once (see each script)
#   scripts/peers/compare.sh                                all sides, dtypes float32 and bfloat16
#   scripts/peers/compare.sh --sides tokenmill,llama-server --dtypes bfloat16 -- --num-requests 32
#   scripts/peers/compare.sh --dry-run                      prints what it would run
#   scripts/peers/compare.sh --near-free --sides tokenmill,vllm --dtypes float32
#                                                           the stack's ceiling (issue 33): see below
#   scripts/peers/compare.sh --model qwen2.5-1.5b           a real model's shapes (issue 34): see below
#
# Options: --sides LIST (tokenmill,vllm,llama-server), --dtypes LIST (activation dtypes for tokenmill and
# vLLM; llama-server runs the file's own quantization), --vllm-dtypes LIST (vLLM's own, where they differ:
# e.g. tokenmill's float32 on a CPU without native bfloat16 beside vLLM's bfloat16), --tokenmill-variants
# 'FLAGS;FLAGS' (tokenmill runs once per variant, each with those extra serve flags; an empty variant is the
# default, e.g. ';--cpu-int8-activations'), --out DIR (bench_out/peers), --doc FILE
# (docs/benchmarks.md), and after `--` extra `tokenmill bench` arguments (later ones win). The workload:
# concurrency 1 (sync) and 32, 100 requests per level, 128-token prompts, outputs uniform in 32-256,
# greedy, EOS ignored. Environment: THREADS (all cores), LLAMA_SLOTS (32: llama-server's parallel
# sequences; at least the highest concurrency), LLAMA_CTX_PER_SLOT (512: prompt + longest output),
# VLLM_CPU_KVCACHE_SPACE (4 GiB), READY_TIMEOUT_S (900: vLLM compiles for ~100 s), TOKENMILL_SERVE_ARGS
# (extra `tokenmill serve` flags), LLAMA_SERVER (.peers/bin/llama-server), LLAMA_SERVER_ARGS (extra llama-server flags, named in its row: on a CPU
# with AMX, llama-server 0.3.36's AMX weight repacking segfaults at warm-up; --no-repack runs it).
#
# --model NAME: instead of the default model, a random-weight model of a real one's shapes (issue 34:
# llama3.2-1b, qwen2.5-1.5b, llama3.2-3b, llama3.1-8b; issue 36's mixture of experts qwen3-30b-a3b, ~18 GB,
# with no bfloat16 HF folder, so no vLLM side), written once by scripts/peers/make_shapes.py into
# .peers/shapes: tokenmill and llama-server serve its Q4_K_M GGUF file, vLLM its bfloat16 HF folder (written
# only when vllm is a side); the client tokenizes with the file's tokenizer (bench --model). The workload is
# issue 34's: concurrency 1, 4, 16 and 64, 64 requests per level, 512-token prompts, 64-128 output tokens,
# greedy, EOS ignored; llama-server gets 64 slots of 1024 tokens; dtypes default to bfloat16. Its table has
# its own markers in the doc (peers.py --section shape-NAME), with ITL P99 and each server's RSS after its run.
#
# --near-free: instead of the default model, the near-free model of `tokenmill bench-stack` (1 layer, hidden
# 64, random weights, the default tokenizer; written once to .peers/hf/near-free by
# tokenmill.bench.near_free_model), served as that HF folder by tokenmill and vLLM (llama-server takes GGUF
# files only: not a side here), with the stack's workload: concurrency 64 and 256, 512 requests per level,
# 32-token prompts, 128 output tokens, greedy, EOS ignored; both servers may run MAX_NUM_SEQS (256) requests
# at once and batch as many tokens a step (tokenmill --max-num-seqs / --max-num-batched-tokens, vLLM
# --max-num-seqs / --max-num-batched-tokens). Its table has its own markers in the doc (peers.py --section).
set -euo pipefail
cd "$(dirname "$0")/../.."

SIDES_WANTED="tokenmill,vllm,llama-server"
DTYPES="float32,bfloat16"
OUT=bench_out/peers
DOC=docs/benchmarks.md
DRY_RUN=0
NEAR_FREE=0
SHAPE=""
DTYPES_GIVEN=0
VLLM_DTYPES=""
OUT_GIVEN=0
TOKENMILL_VARIANTS=""
EXTRA=()
ORIGINAL_ARGS="$([ $# -eq 0 ] || printf ' %q' "$@")"  # quoted as a shell would need them
while [ $# -gt 0 ]; do
    case "$1" in
        --sides) SIDES_WANTED="$2"; shift 2 ;;
        --tokenmill-variants) TOKENMILL_VARIANTS="$2"; shift 2 ;;
        --dtypes) DTYPES="$2"; DTYPES_GIVEN=1; shift 2 ;;
        --vllm-dtypes) VLLM_DTYPES="$2"; shift 2 ;;
        --out) OUT="$2"; OUT_GIVEN=1; shift 2 ;;
        --doc) DOC="$2"; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        --near-free) NEAR_FREE=1; shift ;;
        --model) SHAPE="$2"; shift 2 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) echo "compare.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
done
for side in ${SIDES_WANTED//,/ }; do
    case "$side" in tokenmill|vllm|llama-server) ;; *) echo "compare.sh: --sides: unknown side $side" >&2; exit 2 ;; esac
done
if [ "$NEAR_FREE" = 1 ] && [[ ",$SIDES_WANTED," == *",llama-server,"* ]]; then
    [[ "$ORIGINAL_ARGS" == *--sides* ]] || SIDES_WANTED="tokenmill,vllm"  # the default sides, less llama-server
    [[ ",$SIDES_WANTED," != *",llama-server,"* ]] || {
        echo "compare.sh: --near-free: llama-server serves GGUF files only; leave it out of --sides" >&2; exit 2; }
fi
SHAPES="llama3.2-1b qwen2.5-1.5b llama3.2-3b llama3.1-8b qwen3-30b-a3b"  # make_shapes.py's MODELS
if [ -n "$SHAPE" ]; then
    [[ " $SHAPES " == *" $SHAPE "* ]] || { echo "compare.sh: --model: unknown model $SHAPE (one of: $SHAPES)" >&2; exit 2; }
    [ "$NEAR_FREE" = 0 ] || { echo "compare.sh: --model and --near-free exclude each other" >&2; exit 2; }
    [ "$DTYPES_GIVEN" = 1 ] || DTYPES=bfloat16
fi
VLLM_DTYPES="${VLLM_DTYPES:-$DTYPES}"
for dtype in ${DTYPES//,/ } ${VLLM_DTYPES//,/ }; do
    case "$dtype" in float32|bfloat16|float16) ;; *) echo "compare.sh: --dtypes / --vllm-dtypes: unknown dtype $dtype" >&2; exit 2 ;; esac
done

PYTHON=.venv/bin/python
TOKENMILL=.venv/bin/tokenmill
VLLM_VENV=.peers/vllm-venv
HF_DIR=.peers/hf/SmolLM2-135M-Instruct
LLAMA_SERVER="${LLAMA_SERVER:-.peers/bin/llama-server}"
THREADS="${THREADS:-$(nproc)}"
LLAMA_SLOTS_SET="${LLAMA_SLOTS:-}"  # as the environment gave them: a --model run has its own defaults
LLAMA_CTX_PER_SLOT_SET="${LLAMA_CTX_PER_SLOT:-}"
LLAMA_SLOTS="${LLAMA_SLOTS:-32}"
LLAMA_CTX_PER_SLOT="${LLAMA_CTX_PER_SLOT:-512}"
READY_TIMEOUT_S="${READY_TIMEOUT_S:-900}"
BENCH_ARGS=(--concurrency 1,32 --num-requests 100 --prompt-len 128 --min-output 32 --max-output 256
            --warmup 2 --no-plots "${EXTRA[@]}")
GGUF="$("$PYTHON" -c 'from gateway.text.tokenizer import default_model_path; print(default_model_path())')"
MAX_NUM_SEQS="${MAX_NUM_SEQS:-256}"
TOKENMILL_MODEL=()
TOKENMILL_WEIGHTS="weights from the GGUF Q4_1 file"
VLLM_MODEL=("$HF_DIR" --served-model-name smollm2)
VLLM_WEIGHTS="HF folder of the GGUF's weights dequantized to float32"
SECTION=peers
if [ "$NEAR_FREE" = 1 ]; then
    HF_DIR=.peers/hf/near-free
    SECTION=near-free
    STEP_BUDGET=$((MAX_NUM_SEQS > 2048 ? MAX_NUM_SEQS : 2048))  # vLLM's CPU default, or every stream's token
    TOKENMILL_MODEL=(--model "$HF_DIR" --max-num-seqs "$MAX_NUM_SEQS" --max-num-batched-tokens "$STEP_BUDGET")
    TOKENMILL_WEIGHTS="near-free model (1 layer, hidden 64, random float32 weights), $HF_DIR"
    VLLM_MODEL=("$HF_DIR" --served-model-name near-free --max-num-seqs "$MAX_NUM_SEQS"
                --max-num-batched-tokens "$STEP_BUDGET")
    VLLM_WEIGHTS="$TOKENMILL_WEIGHTS"
    BENCH_ARGS=(--concurrency 64,256 --num-requests 512 --prompt-len 32 --min-output 128 --max-output 128
                --warmup 2 --no-plots "${EXTRA[@]}")
    echo "+ $PYTHON -m tokenmill.bench.near_free_model $HF_DIR"
    [ "$DRY_RUN" = 1 ] || [ -f "$HF_DIR/model.safetensors" ] || "$PYTHON" -m tokenmill.bench.near_free_model "$HF_DIR"
fi

wants() { [[ ",$SIDES_WANTED," == *",$1,"* ]]; }
LLAMA_FORMAT="GGUF Q4_1 file with its own Q4_1 kernels"
LLAMA_ALIAS=smollm2
if [ -n "$SHAPE" ]; then
    SHAPES_DIR=.peers/shapes
    GGUF="$SHAPES_DIR/$SHAPE.Q4_K_M.gguf"
    HF_DIR="$SHAPES_DIR/$SHAPE-bf16"
    SECTION="shape-$SHAPE"
    [ "$OUT_GIVEN" = 1 ] || OUT="$OUT/$SHAPE"  # the default model's results stay
    TOKENMILL_MODEL=(--model "$GGUF")
    TOKENMILL_WEIGHTS="$SHAPE-shaped GGUF Q4_K_M file (random weights, make_shapes.py)"
    VLLM_MODEL=("$HF_DIR" --served-model-name "$SHAPE")
    VLLM_WEIGHTS="$SHAPE-shaped HF folder (random bfloat16 weights, make_shapes.py --hf)"
    LLAMA_FORMAT="$SHAPE-shaped GGUF Q4_K_M file with its own kernels"
    LLAMA_ALIAS="$SHAPE"
    LLAMA_SLOTS="${LLAMA_SLOTS_SET:-64}"
    LLAMA_CTX_PER_SLOT="${LLAMA_CTX_PER_SLOT_SET:-1024}"
    BENCH_ARGS=(--model "$GGUF" --concurrency 1,4,16,64 --num-requests 64 --prompt-len 512 --min-output 64
                --max-output 128 --warmup 2 --no-plots "${EXTRA[@]}")
    make=("$PYTHON" scripts/peers/make_shapes.py --model "$SHAPE" --out "$SHAPES_DIR")
    wants vllm && make+=(--hf)
    echo "+ ${make[*]}"
    [ "$DRY_RUN" = 1 ] || "${make[@]}"  # skips what is written already
fi
need() {  # a peer's file, or the script that makes it
    [ "$DRY_RUN" = 1 ] || [ -e "$1" ] || { echo "compare.sh: $1 is missing: run $2 first" >&2; exit 1; }
}
if wants vllm; then
    need "$VLLM_VENV/bin/vllm" scripts/peers/setup_vllm_cpu.sh
    # --near-free and --model write their own
    [ "$NEAR_FREE" = 1 ] || [ -n "$SHAPE" ] || need "$HF_DIR/config.json" scripts/peers/setup_vllm_cpu.sh
fi
wants llama-server && need "$LLAMA_SERVER" scripts/peers/setup_llama_server.sh

free_port() {
    "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

SERVER_PID=""
stop_server() {  # SIGTERM to the server (tokenmill's supervisor stops its children), then its process group
    [ -n "$SERVER_PID" ] || return 0
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true  # what is left of the group it leads (setsid)
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

SIDE_ARGS=()
RSS_ARGS=()
bench_side() {  # NAME FORMAT SLUG COMMAND... (@PORT@ in COMMAND becomes the port)
    local name="$1" format="$2" slug="$3" port model
    shift 3
    port="$(free_port)"
    local command=("${@//@PORT@/$port}")
    local bench=("$TOKENMILL" bench --openai-url "http://127.0.0.1:$port/v1" "${BENCH_ARGS[@]}" --out "$OUT/$slug")
    echo "[peers] $name ($format)"
    echo "+ ${command[*]}"
    echo "+ ${bench[*]}"
    SIDE_ARGS+=(--side "$name" "$format" "$OUT/$slug/bench.json")
    [ "$DRY_RUN" = 0 ] || return 0
    mkdir -p "$OUT"
    setsid "${command[@]}" > "$OUT/$slug.log" 2>&1 &
    SERVER_PID=$!
    if ! model="$("$PYTHON" -m tokenmill.bench.peers wait "http://127.0.0.1:$port/v1" --pid "$SERVER_PID" \
                  --timeout "$READY_TIMEOUT_S")"; then
        echo "[peers] $name did not come up; the end of $OUT/$slug.log:" >&2
        tail -n 40 "$OUT/$slug.log" >&2
        exit 1
    fi
    "${bench[@]}" --openai-model "$model"
    if [ -n "$SHAPE" ]; then  # the resident memory of the server's process group (setsid: its pid leads it)
        RSS_ARGS+=(--rss "$name" "$(ps -o rss= -g "$SERVER_PID" | awk '{ kib += $1 } END { printf "%.0f", kib / 1024 }')")
    fi
    stop_server
}

# shellcheck disable=SC2206 # TOKENMILL_SERVE_ARGS is a list of flags
SERVE_EXTRA=(${TOKENMILL_SERVE_ARGS:-})
if wants tokenmill; then
    for dtype in ${DTYPES//,/ }; do
        IFS=';' read -r -a variants <<< "$TOKENMILL_VARIANTS"
        [ "${#variants[@]}" -gt 0 ] || variants=("")
        for variant in "${variants[@]}"; do
            # shellcheck disable=SC2206 # a variant is a list of flags
            flags=($variant)
            slug="tokenmill-$dtype$(printf '%s' "$variant" | tr -c 'a-z0-9' '-' | sed 's/^-*/-/; s/-*$//')"
            [ -n "$variant" ] || slug="tokenmill-$dtype"
            bench_side "tokenmill serve${variant:+ $variant}" "$dtype (serve --dtype), $TOKENMILL_WEIGHTS" \
                "$slug" "$TOKENMILL" serve --dtype "$dtype" --http-port @PORT@ --gateway-port 0 --scheduler-port 0 \
                --worker-port 0 --redis-port 0 --no-metrics "${TOKENMILL_MODEL[@]}" "${SERVE_EXTRA[@]}" "${flags[@]}"
        done
    done
fi
if wants vllm; then
    for dtype in ${VLLM_DTYPES//,/ }; do
        bench_side "vLLM CPU (vllm-cpu)" "$dtype (--dtype), $VLLM_WEIGHTS, $THREADS OpenMP threads bound" \
            "vllm-$dtype" env VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" \
            VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}" "$VLLM_VENV/bin/vllm" serve "${VLLM_MODEL[@]}" \
            --dtype "$dtype" --host 127.0.0.1 --port @PORT@ --max-model-len 2048
    done
fi
# shellcheck disable=SC2206 # LLAMA_SERVER_ARGS is a list of flags
LLAMA_EXTRA=(${LLAMA_SERVER_ARGS:-})
if wants llama-server; then
    bench_side "llama.cpp llama-server" "$LLAMA_FORMAT, $THREADS threads, $LLAMA_SLOTS slots${LLAMA_SERVER_ARGS:+, $LLAMA_SERVER_ARGS}" \
        llama-server "$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port @PORT@ -t "$THREADS" \
        -np "$LLAMA_SLOTS" -c "$((LLAMA_SLOTS * LLAMA_CTX_PER_SLOT))" --alias "$LLAMA_ALIAS" "${LLAMA_EXTRA[@]}"
fi

versions="tokenmill $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [ "$DRY_RUN" = 0 ]; then
    wants vllm && versions+=", vllm-cpu $("$VLLM_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')"
    wants llama-server && versions+=", llama-server $("$LLAMA_SERVER" --version 2>&1 | head -n 1)"
fi
table=("$PYTHON" -m tokenmill.bench.peers table --doc "$DOC" --section "$SECTION" --command "scripts/peers/compare.sh$ORIGINAL_ARGS"
       --note "versions: $versions" "${SIDE_ARGS[@]}" "${RSS_ARGS[@]}")
echo "+ ${table[*]}"
[ "$DRY_RUN" = 1 ] || "${table[@]}"
