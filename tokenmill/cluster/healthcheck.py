"""`python -m tokenmill.cluster.healthcheck HOST:PORT [SERVICE]`: exit 0 when the server reports SERVING for
SERVICE over grpc.health.v1, 1 otherwise. For container health checks (docker compose, Dockerfile
HEALTHCHECK) where grpc_health_probe is not installed. SERVICE "" (the default) is liveness; a
tokenmill service name (tokenmill.v1.Worker, ...) is readiness: SERVING only after warm-up.
"""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 3.0) -> tuple[bool, str]:
    """(SERVING?, what the server said or why it could not be asked)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
        except grpc.RpcError as error:
            return False, f"{error.code().name}: {error.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenmill.cluster.healthcheck", description=__doc__)
    parser.add_argument("address", help="HOST:PORT of a tokenmill gRPC server")
    parser.add_argument("service", nargs="?", default="", help='grpc.health.v1 service name ("": liveness)')
    parser.add_argument("--timeout-s", type=float, default=3.0)
    args = parser.parse_args(argv)
    ok, status = check(args.address, args.service, args.timeout_s)
    print(f"{args.address} {args.service or '(liveness)'}: {status}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
