"""tokenmill: an LLM inference serving cluster built as gRPC microservices.

This package is the roof, the only one that may import every other: the command line (`cli`,
`client_cli`), the local process supervisor (`supervisor`, `cluster`, `child_process`, `redis_process`,
`restart_*`, `readiness`, `healthcheck`), the in-process engine (`llm`), the Python client (`client`)
and the benchmarks (`bench`, `bench_*`, `int8_agreement`). Nothing below it imports it: shared contract
types are in `core/`, shared process plumbing in `plumbing/`.
"""

__version__ = "0.1.0"
