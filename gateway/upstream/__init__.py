"""The gateway -> scheduler hop: the typed scheduler client (GenerationRequest in, RequestOutput out,
core.errors raised), the per-scheduler delta stream, the replica router and its choice, circuit breakers.

Imports no other gateway room: it knows schedulers, not clients.
"""
