"""The gateway's front doors: tokenmill.v1 gRPC (`generation`), KServe v2 gRPC (`kserve`), and the
OpenAI-compatible HTTP API (`openai/`), plus the idle timeout every streaming call shares.

Each is thin: its wire format -> a prepared request (gateway.prepare) and a CallContext -> the one route
choice, Generations.stream (gateway.generation) -> its wire format back. All three are built on one
ServedModel (served_model.py). Nothing below this room imports it.
"""
