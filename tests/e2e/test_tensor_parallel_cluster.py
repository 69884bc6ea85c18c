"""A model split over ranks (gloo, one worker process each) served by a whole cluster as `tokenmill serve
--tensor-parallel-size N` (or --pipeline-parallel-size N) starts one: greedy tokens through gateway, scheduler
and the rank group equal transformers `generate` (llama at 2 tensor ranks and at 2 stages, qwen2 at 4 tensor ranks), for concurrent requests that share steps; and
when a rank is killed or hangs mid-stream, the group restarts as a unit and the streams finish with the same
tokens."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.helpers.cluster_greedy import cluster_greedy, transformers_greedy
from tests.helpers.tiny_models import make_tiny_hf_model
from tokenmill import cli
from tokenmill.client import Client
from tokenmill.cluster.config import ClusterConfig, resolve_ports
from tokenmill.cluster.restart_policy import RestartPolicy
from tokenmill.cluster.specs import cluster_specs, restart_policies
from tokenmill.cluster.supervisor import Supervisor

pytestmark = pytest.mark.slow
PROMPTS = ("Split over ranks", "heads and columns", "zz")
NEW_TOKENS = 24
PORTS = ("gateway", "scheduler", "worker", "redis", "http")
FAST_RESTARTS = RestartPolicy(backoff_initial_s=0.2, backoff_max_s=2.0, max_restarts=5, window_s=120.0)


def start_cluster(folder, *extra: str, split: str = "--tensor-parallel-size", size: int = 2) -> ClusterConfig:
    args = cli.build_parser().parse_args(["serve", "--model", str(folder), "--dtype", "float32", "--kv-cache-mb", "4",
                                          split, str(size), "--no-metrics", *extra,
                                          *(f"--{name}-port=0" for name in PORTS)])
    return resolve_ports(ClusterConfig.from_args(args, **cli.serve_security_options(args)))


def follower_pids(folder) -> list[int]:
    """The pids of rank-1 processes (worker.main --rank 1) serving `folder` (this test's model: other runs on the
    machine serve their own)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
            except OSError:
                continue
            argv = cmdline.split(b"\0")
            if b"worker.main" in argv and b"--rank" in argv and b"1" in argv and str(folder).encode() in cmdline:
                pids.append(int(entry))
    return pids


# TP=4: one query head per rank; qwen2's 2 KV heads each kept by 2 ranks; PP=2: one layer a stage
# through the whole cluster, one case per kind of split (each architecture at 2 and 4 ranks and both kinds of
# split: tests/worker/parallel/test_tensor_parallel.py, in spawned ranks, at a fraction of a cluster's start)
@pytest.mark.parametrize("flavour, split, size", [
    ("llama", "--tensor-parallel-size", 2), ("qwen2", "--tensor-parallel-size", 4),
    ("llama", "--pipeline-parallel-size", 2),
])
def test_greedy_through_a_split_model_equals_transformers(tmp_path, flavour, split, size):
    folder, hf_model = make_tiny_hf_model(tmp_path, flavour)
    config = start_cluster(folder, split=split, size=size)
    with Supervisor(cluster_specs(config), echo=False, startup_timeout_s=300):
        assert len(follower_pids(folder)) == 1, "rank 0 did not start rank 1"
        prompt_ids, outputs = cluster_greedy(config.gateway_address, PROMPTS, NEW_TOKENS)
    for prompt, ids, tokens in zip(PROMPTS, prompt_ids, outputs):
        assert tokens == transformers_greedy(hf_model, ids, NEW_TOKENS), prompt


@pytest.mark.parametrize("stop, extra", [
    (signal.SIGKILL, ()),  # a rank gone: the next step's collective finds its connection closed
    (signal.SIGSTOP, ("--collective-timeout-s", "3")),  # a rank hung: the collective gives up after 3 s
])
def test_a_lost_rank_restarts_the_group_and_the_streams_finish(tmp_path, stop, extra):
    folder, hf_model = make_tiny_hf_model(tmp_path, "llama")
    config = start_cluster(folder, *extra)
    with Supervisor(cluster_specs(config), echo=False, startup_timeout_s=300,
                    restart_policies=restart_policies(FAST_RESTARTS)):  # as `tokenmill serve` restarts children
        [first_rank] = follower_pids(folder)
        with Client(config.gateway_address, timeout=180) as client:
            prompt_ids = [client.tokenize(prompt) for prompt in PROMPTS]
            streams = [client.stream(prompt, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
                       for prompt in PROMPTS]
            received = [[*next(stream).token_ids] for stream in streams]  # every stream under way
            os.kill(first_rank, stop)
            for tokens, stream in zip(received, streams):
                for delta in stream:
                    tokens += delta.token_ids
        deadline = time.monotonic() + 30
        while not [pid for pid in follower_pids(folder) if pid != first_rank] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [pid for pid in follower_pids(folder) if pid != first_rank], "no new rank 1 after the kill"
    for prompt, ids, tokens in zip(PROMPTS, prompt_ids, received):
        assert tokens == transformers_greedy(hf_model, ids, NEW_TOKENS), prompt  # nothing lost, nothing repeated
