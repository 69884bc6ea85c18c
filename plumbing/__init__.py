"""Process plumbing every tokenmill service shares, beside `core/` on the ground floor: it needs grpc,
OpenTelemetry and Prometheus, which `core/` does not.

| module | what it holds |
| --- | --- |
| `plumbing.rpc` | server creation, health and reflection, the one exception -> gRPC status map |
| `plumbing.tls` | TLS / mutual TLS for every gRPC server and channel |
| `plumbing.message_size` | gRPC message size limits (public and internal) |
| `plumbing.process` | a service's main(): run, wait for a stop signal, cancel background tasks |
| `plumbing.drain` | graceful shutdown: refuse new calls while in-flight ones finish |
| `plumbing.handlers` | a gRPC method handler of the same kind with other behaviour (every server interceptor) |
| `plumbing.telemetry` | tracing, Prometheus metrics, JSON logs set up per process |

It imports only `core/` of ours; what is specific to one service (its spans, its metrics' meaning)
lives in that service (`gateway.telemetry`, `scheduler.process.telemetry`, `worker.step_telemetry`).
"""
