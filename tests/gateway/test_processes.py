"""`--processes N` (gateway.processes): one gateway as N processes on one port. A real gateway of 2
processes in front of the shared cluster's scheduler: both answer on the one gRPC port (each process's own
/metrics, on --metrics-port + its index, counts the streams it served), and SIGTERM to process 0 drains the
streams in flight in both before the processes exit."""
from __future__ import annotations

import asyncio
import signal
import sys
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from plumbing.rpc import GENERATION_SERVICE
from protos.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from tokenmill.cluster.readiness import free_port
from tokenmill.cluster.supervisor import ChildSpec, Supervisor

CONNECTIONS = 12  # the kernel hashes each to a process: all on one process has odds 2**-11
FIRST_TOKENS = "tokenmill:time_to_first_token_seconds_count"


def first_tokens(port: int) -> float:
    """The streams that process's /metrics has seen reach their first token."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == FIRST_TOKENS)


async def stream(address: str, index: int, max_tokens: int, started: asyncio.Event | None = None) -> int:
    """One GenerateStream on its own connection (no shared subchannel); the tokens it got."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        request = generation_pb2.GenerateRequest(prompt=f"Process test {index}:", parameters=generation_pb2.GenerateParameters(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        count = 0
        async for message in generation_pb2_grpc.GenerationStub(channel).GenerateStream(request):
            count += len(message.token_ids)
            if started is not None and count:
                started.set()
        return count


@pytest.fixture
def two_process_gateway(gateway_cluster):
    port, metrics_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    spec = ChildSpec("gateway-2p", [sys.executable, "-m", "gateway.main", "--processes", "2", "--port", str(port),
                                    "--http-port", "0", "--metrics-port", str(metrics_port), "--drain-timeout-s", "60",
                                    "--scheduler", gateway_cluster.scheduler_address,
                                    *(("--model", gateway_cluster.model) if gateway_cluster.model else ())],
                     GENERATION_SERVICE, f"127.0.0.1:{port}")
    with Supervisor([spec], echo=False, startup_timeout_s=180) as supervisor:
        yield supervisor, spec.address, (metrics_port, metrics_port + 1)


async def test_two_processes_answer_on_one_port_and_both_drain_their_streams(two_process_gateway):
    supervisor, address, metrics_ports = two_process_gateway
    before = [first_tokens(port) for port in metrics_ports]
    assert await asyncio.gather(*(stream(address, i, 4) for i in range(CONNECTIONS))) == [4] * CONNECTIONS
    served = [first_tokens(port) - start for port, start in zip(metrics_ports, before)]
    assert sum(served) == CONNECTIONS and min(served) > 0, f"streams per process: {served}"

    # long streams over both processes, each under way; then SIGTERM to process 0 only
    started = [asyncio.Event() for _ in range(CONNECTIONS)]
    streams = [asyncio.create_task(stream(address, 100 + i, 48, started[i])) for i in range(CONNECTIONS)]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 120)
    # the drain finishes every stream first (--drain-timeout-s 60): on a loaded 2-core machine that took over
    # the kill's default 10 s
    exit_code = await asyncio.to_thread(supervisor.kill, "gateway-2p", signal.SIGTERM, 60)
    assert await asyncio.gather(*streams) == [48] * CONNECTIONS  # none cut, in either process
    assert exit_code == 0


def test_each_process_gets_its_own_metrics_port_and_shares_the_serving_ports():
    from gateway.options import GatewayOptions
    from gateway.processes import child_options, process_count

    options = GatewayOptions(port=50051, http_port=8000, metrics_port=9400, processes=4)
    assert [child_options(options, i).metrics_port for i in range(4)] == [9400, 9401, 9402, 9403]
    assert all(child_options(options, i).reuse_port and child_options(options, i).processes == 1 for i in range(4))
    assert child_options(GatewayOptions(metrics_port=None), 2).metrics_port is None  # no endpoint: none
    assert process_count(options) == 4 and process_count(GatewayOptions(port=0, processes=4)) == 1
