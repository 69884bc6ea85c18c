"""`tokenmill serve`'s queue-bound, API-key and rate-limit flags reach the scheduler and gateway command lines."""
from __future__ import annotations

from gateway.main import parse_args as gateway_args
from scheduler.main import parse_args as scheduler_args
from tokenmill.cli import build_parser
from tokenmill.cluster.config import ClusterConfig
from tokenmill.cluster.specs import cluster_specs

GUARDS = ["--max-waiting-requests", "7", "--max-waiting-tokens", "900", "--api-keys-file", "keys.jsonl",
          "--rate-limit-rps", "2.5", "--rate-limit-burst", "4"]


def test_serve_parses_the_guard_flags():
    args = build_parser().parse_args(["serve", *GUARDS])
    assert (args.max_waiting_requests, args.max_waiting_tokens, args.api_keys_file, args.rate_limit_rps,
            args.rate_limit_burst) == (7, 900, "keys.jsonl", 2.5, 4)


def test_cluster_specs_pass_them_to_the_processes():
    config = ClusterConfig.from_args(build_parser().parse_args(["serve", "--redis-url", "redis://x:1", *GUARDS]))
    argv_of = {spec.name: list(spec.argv[3:]) for spec in cluster_specs(config)}  # past "python -m x.main"
    scheduler = scheduler_args(argv_of["scheduler"])
    assert (scheduler.max_waiting_requests, scheduler.max_waiting_tokens) == (7, 900)
    gateway = gateway_args(argv_of["gateway"])
    assert (gateway.rate_limit_rps, gateway.rate_limit_burst, gateway.api_keys_file) == (2.5, 4, "keys.jsonl")
    without_keys = {spec.name: spec.argv for spec in cluster_specs(ClusterConfig(redis_url="redis://x:1"))}
    assert "--api-keys-file" not in without_keys["gateway"]
