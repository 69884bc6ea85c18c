"""The ground floor: the contract every tokenmill process shares, in pure Python, importing nothing of ours.

| module | what it holds |
| --- | --- |
| `core.errors` | the typed failures (`ServingError` and its kinds, `ErrorCode`), mapped to gRPC statuses once, in `plumbing.rpc` |
| `core.sampling` | `SamplingParams`, `SamplingLimits` and the one range check; `GREEDY_TEMPERATURE` |
| `core.requests` | `GenerationRequest`: what a gateway submits to a scheduler |
| `core.step` | the step plan / step result messages between scheduler and worker |
| `core.outputs` | `RequestOutput` and `FinishReason`: what a scheduler streams back per request |
| `core.prefix_keys` | the chained content hashes of full KV blocks (DESIGN invariant 8) |

Above it: `plumbing/` (rpc, tls, telemetry, process helpers; needs grpc / OpenTelemetry), `protos/`
(the wire and the codec to and from these types) and `kvstore/`; then the services; then `tokenmill/`.
tests/test_layering.py holds every package to those arrows.
"""
