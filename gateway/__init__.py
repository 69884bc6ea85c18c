"""The public front door: every client-facing API, and the typed client of the scheduler behind it.

Rooms (arrows point down; tests/test_layering.py holds them):

| room | what it holds | may import (of the gateway's rooms) |
| --- | --- | --- |
| `main`, `options`, `processes` | the process: `GatewayOptions` (every flag), wiring the rooms together; `--processes N` gateways on one port (SO_REUSEPORT) | all; nothing imports `main` |
| `apis/` | the three front doors: tokenmill.v1 gRPC, KServe v2 gRPC, OpenAI-compatible HTTP (`apis/openai/`), each built on one `ServedModel`, and the stream idle timeout; thin: convert, call `Generations.stream`, convert back | generation, prepare, text, upstream, access |
| `generation/` | one prepared request through the scheduler as text deltas, its route chosen once (`Generations.stream(prepared, call)`) for every API: a plain stream, parallel samples (n > 1, best_of), resume and id claims, request ownership | prepare, text, upstream, access; never apis |
| `prepare/` | a client's request -> a validated, tokenized `core.requests.GenerationRequest`: sampling checks, chat encoding, output constraints (compiled by `plumbing.grammar`) | text only |
| `text/` | text <-> token ids: tokenizers, chat templates, incremental detokenization, stop strings, tool-call syntaxes | none |
| `upstream/` | the hop to the schedulers, seen through the `SchedulerTarget` protocol (one `SchedulerClient` or a `ReplicaRouter`): typed calls (`GenerationRequest` in, `RequestOutput` out, `core.errors` raised), delta streams, replica choice, circuit breakers | none |
| `access/` | who may call, how often: API keys, rate limits, the interceptor and middleware that check them | none |
| `telemetry` | the gateway's request spans and latency metrics (set up by `plumbing.telemetry`) | none |

Imports: `core`, `plumbing`, `protos`, `kvstore`; never `scheduler` or `worker` (tests/test_layering.py).
"""
