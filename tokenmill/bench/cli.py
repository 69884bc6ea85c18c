"""`tokenmill bench`: the standard benchmark, side by side, as a table, JSON, Markdown and plots.

    tokenmill bench                                   start a paged cluster with the KV cache `tokenmill
                                                      serve` would size, sweep it, then the transformers
                                                      baseline; write bench_out/bench.{json,md} + PNGs
    tokenmill bench --compare-kv-layouts              paged vs static clusters on a deliberately small KV
                                                      cache (--num-blocks 40) so the policies differ
    tokenmill bench --request-rate 0.5,1,2 [--seed S] open loop: Poisson arrivals at each rate (req/s)
                                                      instead of the closed-loop concurrency sweep
    tokenmill bench --address 127.0.0.1:50051 [--scheduler-address 127.0.0.1:50052]
                                                      a running tokenmill gateway (load from the scheduler)
    tokenmill bench --openai-url http://host:8000/v1  any OpenAI-compatible server (vLLM, llama-server),
                                                      same workload, same client

Defaults are CPU scale (100 requests per level so P99 is not the slowest request, 64-token prompts,
outputs 16-64, concurrency 1,4,8,16); on a GPU use e.g. --prompt-len 512 --max-output 256
--concurrency 1,8,32,64,128. --concurrency and --request-rate together run both loops.

Self-tuning (issue 19), each an extra paged cluster beside the --kv-policies ones:
    --budgets 32,64,128        one cluster per fixed --max-num-batched-tokens (a sweep of fixed budgets)
    --target-itl-ms 120        one cluster with the ITL target (the default budget, 512, as its ceiling);
                               with --budgets and a paged run, each level's verdict on issue 19's figure
                               (ITL P99 within the target where the default misses it, throughput within
                               10 % of the best fixed budget): tokenmill.bench.itl_verdict
    --swap-space-gb 0.25       one cluster whose preemptions may swap to host memory (a memory-pressure run:
                               set --num-blocks small; the paged run beside it recomputes, the static one reserves)

Speculative decoding (issue 35), an extra paged cluster too:
    --speculative-tokens 8     one cluster with --speculative ngram --num-speculative-tokens 8 (the standard
                               workload's random prompts give prompt lookup little to find: its open-ended case)
    --workload rewrite --prompt-len 300
                               its input-grounded case instead: chat prompts asking for a 300-token passage word
                               for word, every output that long (the answer is in the prompt)
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import signal
import sys
import threading
from pathlib import Path

from plumbing.options import POSITIVE
from tokenmill.bench.itl_verdict import format_verdicts, itl_verdicts
from tokenmill.bench.report import (
    format_table,
    p99_warning,
    percentile_note,
    write_json,
    write_markdown,
    write_plots,
)
from tokenmill.bench.runner import interleaved_sweeps, sweep, sweep_transformers
from tokenmill.bench.targets import (
    LoadPoller,
    OpenAITarget,
    TokenmillTarget,
    TransformersTarget,
)
from tokenmill.bench.workload import Levels, build_workload, parse_levels


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--request-rate {text!r}: expected comma-separated numbers like 0.5,1,2") from None
    if not rates or not all(0 < rate < float("inf") for rate in rates):
        raise argparse.ArgumentTypeError(f"--request-rate {text!r}: every rate must be a finite number > 0 (requests/s)")
    return sorted(set(rates))


DEFAULT_CONCURRENCY = [1, 4, 8, 16]
SMALL_CACHE_BLOCKS = 40  # --compare-kv-layouts: 640 token slots, where paged and static differ at CPU scale


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--address", help="a running tokenmill gateway (gRPC) instead of starting clusters")
    target.add_argument("--openai-url", help="a running OpenAI-compatible server's base URL (…/v1)")
    parser.add_argument("--scheduler-address", help="with --address: poll this scheduler's GetLoad")
    parser.add_argument("--openai-model", default="", help="with --openai-url: the model field sent")
    parser.add_argument("--model", help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--compare-kv-layouts", action="store_true",
                        help=f"paged vs static KV policy on a deliberately small cache (--num-blocks default "
                             f"{SMALL_CACHE_BLOCKS}, --kv-policies default paged,static, no transformers baseline "
                             f"unless --baseline)")
    parser.add_argument("--kv-policies", help="clusters to start (default: paged; paged,static with --compare-kv-layouts)")
    parser.add_argument("--num-blocks", type=int,
                        help="KV pages per started cluster (default: sized from memory as `tokenmill serve` does; "
                             f"{SMALL_CACHE_BLOCKS} with --compare-kv-layouts)")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc",
                        help="how to drive started clusters (default: %(default)s)")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction,
                        help="the transformers baseline with static batches, closed loop only (default: on; "
                             "off with --compare-kv-layouts)")
    parser.add_argument("--concurrency", type=parse_levels,
                        help="closed-loop levels (default: 1,4,8,16; none when --request-rate is given alone)")
    parser.add_argument("--request-rate", type=parse_rates, default=[],
                        help="open loop: requests/s, Poisson arrivals (exponential gaps seeded by --seed), one "
                             "level per rate, e.g. 0.5,1,2")
    parser.add_argument("--num-requests", type=POSITIVE, default=100,
                        help="per level; below 100, P99 is mostly the slowest request (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=64)
    parser.add_argument("--workload", choices=("random-words", "rewrite"), default="random-words",
                        help="random-words: text prompts of --prompt-len tokens, outputs of --min/--max-output; "
                             "rewrite: the input-grounded workload of speculative decoding (issue 35), a chat asking "
                             "for a --prompt-len-token passage word for word, every output that long (default: "
                             "%(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy; above 0, every request samples at it (top-k/top-p off, no seed): an "
                             "open-ended text, which prompt lookup rarely guesses (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed requests first (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="output lengths and open-loop arrivals (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"), help="report directory (default: %(default)s)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--budgets", type=parse_levels, default=[],
                        help="also a paged cluster per fixed token budget (--max-num-batched-tokens)")
    parser.add_argument("--target-itl-ms", type=float, help="also a paged cluster with this ITL target")
    parser.add_argument("--swap-space-gb", type=float, help="also a paged cluster with this much swap space")
    parser.add_argument("--speculative-tokens", type=int, choices=range(1, 17), metavar="1..16",
                        help="also a paged cluster with --speculative ngram and this --num-speculative-tokens")
    parser.add_argument("--interleave", action="store_true",
                        help="start every cluster first, then run each level on all of them back to back (the "
                             "order rotated at every level), so that the machine's drift over a long "
                             "run falls on every configuration alike; the transformers baseline still runs last")
    parser.add_argument("--repeats", type=int, default=1,
                        help="with --interleave: each level this many times on every cluster (the order rotating "
                             "on); the ITL target verdict then judges medians over the repeats and the median of "
                             "the per-repeat throughput ratios, for a machine whose speed drifts more than the "
                             "verdict's 10%% (default: %(default)s)")
    return parser


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fills the defaults that depend on the mode (--compare-kv-layouts, --request-rate)."""
    if args.concurrency is None:
        args.concurrency = [] if args.request_rate else list(DEFAULT_CONCURRENCY)
    if args.kv_policies is None:
        args.kv_policies = "paged,static" if args.compare_kv_layouts else "paged"
    if args.num_blocks is None and args.compare_kv_layouts:
        args.num_blocks = SMALL_CACHE_BLOCKS
    if args.baseline is None:
        args.baseline = not args.compare_kv_layouts
    return args


async def _sweep_address(make_target, args, workload, scheduler_address: str | None, label: str) -> dict:
    target = make_target()  # inside the running loop: a grpc.aio channel belongs to the loop it was made in
    poller = LoadPoller(scheduler_address) if scheduler_address else None
    try:
        return await sweep(target, workload, args.concurrency, args.num_requests, args.warmup, poller, label,
                           args.request_rate, args.seed)
    finally:
        await target.close()


def cluster_config(args, kv_policy: str, **settings):
    """The started cluster's config, with free ports: the KV cache sized as `tokenmill serve` sizes it
    unless --num-blocks (or --compare-kv-layouts) says otherwise. settings: more ClusterConfig fields
    (a fixed budget, a latency target, swap space)."""
    from tokenmill.cluster.config import ClusterConfig, resolve_ports, with_settings

    return resolve_ports(with_settings(ClusterConfig(
        model=args.model, gateway_port=0, scheduler_port=0, worker_port=0, redis_port=0,
        http_port=0 if args.protocol == "http" else None), kv_policy=kv_policy, num_blocks=args.num_blocks,
        **settings))



def run_cluster(args, workload, kv_policy: str, label: str | None = None, **settings) -> dict:
    """The sweep against a cluster started with these settings; the result records them ("settings")."""
    from tokenmill.cluster.specs import cluster_specs
    from tokenmill.cluster.supervisor import Supervisor

    config = cluster_config(args, kv_policy, **settings)
    with Supervisor(cluster_specs(config), echo=False):
        result = asyncio.run(_sweep_address(lambda: cluster_target(args, config), args, workload,
                                            config.scheduler_address, label or kv_policy))
    result["settings"] = cluster_settings(config, kv_policy)
    return result


def cluster_target(args, config):
    return (OpenAITarget(f"http://{config.http_address}/v1", temperature=args.temperature) if args.protocol == "http"
            else TokenmillTarget(config.gateway_address, args.temperature))


def cluster_settings(config, kv_policy: str) -> dict:
    return {"kv_policy": kv_policy, "max_num_batched_tokens": config.max_num_batched_tokens,
            "target_itl_ms": config.scheduler.target_itl_ms, "swap_space_gb": config.worker.swap_space_gb,
            "speculative": config.scheduler.speculative,
            "num_speculative_tokens": config.scheduler.num_speculative_tokens if config.scheduler.speculative else None}


def run_clusters_interleaved(args, workload, clusters: list[tuple[str, str, dict]]) -> dict[str, dict]:
    """--interleave: clusters (run name, kv policy, settings) all started, then swept together
    (runner.interleaved_sweeps); run name -> result, as run_cluster returns."""
    from tokenmill.cluster.specs import cluster_specs
    from tokenmill.cluster.supervisor import Supervisor

    configs = {}
    with contextlib.ExitStack() as stack:
        for name, kv_policy, settings in clusters:
            print(f"starting a cluster: {name}, KV cache {cache_description(args)}", file=sys.stderr)
            configs[name] = (cluster_config(args, kv_policy, **settings), kv_policy)
            stack.enter_context(Supervisor(cluster_specs(configs[name][0]), echo=False))

        async def sweeps() -> dict[str, dict]:
            targets = {name: (cluster_target(args, config), LoadPoller(config.scheduler_address))
                       for name, (config, _) in configs.items()}
            try:
                return await interleaved_sweeps(targets, workload, args.concurrency, args.num_requests, args.warmup,
                                                args.request_rate, args.seed, args.repeats)
            finally:
                for target, _ in targets.values():
                    await target.close()

        results = asyncio.run(sweeps())
    for name, (config, kv_policy) in configs.items():
        results[name]["settings"] = cluster_settings(config, kv_policy)
    return results


def kv_policies(args) -> list[str]:
    return [p.strip() for p in args.kv_policies.split(",") if p.strip()]


def tuning_clusters(args) -> dict[str, dict]:
    """The extra paged clusters of --budgets, --target-itl-ms and --swap-space-gb: run name -> settings."""
    clusters = {f"tokenmill paged budget={budget}": {"max_num_batched_tokens": budget} for budget in args.budgets}
    if args.target_itl_ms is not None:
        clusters[f"tokenmill paged itl<={args.target_itl_ms:g}ms"] = {"target_itl_ms": args.target_itl_ms}
    if args.swap_space_gb is not None:
        clusters[f"tokenmill paged swap {args.swap_space_gb:g}GB"] = {"swap_space_gb": args.swap_space_gb}
    if args.speculative_tokens is not None:
        clusters[f"tokenmill paged ngram k={args.speculative_tokens}"] = {
            "speculative": "ngram", "num_speculative_tokens": args.speculative_tokens}
    return clusters


def default_budget() -> int:
    """The --max-num-batched-tokens a started cluster gets unless told otherwise."""
    import dataclasses

    from tokenmill.cluster.config import ClusterConfig

    return next(f.default for f in dataclasses.fields(ClusterConfig) if f.name == "max_num_batched_tokens")


def cache_description(args) -> str:
    return ("sized from memory as `tokenmill serve` does" if args.num_blocks is None
            else f"num_blocks={args.num_blocks}")


def interrupt_on_sigterm(signum, frame) -> None:
    """SIGTERM ends a run as Ctrl-C does, so each started cluster's `with Supervisor` stops its processes
    (Python's default SIGTERM exits at once and left gateway, scheduler, worker and Redis running). A
    second SIGTERM exits at once."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = resolve_defaults(parser.parse_args(argv))
    if args.repeats < 1 or (args.repeats > 1 and not args.interleave):
        parser.error(f"--repeats {args.repeats}: must be 1, or more together with --interleave")
    on_main_thread = threading.current_thread() is threading.main_thread()  # where handlers can be set
    previous = signal.signal(signal.SIGTERM, interrupt_on_sigterm) if on_main_thread else None
    try:
        return run(args, argv)
    except KeyboardInterrupt:
        print("tokenmill bench: interrupted; the clusters it started are stopped", file=sys.stderr)
        return 130
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)


def run(args, argv: list[str] | None) -> int:
    from gateway.text.tokenizer import load_tokenizer

    if p99_warning(args.num_requests):
        print(f"warning: {p99_warning(args.num_requests)}", file=sys.stderr)
    tokenizer = load_tokenizer(args.model)
    # output lengths for the largest level, and a prompt for every request of the sweep (workload.Levels)
    prompts = Levels.prompts_needed(args.concurrency, args.num_requests, args.warmup, args.request_rate or (),
                                    args.repeats)
    workload = build_workload(tokenizer, max([args.num_requests, *args.concurrency]), args.prompt_len,
                              args.min_output, args.max_output, args.seed, num_prompts=prompts,
                              rewrite=args.workload == "rewrite")
    runs: dict[str, dict] = {}
    if args.address:
        runs["tokenmill"] = asyncio.run(_sweep_address(lambda: TokenmillTarget(args.address, args.temperature), args, workload,
                                                       args.scheduler_address, "tokenmill"))
    elif args.openai_url:
        runs["openai-http"] = asyncio.run(_sweep_address(lambda: OpenAITarget(args.openai_url, args.openai_model, args.temperature), args,
                                                         workload, None, "openai"))
    elif args.interleave:
        clusters = [(f"tokenmill {policy}", policy, {}) for policy in kv_policies(args)]
        clusters += [(name, "paged", settings) for name, settings in tuning_clusters(args).items()]
        runs.update(run_clusters_interleaved(args, workload, clusters))
    else:
        for policy in kv_policies(args):
            print(f"starting a cluster: kv_policy={policy}, KV cache {cache_description(args)}", file=sys.stderr)
            runs[f"tokenmill {policy}"] = run_cluster(args, workload, policy)
        for name, settings in tuning_clusters(args).items():
            print(f"starting a cluster: {name}, KV cache {cache_description(args)}", file=sys.stderr)
            runs[name] = run_cluster(args, workload, "paged", name, **settings)
    if not (args.address or args.openai_url):
        if args.baseline and args.concurrency:  # static batches have no open loop
            print("transformers baseline (static batches)", file=sys.stderr)
            runs["transformers static batches"] = sweep_transformers(
                TransformersTarget(args.model, args.temperature), workload, args.concurrency, args.num_requests, args.warmup)
    result = {"title": "tokenmill bench", "command": "tokenmill bench " + shlex.join(sys.argv[2:] if argv is None else argv),
              "notes": notes(args, runs), "runs": runs}
    verdict = None
    if args.target_itl_ms is not None and args.budgets and not (args.address or args.openai_url):
        result["itl_verdicts"] = itl_verdicts(result, args.target_itl_ms, default_budget())
        verdict = format_verdicts(result["itl_verdicts"])
    args.out.mkdir(parents=True, exist_ok=True)
    plots = [] if args.no_plots else write_plots(result, args.out)
    write_json(result, args.out / "bench.json")
    write_markdown(result, args.out / "bench.md", [p.name for p in plots])
    if verdict is not None:
        with open(args.out / "bench.md", "a") as markdown:
            markdown.write(f"\n```\n{verdict}\n```\n")
    print(format_table(result))
    if verdict is not None:
        print("\n" + verdict)
    print(f"\nreports: {args.out}/bench.json, bench.md" + ("" if args.no_plots else ", bench_*.png"))
    return 0


def loops_description(args) -> str:
    loops = []
    if args.concurrency:
        loops.append(f"closed loop at concurrency {','.join(map(str, args.concurrency))} (each client sends its "
                     f"next request when its last one ends)")
    if args.request_rate:
        loops.append(f"open loop at {','.join(f'{rate:g}' for rate in args.request_rate)} req/s (Poisson arrivals, "
                     f"exponential gaps, seed {args.seed})")
    return " and ".join(loops)


def cluster_note(args, runs: dict) -> str:
    pages = sorted({level["kv_pages_total"] for run in runs.values() for level in run["levels"]
                    if level.get("kv_pages_total")})
    sizing = (f"{args.num_blocks} KV pages of 16 tokens" if args.num_blocks is not None
              else "the KV cache sized from memory as `tokenmill serve` does")
    if args.compare_kv_layouts:
        sizing += " (deliberately small, --compare-kv-layouts, so the KV policies differ)"
    order = ("; all started at once, each level run on every cluster back to back, the order rotated at every "
             "level (--interleave)" if args.interleave else "; one after the other")
    return (f"started clusters: {sizing}" + (f"; {'/'.join(map(str, pages))} pages reported" if pages else "")
            + order + "; KV util and preemptions from the scheduler's GetLoad, polled every 0.2 s")


def notes(args, runs: dict) -> list[str]:
    import torch

    device = "GPU" if torch.cuda.is_available() else f"CPU ({torch.get_num_threads()} torch threads)"
    shape = (f"{args.prompt_len}-token text prompts, output lengths uniform in {args.min_output}-{args.max_output}"
             if args.workload == "random-words" else
             f"rewrite: chat prompts asking for a {args.prompt_len}-token passage word for word, outputs that long")
    sampling = f"sampled at temperature {args.temperature:g}" if args.temperature > 0 else "greedy"
    return [(f"workload: {args.num_requests} requests per level, {shape} (seed {args.seed}), {sampling}, EOS ignored; "
            f"{loops_description(args)}; {args.warmup} warm-up requests excluded from the timed window"),
            percentile_note(args.num_requests),
            f"device: {device}" + ("; workload scaled down for CPU (the standard sweep is 1..128)"
                                   if not torch.cuda.is_available() else ""),
            *([] if args.address or args.openai_url else [cluster_note(args, runs)])]


if __name__ == "__main__":
    sys.exit(main())
