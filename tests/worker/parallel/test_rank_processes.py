"""Ranks started one by one, as a multi-node deployment starts them (each with --rank and the
leader's --rendezvous, rank 0 starting nobody): both come up, and a rank > 0 answers its pod's
gRPC health probe, tokenmill.v1.Worker SERVING once its share of the model is loaded."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from plumbing.rpc import WORKER_SERVICE
from tests.helpers.tiny_models import make_tiny_hf_model
from tokenmill.cluster.readiness import free_port

START_TIMEOUT_S = 180


def serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=WORKER_SERVICE),
                                                              timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_ranks_started_apart_join_and_a_follower_answers_its_probe(tmp_path):
    folder, _ = make_tiny_hf_model(tmp_path, "llama")
    init = f"tcp://localhost:{free_port()}"  # not rank 0's own local rendezvous: each rank is "its own pod"
    ports = [free_port(), free_port()]
    common = ["--model", str(folder), "--dtype", "float32", "--num-blocks", "32", "--tensor-parallel-size", "2",
              "--rendezvous", init, "--threads", "1", "--insecure-internal"]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    ranks = [subprocess.Popen([sys.executable, "-m", "worker.main", *common, "--rank", str(rank),
                               "--port", str(port)], env=env) for rank, port in enumerate(ports)]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(serving(port) for port in ports):
            assert all(rank.poll() is None for rank in ranks), [rank.returncode for rank in ranks]
            assert time.monotonic() < deadline, "the ranks did not both report SERVING"
            time.sleep(0.5)
    finally:
        for rank in ranks:
            rank.terminate()
        for rank in ranks:
            rank.wait(30)


def test_ranks_started_with_other_flags_are_refused_on_every_rank(tmp_path):
    folder, _ = make_tiny_hf_model(tmp_path, "llama")
    init = f"tcp://localhost:{free_port()}"
    common = ["--model", str(folder), "--num-blocks", "32", "--tensor-parallel-size", "2", "--rendezvous",
              init, "--threads", "1", "--insecure-internal"]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    ranks = [subprocess.Popen([sys.executable, "-m", "worker.main", *common, "--rank", str(rank),
                               "--port", str(free_port()), "--dtype", dtype], env=env, stderr=subprocess.PIPE,
                              text=True) for rank, dtype in enumerate(("float32", "bfloat16"))]
    outputs = [rank.communicate(timeout=START_TIMEOUT_S)[1] for rank in ranks]
    assert all(rank.returncode != 0 for rank in ranks)
    for output in outputs:
        assert "rank 1 was started with dtype='bfloat16', rank 0 with dtype='float32'" in output, output[-2000:]
