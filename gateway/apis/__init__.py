"""The gateway's front doors: tokenmill.v1 gRPC (`generation`), KServe v2 gRPC (`kserve`), and the
OpenAI-compatible HTTP API (`openai/`), plus the idle timeout every streaming call shares.

Each is thin: its wire format -> a prepared request (gateway.prepare) -> a stream of text deltas
(gateway.generation) -> its wire format back. Nothing below this room imports it.
"""
