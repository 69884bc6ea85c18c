"""Engine benchmark: tokenmill's in-process engine vs transformers `generate` with static batches.

Same model, same requests, one run: 32 requests with 128-token prompts and output lengths uniform in
32-256 (fixed seed), greedy, EOS ignored, all submitted at once. Prints output tokens/s of both and
their ratio, and KV utilization (live tokens / reserved slots, mean over steps) for the `paged` and
`static` policies. A command, not a test: figures depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import torch

from core.sampling import SamplingParams
from scheduler.options import SchedulerOptions
from tokenmill.bench.workload import Workload, add_json_argument, add_workload_arguments, make_workload, progress_log
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig
from worker.options import DENSE_WEIGHT_MODES, QUANTIZATIONS


def run_tokenmill(llm: LLM, workload: Workload, kv_policy: str) -> dict:
    llm.engine = llm.new_engine(replace(llm.config, scheduler=replace(llm.config.scheduler, kv_policy=kv_policy)))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens]
    start = time.perf_counter()
    outputs = llm.generate_token_ids(workload.prompts, params)
    elapsed = time.perf_counter() - start
    samples = llm.engine.kv_utilization_samples
    assert [len(o) for o in outputs] == workload.output_lens
    return {
        "output_tokens_per_s": workload.num_output_tokens / elapsed,
        "elapsed_s": elapsed,
        "kv_utilization_mean": sum(samples) / len(samples),
        "preemptions": llm.engine.scheduler.num_preemptions,
        "steps": len(samples),
        "outputs": outputs,
    }


def load_transformers_model(model_path: str | None):
    from transformers import AutoModelForCausalLM

    from worker.loader import default_model_path

    path = model_path or str(default_model_path())
    if path.endswith(".gguf"):
        from pathlib import Path

        gguf = Path(path)
        return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def run_transformers(model, workload: Workload, batch_size: int = 8) -> dict:
    outputs: list[list[int]] = []
    # EOS ignored: no stopping (min_new_tokens would mask EOS instead, changing the greedy tokens)
    model.generation_config.eos_token_id = None
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first:first + batch_size]
        lengths = workload.output_lens[first:first + batch_size]
        input_ids = torch.tensor(prompts)  # equal prompt lengths: no padding needed
        generated = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                   max_new_tokens=max(lengths), pad_token_id=0)
        # a static batch runs until its longest request; only each request's own tokens count
        outputs += [row[input_ids.shape[1]:input_ids.shape[1] + n].tolist() for row, n in zip(generated, lengths)]
    elapsed = time.perf_counter() - start
    return {"output_tokens_per_s": workload.num_output_tokens / elapsed, "elapsed_s": elapsed, "outputs": outputs}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of requests whose greedy tokens match exactly."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tokenmill bench-engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    add_workload_arguments(parser, num_requests=32, prompt_len=128, min_output=32, max_output=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline-batch-size", type=int, default=8)
    parser.add_argument("--kv-cache-mb", type=int, default=512)
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="auto",
                        help="tokenmill's weights (worker.paths.base); transformers always runs the float32 "
                             "dequantized model (default: %(default)s)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    parser.add_argument("--no-cpu-fused-ops", action="store_true",
                        help="tokenmill's decoder in plain torch (the reference path; worker.paths.fused_ops)")
    parser.add_argument("--cpu-dense-weights", choices=DENSE_WEIGHT_MODES, default="auto",
                        help="tokenmill's quantized linears keep dense copies for steps of 5 rows or more "
                             "(worker.linears.dense_weights; default: %(default)s)")
    parser.add_argument("--skip-transformers", action="store_true")
    add_json_argument(parser)
    return parser.parse_args(argv)


def engine_facts(llm: LLM) -> dict:
    """What the engine runs: activation dtype, weight formats, fused ops, dense copies, threads."""
    from worker.linears.dense_weights import dense_weights_kept
    from worker.linears.group_quant import DENSE_ROWS, weight_formats

    formats = weight_formats(llm.runner.model) or "float"
    if dense_weights_kept(llm.runner.model):
        formats += f" (dense copies for steps of {DENSE_ROWS}+ rows)"
    return {"dtype": str(llm.runner.dtype).removeprefix("torch."), "weights": formats,
            "transformers": "float32, dequantized weights",
            "cpu_fused_ops": getattr(llm.runner.execution_path, "fused_ops", False),
            "cpu_dense_weights": dense_weights_kept(llm.runner.model), "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = EngineConfig(
        worker=replace(ENGINE_WORKER, model=args.model, kv_cache_mb=args.kv_cache_mb, quantization=args.quantization,
                       dtype=args.dtype, cpu_fused_ops=not args.no_cpu_fused_ops,
                       cpu_dense_weights=args.cpu_dense_weights),
        scheduler=SchedulerOptions(max_num_seqs=max(64, args.num_requests)))
    log = progress_log(args.json)
    llm = LLM(config)
    workload = make_workload(llm.model_config.vocab_size, args.num_requests, args.prompt_len,
                             args.min_output, args.max_output, args.seed)
    llm.generate([workload.prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    facts = engine_facts(llm)
    log(f"workload: {args.num_requests} requests, {args.prompt_len}-token prompts, "
        f"{workload.num_output_tokens} output tokens, {facts['threads']} threads; tokenmill runs "
        f"{facts['dtype']} activations on {facts['weights']} weights, transformers float32 on the dequantized weights")
    paged = run_tokenmill(llm, workload, "paged")
    log(f"tokenmill paged:  {paged['output_tokens_per_s']:.1f} tok/s")
    static = run_tokenmill(llm, workload, "static")
    log(f"tokenmill static: {static['output_tokens_per_s']:.1f} tok/s")
    result = {
        "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                     "output_lens": [args.min_output, args.max_output], "seed": args.seed,
                     "num_output_tokens": workload.num_output_tokens, **facts},
        "tokenmill_paged": {k: v for k, v in paged.items() if k != "outputs"},
        "tokenmill_static": {k: v for k, v in static.items() if k != "outputs"},
    }
    if not args.skip_transformers:
        baseline = run_transformers(load_transformers_model(args.model), workload, args.baseline_batch_size)
        log(f"transformers:     {baseline['output_tokens_per_s']:.1f} tok/s")
        result["transformers_static_batches"] = {k: v for k, v in baseline.items() if k != "outputs"}
        result["speedup_vs_transformers"] = paged["output_tokens_per_s"] / baseline["output_tokens_per_s"]
        result["greedy_requests_identical_to_transformers"] = agreement(paged["outputs"], baseline["outputs"])
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


def print_table(result: dict) -> None:
    rows = [("tokenmill (paged)", result["tokenmill_paged"]), ("tokenmill (static)", result["tokenmill_static"])]
    if "transformers_static_batches" in result:
        rows.append(("transformers generate, batches of 8", result["transformers_static_batches"]))
    print(f"\n{'system':<38}{'output tok/s':>14}{'elapsed s':>11}{'KV util':>9}{'preempt':>9}")
    for name, row in rows:
        util = f"{row['kv_utilization_mean']:.2f}" if "kv_utilization_mean" in row else "-"
        print(f"{name:<38}{row['output_tokens_per_s']:>14.1f}{row['elapsed_s']:>11.1f}{util:>9}"
              f"{row.get('preemptions', '-'):>9}")
    if "speedup_vs_transformers" in result:
        print(f"\ntokenmill / transformers: {result['speedup_vs_transformers']:.2f}x; "
              f"greedy outputs identical for {result['greedy_requests_identical_to_transformers']:.0%} of requests")


if __name__ == "__main__":
    sys.exit(main())
