"""A whole cluster with mutual TLS on every gRPC link, HTTPS, small message limits and a redis-server
that only lets in tokenmill's ACL user, all set up through ClusterConfig as `tokenmill serve` does.
Certificates are made by the test (tests/helpers/certificates.py); the model is a tiny random one."""
from __future__ import annotations

import contextlib
import ssl
import subprocess
import sys
import time

import aiohttp
import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.tokenmill.v1 import generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from protos.tokenmill.v1 import worker_pb2, worker_pb2_grpc
from tests.helpers.certificates import make_pki
from tests.helpers.tiny_models import make_tiny_hf_model
from tokenmill import cli
from tokenmill.client import Client, ClientError
from tokenmill.cluster.config import ClusterConfig, resolve_ports, with_settings
from tokenmill.cluster.specs import cluster_specs
from tokenmill.cluster.readiness import free_port
from plumbing.rpc import GENERATION_SERVICE, SCHEDULER_SERVICE, WORKER_SERVICE
from tokenmill.cluster.supervisor import Supervisor
from plumbing.tls import ClientTLS, ClusterTLS, aio_channel

pytestmark = pytest.mark.slow

MESSAGE_LIMIT = 256 * 1024  # every server's, so that an over-limit message stays cheap to build
REDIS_USER, REDIS_PASSWORD = "tokenmill", "s3cret/P@ss"  # '/' and '@' must survive the URL


@pytest.fixture(scope="module")
def secure_cluster(tmp_path_factory):
    model, _ = make_tiny_hf_model(tmp_path_factory.mktemp("model"))
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    config = resolve_ports(with_settings(ClusterConfig(),
        model=str(model), gateway_port=0, scheduler_port=0, worker_port=0, redis_port=0, http_port=0,
        kv_cache_mb=4, redis_user=REDIS_USER, redis_password=REDIS_PASSWORD,
        tls=ClusterTLS(pki.ca, pki.server_cert, pki.server_key, pki.client_cert, pki.client_key),
        max_message_bytes=MESSAGE_LIMIT, internal_max_message_bytes=MESSAGE_LIMIT))
    # the supervisor's readiness probes must speak mTLS to see any of the three servers ready
    with Supervisor(cluster_specs(config), echo=False, startup_timeout_s=300):
        yield config, pki


def test_a_request_is_served_over_mutual_tls_and_recorded_by_the_acl_user(secure_cluster):
    config, pki = secure_cluster
    with Client(config.gateway_address, timeout=120, tls_ca=pki.ca, tls_cert=pki.client_cert,
                tls_key=pki.client_key) as client:
        result = client.generate("Hello", max_tokens=8, temperature=0, ignore_eos=True)
        assert result.usage.completion_tokens == 8
        # the scheduler wrote the record and the gateway reads it back, both as the ACL user
        for _ in range(200):
            with contextlib.suppress(ClientError):
                if client.request_status(result.request_id).status == "finished":
                    break
            time.sleep(0.05)
        assert client.request_status(result.request_id).num_output_tokens == 8
    with redis.Redis(port=config.redis_port, socket_timeout=5) as anonymous:
        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.ping()
    with redis.Redis.from_url(config.effective_redis_url, socket_timeout=5) as tokenmill_user:
        assert tokenmill_user.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            tokenmill_user.flushall()  # the ACL user may not run Redis's dangerous commands


def _address(config: ClusterConfig, server: str) -> str:
    return {"gateway": config.gateway_address, "scheduler": config.scheduler_address,
            "worker": config.worker_address}[server]


SERVICES = {"gateway": GENERATION_SERVICE, "scheduler": SCHEDULER_SERVICE, "worker": WORKER_SERVICE}


@pytest.mark.parametrize("server", SERVICES)
async def test_every_server_refuses_plaintext_no_certificate_and_another_cas_certificate(secure_cluster, server):
    config, pki = secure_cluster
    clients = {
        "our client certificate": ClientTLS(pki.ca, pki.client_cert, pki.client_key),
        "plaintext": None,
        "TLS without a client certificate": ClientTLS(pki.ca),
        "a client certificate from another CA": ClientTLS(pki.ca, pki.stranger_client_cert, pki.stranger_client_key),
    }
    outcomes = {}
    for what, client_tls in clients.items():
        async with aio_channel(_address(config, server), client_tls) as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=SERVICES[server]), timeout=30)
                outcomes[what] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as error:
                outcomes[what] = error.code().name
    assert outcomes == {"our client certificate": "SERVING", "plaintext": "UNAVAILABLE",
                        "TLS without a client certificate": "UNAVAILABLE",
                        "a client certificate from another CA": "UNAVAILABLE"}


@pytest.mark.parametrize("server, role", [("scheduler", "gateway"), ("worker", "scheduler")])
async def test_internal_servers_admit_only_certificates_naming_their_callers_role(secure_cluster, server, role):
    config, pki = secure_cluster
    certificates = {"gateway": (pki.gateway_cert, pki.gateway_key), "scheduler": (pki.scheduler_cert, pki.scheduler_key),
                    "none": (pki.roleless_cert, pki.roleless_key)}
    outcomes = {}
    for name, (cert, key) in certificates.items():
        async with aio_channel(_address(config, server), ClientTLS(pki.ca, cert, key)) as channel:
            try:
                if server == "scheduler":
                    await scheduler_pb2_grpc.SchedulerStub(channel).GetLoad(scheduler_pb2.GetLoadRequest(), timeout=30)
                else:
                    await worker_pb2_grpc.WorkerStub(channel).GetCapacity(worker_pb2.GetCapacityRequest(), timeout=30)
                outcomes[name] = "OK"
            except grpc.aio.AioRpcError as error:
                outcomes[name] = error.code().name
                assert f"naming the role {role}" in error.details()
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICES[server]), timeout=30)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # health stays open
    assert outcomes == {name: "OK" if name == role else "PERMISSION_DENIED" for name in certificates}


async def _over_the_limit(config: ClusterConfig, pki, server: str) -> grpc.aio.AioRpcError:
    too_many = MESSAGE_LIMIT + 1024
    async with aio_channel(_address(config, server), ClientTLS(pki.ca, pki.client_cert, pki.client_key)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            if server == "gateway":
                await generation_pb2_grpc.GenerationStub(channel).Tokenize(
                    generation_pb2.TokenizeRequest(text="a" * too_many), timeout=30)
            elif server == "scheduler":
                call = scheduler_pb2_grpc.SchedulerStub(channel).Submit(
                    scheduler_pb2.SubmitRequest(request_id="huge", prompt_token_ids=[1] * too_many), timeout=30)
                async for _ in call:
                    pass
            else:
                await worker_pb2_grpc.WorkerStub(channel).ExecuteStep(
                    worker_pb2.StepPlan(step_id=1, finished_request_ids=["x" * 1024] * (too_many // 1024)), timeout=30)
    return caught.value


@pytest.mark.parametrize("server", SERVICES)
async def test_every_server_answers_resource_exhausted_above_its_message_limit(secure_cluster, server):
    config, pki = secure_cluster
    error = await _over_the_limit(config, pki, server)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert str(MESSAGE_LIMIT) in error.details()  # gRPC names the limit: "... larger than max (N vs. 262144)"


async def test_the_http_api_is_https_with_client_certificates_and_a_body_limit(secure_cluster):
    config, pki = secure_cluster
    url = f"https://{config.http_address}/v1"
    context = ssl.create_default_context(cafile=pki.ca)
    context.load_cert_chain(pki.client_cert, pki.client_key)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/models", ssl=context) as response:
            assert response.status == 200
        body = {"model": "x", "prompt": "a" * (MESSAGE_LIMIT + 1024)}
        async with session.post(f"{url}/completions", json=body, ssl=context) as response:
            assert response.status == 413
        with pytest.raises(aiohttp.ClientError):  # a TLS client without a certificate never gets an answer
            async with session.get(f"{url}/models", ssl=ssl.create_default_context(cafile=pki.ca)) as response:
                await response.read()


def test_a_wrong_redis_password_stops_a_process_naming_the_url_without_the_password(secure_cluster):
    config, _ = secure_cluster
    url = f"redis://{REDIS_USER}:wrong-secret@127.0.0.1:{config.redis_port}/0"
    process = subprocess.run(
        [sys.executable, "-m", "scheduler.main", "--port", str(free_port()), "--worker", "127.0.0.1:1",
         "--redis-url", url], capture_output=True, text=True, timeout=120)
    assert process.returncode == 1
    assert f"Redis at redis://{REDIS_USER}:***@127.0.0.1:{config.redis_port}/0 refused" in process.stderr
    assert "wrong-secret" not in process.stderr + process.stdout


def test_tokenmill_generate_connects_with_client_certificates(secure_cluster, capsys):
    config, pki = secure_cluster
    common = ["generate", "Hello", "--address", config.gateway_address, "--max-tokens", "4", "--temperature", "0",
              "--tls-ca", pki.ca]
    assert cli.main([*common, "--tls-cert", pki.client_cert, "--tls-key", pki.client_key,
                     "--connect-timeout-s", "60"]) == 0
    assert "4 tokens" in capsys.readouterr().err
    # no client certificate: the gateway never lets it connect (so it waits out the connect timeout)
    assert cli.main([*common, "--connect-timeout-s", "2"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
