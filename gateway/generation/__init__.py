"""One prepared request through the scheduler as text deltas, the path every API shares: a plain stream,
parallel samples (n > 1, best_of) and their groups, attaching to a running request (resume), client-chosen
request ids (claims), whose request an id is (ownership), and the records of requests lost with a scheduler.

Imports gateway.prepare, gateway.text, gateway.upstream and gateway.access; never gateway.apis: no wire
format (protobuf, JSON) crosses into this room.
"""
