"""One prepared request through the scheduler as text deltas, the path every API shares, its route chosen in
one place: `Generations.stream(prepared, call)` (generations.py, whose docstring holds the route table).
`Generations` holds, once for the three APIs, the tokenizer, the scheduler target (gateway.upstream's
`SchedulerTarget`) and the Redis side (records, token streams, id claims, owners, followers); the routes
are a plain stream, parallel samples (n > 1, best_of), and with Redis resumable requests with claimed
ids that a client can attach to by id and index.

The rule: only `Generations.stream` starts a generation (the APIs call nothing else), and no wire format
crosses into this room: each edge reads its wire (protobuf, HTTP headers, KServe tensors) into a
`CallContext` (deadline, arrival, owner, chosen id, resume index). Imports gateway.prepare, gateway.text,
gateway.upstream and gateway.access; never gateway.apis.
"""
