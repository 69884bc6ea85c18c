"""Python client of the public tokenmill.v1.Generation gRPC API, blocking (Client) and asyncio (AsyncClient).

    from tokenmill.client import Client, RetryPolicy
    client = Client("127.0.0.1:50051", timeout=60, retry=RetryPolicy(max_attempts=5))
    # TLS: Client(address, tls_ca="ca.pem"); mutual TLS: also tls_cert="client.pem", tls_key="client.key"
    print(client.generate("The capital of France is", max_tokens=8, temperature=0).text)

Errors raise ClientError (.code is the grpc.StatusCode). Which calls are retried, and when, is in
tokenmill.client.retry: UNAVAILABLE only, and generation only while nothing has been received.
Client (sync_client.py) is written from AsyncClient by `python -m tokenmill.client.generate_sync`.
"""
from tokenmill.client.async_client import AsyncClient
from tokenmill.client.retry import NO_RETRY, RetryPolicy
from tokenmill.client.sync_client import Client
from tokenmill.client.types import (ClientError, Delta, GenerationResult, Logprob, ModelInfo, RequestStatus,
                                    Timings, TopLogprob, Usage)

__all__ = ["AsyncClient", "Client", "ClientError", "Delta", "GenerationResult", "Logprob", "ModelInfo",
           "NO_RETRY", "RequestStatus", "RetryPolicy", "Timings", "TopLogprob", "Usage"]
