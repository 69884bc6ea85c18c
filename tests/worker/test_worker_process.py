"""The worker process reports ready only after its warm-up forward pass, then serves its capacity."""
from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.tokenmill.v1 import worker_pb2, worker_pb2_grpc
from tests.helpers.tiny_models import make_tiny_hf_model
from tokenmill.cluster.child_process import ChildSpec
from tokenmill.cluster.readiness import free_port
from plumbing.rpc import WORKER_SERVICE
from tokenmill.cluster.supervisor import Supervisor


def test_ready_after_warm_up_with_capacity_from_the_budget(tmp_path):
    folder, _ = make_tiny_hf_model(tmp_path, "llama_gqa")
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    spec = ChildSpec("worker", [sys.executable, "-m", "worker.main", "--port", address.split(":")[1],
                                "--model", str(folder), "--block-size", "16", "--kv-cache-mb", "1",
                                "--dtype", "float32"],  # auto is bfloat16 on a CPU with avx512_bf16
                     WORKER_SERVICE, address)
    with Supervisor([spec], echo=False) as supervisor:
        output = "\n".join(supervisor.tail("worker"))
        assert output.index("warm-up forward pass done") < output.index("worker ready")
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=WORKER_SERVICE))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            capacity = worker_pb2_grpc.WorkerStub(channel).GetCapacity(worker_pb2.GetCapacityRequest())
    # 1 MiB of float32 K+V for 2 layers x 16 tokens x KV heads x head dim per page
    config = capacity.model_config
    page_bytes = 2 * config.num_layers * 16 * config.num_kv_heads * config.head_dim * 4
    assert capacity.num_blocks == 2**20 // page_bytes and capacity.kv_cache_bytes == capacity.num_blocks * page_bytes
    assert capacity.block_size == 16 and config.dtype == "float32"
    assert capacity.kv_cache_sizing == "--kv-cache-mb 1" and capacity.num_host_blocks == 0


def test_cache_sized_from_free_memory_reports_why(tmp_path):
    """Without --kv-cache-mb the worker sizes the cache from available RAM and says how, in its log and GetCapacity."""
    folder, _ = make_tiny_hf_model(tmp_path, "llama_gqa")
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    spec = ChildSpec("worker", [sys.executable, "-m", "worker.main", "--port", address.split(":")[1],
                                "--model", str(folder), "--block-size", "16", "--kv-cache-memory-fraction", "0.0001",
                                "--max-num-batched-tokens", "64", "--swap-space-gb", "0.001", "--dtype", "float32"],
                     WORKER_SERVICE, address)
    with Supervisor([spec], echo=False) as supervisor:
        with grpc.insecure_channel(address) as channel:
            capacity = worker_pb2_grpc.WorkerStub(channel).GetCapacity(worker_pb2.GetCapacityRequest())
        output = "\n".join(supervisor.tail("worker"))
    config = capacity.model_config
    page_bytes = 2 * config.num_layers * 16 * config.num_kv_heads * config.head_dim * 4
    assert capacity.kv_cache_sizing.startswith("0.0001 x (") and "activation peak" in capacity.kv_cache_sizing
    assert capacity.kv_cache_sizing in output and f"{capacity.num_blocks} pages of 16 tokens" in output
    assert capacity.num_host_blocks == int(0.001 * 2**30) // page_bytes
