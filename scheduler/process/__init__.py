"""The scheduler process around the rule: the asyncio step loop that owns the Scheduler and its inbox,
the gRPC servicer (protobuf at the edge only), the worker client and worker-loss recovery, each
request's stream and delta streams, the Redis side (request records, token streams, load reports,
re-admission after a restart, orphan aborts), metrics and spans.

Rule: may import the scheduling rule (scheduler top level) and scheduler.pages; within scheduler/, only
scheduler.main imports this room.
"""
