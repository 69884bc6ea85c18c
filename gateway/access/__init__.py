"""Who may call the gateway, and how often: API keys, per-key rate limits, and the gRPC interceptor and
HTTP middleware that check both on every public API.

Imports no other gateway room.
"""
