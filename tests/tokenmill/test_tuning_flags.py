"""`tokenmill serve`'s self-tuning flags (issue 19) reach the worker and scheduler command lines, and
without --kv-cache-mb the worker sizes its cache from free memory."""
from __future__ import annotations

from tokenmill.cli import build_parser
from tokenmill.cluster.config import ClusterConfig
from tokenmill.cluster.specs import cluster_specs


def specs_for(argv: list[str]) -> dict[str, str]:
    args = build_parser().parse_args(["serve", *argv])
    config = ClusterConfig(gateway_port=1, scheduler_port=2, worker_port=3, redis_url="redis://x:1",
                           kv_cache_mb=args.kv_cache_mb, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                           swap_space_gb=args.swap_space_gb, target_itl_ms=args.target_itl_ms,
                           target_ttft_ms=args.target_ttft_ms)
    return {spec.name: " ".join(spec.argv) for spec in cluster_specs(config)}


def test_tuning_flags_reach_the_processes():
    specs = specs_for(["--kv-cache-memory-fraction", "0.3", "--swap-space-gb", "2", "--target-itl-ms", "40",
                       "--target-ttft-ms", "800"])
    assert "--kv-cache-memory-fraction 0.3" in specs["worker"] and "--swap-space-gb 2.0" in specs["worker"]
    assert "--kv-cache-mb" not in specs["worker"]
    assert "--max-num-batched-tokens 512" in specs["worker"]  # the size of the worker's profile pass
    assert "--target-itl-ms 40.0 --target-ttft-ms 800.0" in specs["scheduler"]


def test_defaults_size_from_memory_and_keep_fixed_budgets():
    specs = specs_for([])
    assert "--kv-cache-mb" not in specs["worker"] and "--kv-cache-memory-fraction" not in specs["worker"]
    assert "--target-itl-ms" not in specs["scheduler"] and "--swap-space-gb 0.0" in specs["worker"]
    assert "--kv-cache-mb 64" in specs_for(["--kv-cache-mb", "64"])["worker"]


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
