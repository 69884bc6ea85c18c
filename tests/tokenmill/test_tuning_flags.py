"""`tokenmill serve`'s self-tuning flags (issue 19) reach the worker and scheduler command lines, and
without --kv-cache-mb the worker sizes its cache from free memory."""
from __future__ import annotations

from scheduler.main import parse_args as scheduler_args
from tokenmill.cli import build_parser
from tokenmill.cluster.config import ClusterConfig
from tokenmill.cluster.specs import cluster_specs
from worker.main import parse_args as worker_args


def processes(argv: list[str]):
    """The worker's and the scheduler's options as they parse the command lines serve gives them."""
    config = ClusterConfig.from_args(build_parser().parse_args(["serve", "--redis-url", "redis://x:1", *argv]))
    argv_of = {spec.name: list(spec.argv[3:]) for spec in cluster_specs(config)}  # past "python -m x.main"
    return worker_args(argv_of["worker"]), scheduler_args(argv_of["scheduler"])


def test_tuning_flags_reach_the_processes():
    worker, scheduler = processes(["--kv-cache-memory-fraction", "0.3", "--swap-space-gb", "2", "--target-itl-ms",
                                   "40", "--target-ttft-ms", "800", "--max-num-batched-tokens", "256"])
    assert (worker.kv_cache_memory_fraction, worker.swap_space_gb, worker.kv_cache_mb) == (0.3, 2.0, None)
    assert worker.max_num_batched_tokens == scheduler.max_num_batched_tokens == 256  # the worker's profile pass
    assert (scheduler.target_itl_ms, scheduler.target_ttft_ms) == (40.0, 800.0)


def test_defaults_size_from_memory_and_keep_fixed_budgets():
    worker, scheduler = processes([])
    assert worker.kv_cache_mb is None and worker.kv_cache_memory_fraction is None and worker.kv_sizing_record
    assert scheduler.target_itl_ms is None and worker.swap_space_gb == 0.0
    assert worker.max_num_batched_tokens == scheduler.max_num_batched_tokens == 512
    assert processes(["--kv-cache-mb", "64"])[0].kv_cache_mb == 64


def test_bench_starts_one_extra_cluster_per_tuning_setting():
    from tokenmill.bench.cli import build_parser as bench_parser, tuning_clusters

    args = bench_parser().parse_args(["--budgets", "64,32", "--target-itl-ms", "150", "--swap-space-gb", "0.5"])
    assert tuning_clusters(args) == {
        "tokenmill paged budget=32": {"max_num_batched_tokens": 32},
        "tokenmill paged budget=64": {"max_num_batched_tokens": 64},
        "tokenmill paged itl<=150ms": {"target_itl_ms": 150.0},
        "tokenmill paged swap 0.5GB": {"swap_space_gb": 0.5},
    }
    assert tuning_clusters(bench_parser().parse_args([])) == {}
    assert tuning_clusters(bench_parser().parse_args(["--speculative-tokens", "6"])) == {
        "tokenmill paged ngram k=6": {"speculative": "ngram", "num_speculative_tokens": 6}}
