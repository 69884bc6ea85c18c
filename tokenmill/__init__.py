"""tokenmill: an LLM inference serving cluster built as gRPC microservices."""

__version__ = "0.1.0"
