"""A real cluster on a tiny random model with every guard switched on: API keys (one unlimited, one
rate-limited), a small running batch and a small bounded waiting queue, so overload shows in a few
requests and bad input costs nothing to generate."""
from __future__ import annotations

import json
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.access.api_keys import hash_api_key
from tests.helpers.tiny_models import make_tiny_hf_model
from tokenmill.cluster.config import ClusterConfig, resolve_ports, with_settings
from tokenmill.cluster.specs import cluster_specs
from plumbing.rpc import GENERATION_SERVICE, SCHEDULER_SERVICE, WORKER_SERVICE
from tokenmill.cluster.supervisor import Supervisor

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
MAIN_KEY, LIMITED_KEY = "tm-main-0123456789abcdef", "tm-limited-fedcba9876543210"
OTHER_KEY = "tm-other-5555aaaa5555aaaa"  # unlimited, to show one key cannot reach another's requests
CLASS_KEY = "tm-class-7777bbbb7777bbbb"  # unlimited, with latency targets (a class of service)
CLASS_ITL_MS, CLASS_TTFT_MS = 25.0, 400.0
LIMITED_RATE, LIMITED_BURST = 0.2, 3  # requests/s and burst of the "limited" key
MAX_NUM_SEQS, MAX_WAITING_REQUESTS, MAX_WAITING_TOKENS = 2, 6, 600
MAX_MODEL_LEN = 512  # the tiny model's max_position_embeddings


@dataclass(frozen=True)
class GuardedCluster:
    config: ClusterConfig
    supervisor: Supervisor

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {MAIN_KEY}"),)


# session, not package: one start a pytest worker (see tests/helpers/default_cluster.py)
@pytest.fixture(scope="session")
def guarded(tmp_path_factory) -> GuardedCluster:
    root = tmp_path_factory.mktemp("guarded")
    folder, _ = make_tiny_hf_model(root, "llama")
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": CHAT_TEMPLATE}))
    keys = root / "keys.jsonl"
    keys.write_text("# test keys\n" + "\n".join(json.dumps(line) for line in (
        {"name": "main", "sha256": hash_api_key(MAIN_KEY)},
        {"name": "other", "sha256": hash_api_key(OTHER_KEY)},
        {"name": "class", "sha256": hash_api_key(CLASS_KEY), "target_itl_ms": CLASS_ITL_MS,
         "target_ttft_ms": CLASS_TTFT_MS},
        {"name": "limited", "sha256": hash_api_key(LIMITED_KEY), "requests_per_s": LIMITED_RATE,
         "burst": LIMITED_BURST})) + "\n")
    config = resolve_ports(with_settings(ClusterConfig(),
        model=str(folder), gateway_port=0, http_port=0, scheduler_port=0, worker_port=0, redis_port=0,
        num_blocks=256, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=256,
        max_waiting_requests=MAX_WAITING_REQUESTS, max_waiting_tokens=MAX_WAITING_TOKENS, api_keys_file=str(keys)))
    with Supervisor(cluster_specs(config), echo=False, startup_timeout_s=300) as supervisor:
        yield GuardedCluster(config, supervisor)


def assert_all_healthy(cluster: GuardedCluster) -> None:
    """Every child still running, and each gRPC server SERVING its own service over grpc.health."""
    cluster.supervisor.check()
    for address, service in ((cluster.config.worker_address, WORKER_SERVICE),
                             (cluster.config.scheduler_address, SCHEDULER_SERVICE),
                             (cluster.config.gateway_address, GENERATION_SERVICE)):
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, (service, reply)
