"""`tokenmill serve`'s queue-bound, API-key and rate-limit flags reach the scheduler and gateway command lines."""
from __future__ import annotations

from tokenmill.cli import build_parser
from tokenmill.cluster.config import ClusterConfig
from tokenmill.cluster.specs import cluster_specs


def test_serve_parses_the_guard_flags():
    args = build_parser().parse_args(["serve", "--max-waiting-requests", "7", "--max-waiting-tokens", "900",
                                      "--api-keys-file", "keys.jsonl", "--rate-limit-rps", "2.5",
                                      "--rate-limit-burst", "4"])
    assert (args.max_waiting_requests, args.max_waiting_tokens, args.api_keys_file, args.rate_limit_rps,
            args.rate_limit_burst) == (7, 900, "keys.jsonl", 2.5, 4)


def test_cluster_specs_pass_them_to_the_processes():
    config = ClusterConfig(gateway_port=1, scheduler_port=2, worker_port=3, redis_url="redis://x:1",
                           max_waiting_requests=7, max_waiting_tokens=900, api_keys_file="keys.jsonl",
                           rate_limit_rps=2.5, rate_limit_burst=4)
    specs = {spec.name: " ".join(spec.argv) for spec in cluster_specs(config)}
    assert "--max-waiting-requests 7 --max-waiting-tokens 900" in specs["scheduler"]
    assert "--rate-limit-rps 2.5 --rate-limit-burst 4 --api-keys-file keys.jsonl" in specs["gateway"]
    without_keys = {spec.name: spec.argv for spec in cluster_specs(ClusterConfig(redis_url="redis://x:1"))}
    assert "--api-keys-file" not in without_keys["gateway"]
