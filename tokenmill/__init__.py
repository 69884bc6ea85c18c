"""tokenmill: an LLM inference serving cluster built as gRPC microservices.

This package is the roof, the only one that may import every service. Nothing below it imports it:
shared contract types are in `core/`, shared process plumbing in `plumbing/`. Its rooms, arrows down:

    the app     the modules at the top: the `tokenmill` command line (serve, generate, hash-api-key,
                and the benchmarks it hands its arguments to), the in-process engine (scheduler and
                worker in one process, no gRPC)
    bench/      every benchmark and accuracy measurement; may use cluster/, client/ and the engine;
                nothing in the roof imports it (the command line names its modules by string)
    cluster/    process management: the cluster's one config, each child's argv, the supervisor and
                its restarts, readiness probes, redis-server, the containers' health check; imports
                the services' torch-free options, never bench/, client/ or the app
    client/     the Python client of the public gRPC API; imports only protos/ and plumbing/
"""

__version__ = "0.1.0"
