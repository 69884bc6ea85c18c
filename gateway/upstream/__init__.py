"""The gateway -> scheduler hop, which the generation code sees as one `SchedulerTarget` protocol routing each
call to a `Route`: the typed scheduler client (GenerationRequest in, RequestOutput out, core.errors raised;
its own route), or the replica router and its choice (a route per replica); the per-scheduler delta
stream, circuit breakers.

Imports no other gateway room: it knows schedulers, not clients.
"""
