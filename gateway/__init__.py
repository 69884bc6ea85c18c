"""The public front door: every client-facing API, and the typed client of the scheduler behind it.

| modules | what they hold |
| --- | --- |
| `main`, `service`, `kserve_service`, `openai_http` | the process and its three APIs: tokenmill.v1 gRPC, KServe v2 gRPC, OpenAI-compatible HTTP (thin: convert, call, convert back) |
| `request_builder`, `validation`, `chat_template`, `openai_requests`, `openai_constraints` | a client's request -> a validated, tokenized `core.requests.GenerationRequest` (constraints checked by `plumbing.grammar`) |
| `tokenizer`, `gguf_tokenizer`, `detokenizer`, `text_stream`, `stop_strings` | text <-> token ids, incremental detokenization, stop strings |
| `generation_stream`, `resume`, `openai_responses` | one request's outputs as text deltas; attaching to a running request; OpenAI bodies |
| `scheduler_client`, `replica_router`, `replica_choice`, `circuit_breaker`, `lost_requests` | the hop to the schedulers: typed calls (`GenerationRequest` in, `RequestOutput` out, `core.errors` raised), replica choice, breakers |
| `access`, `api_keys`, `rate_limit`, `ownership` | who may call, how often, and whose request an id is |
| `telemetry` | the gateway's request spans and latency metrics (set up by `plumbing.telemetry`) |

Imports: `core`, `plumbing`, `protos`, `kvstore`; never `scheduler` or `worker` (tests/test_layering.py).
"""
