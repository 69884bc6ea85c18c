"""One real cluster (redis-server, worker, scheduler, gateway) on a tiny random-weight model, with
tracing exported to an OTLP receiver this test process runs, JSON logs and all three metrics ports.
A 1 s drain timeout and no retry after a lost worker, so that a test can end a request by a drain or
by killing the worker (test_request_endings_faults_e2e, which restarts what it stops)."""
from __future__ import annotations

import secrets

import dataclasses

import pytest

from protos.tokenmill.v1 import generation_pb2
from tests.helpers.otlp_receiver import OtlpReceiver
from tests.helpers.tiny_models import make_tiny_hf_model
from tokenmill.cluster.config import ClusterConfig, resolve_ports, with_settings
from tokenmill.cluster.specs import cluster_specs
from tokenmill.cluster.supervisor import Supervisor

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# A request still streaming seconds after its first tokens, for a fault, a drain or a deadline to land
# mid-generation: the tiny model decodes ~500 tokens a second alone on an AVX-512 CPU, so 480 tokens
# could finish inside the 1 s drain timeout there; 3000 take seconds on any CPU this suite runs on.
LONG_TOKENS = 3000


def greedy_request(request_id: str, prompt: str, max_tokens: int) -> generation_pb2.GenerateRequest:
    """Exactly max_tokens tokens (EOS ignored), greedy: the same request every run ("" id: the gateway's)."""
    parameters = generation_pb2.GenerateParameters(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return generation_pb2.GenerateRequest(request_id=request_id, prompt=prompt, parameters=parameters)


# session, not package: one start a pytest worker (see tests/helpers/default_cluster.py)
@pytest.fixture(scope="session")
def otlp_receiver():
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def traced_cluster(tmp_path_factory, otlp_receiver):
    # a 4096-token context: a LONG_TOKENS request must fit (the tiny model's default context is 512)
    model, _ = make_tiny_hf_model(tmp_path_factory.mktemp("telemetry-model"), max_position_embeddings=4096)
    (model / "chat_template.jinja").write_text(CHATML)  # so chat requests (gen_ai operation "chat") run
    env = (("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.endpoint), ("OTEL_EXPORTER_OTLP_INSECURE", "true"),
           ("OTEL_TRACES_SAMPLER", "always_on"), ("OTEL_BSP_SCHEDULE_DELAY", "100"),
           ("TOKENMILL_LOG_FORMAT", "json"))
    config = resolve_ports(with_settings(ClusterConfig(),
        model=str(model), gateway_port=0, http_port=0, scheduler_port=0, worker_port=0, redis_port=0,
        num_blocks=256, max_num_batched_tokens=128, gateway_metrics_port=0, scheduler_metrics_port=0,
        worker_metrics_port=0, child_env=env, drain_timeout_s=1.0, metrics_linger_s=3.0,
        retry_on_worker_failure=False))
    # a request whose scheduler drained ends UNAVAILABLE at once (the tests read how it ends), instead of its
    # gateway waiting for a restart that the test only makes afterwards (gateway.generation.resume)
    specs = [dataclasses.replace(spec, argv=[*spec.argv, "--scheduler-resume-wait-s", "0"]) if spec.name == "gateway"
             else spec for spec in cluster_specs(config)]
    with Supervisor(specs, echo=False, startup_timeout_s=300, tail_lines=400) as supervisor:
        yield config, supervisor


def traceparent() -> tuple[str, str]:
    """A fresh trace id and the W3C traceparent header that starts it, for a request to send."""
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-01"
