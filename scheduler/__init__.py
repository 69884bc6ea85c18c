"""Continuous batching and KV page accounting. Pure Python: nothing here imports torch.

Rooms, from the scheduling rule outwards (the shared types it works on live in core/):

    (top level)  the rule: scheduler.py's schedule() / update() over request.py's one state object per
                 request (async_steps.py: its steps in flight; worker_loss.py: its recovery), with its
                 policies (queues, latency targets and the step-time model they learn, admission,
                 speculation.py's draft proposers), its config and load figures; the step pipeline written
                 once (schedule -> send the plan -> apply its result) and EngineCore, the pipeline over an
                 in-process executor. Imports pages/, never process/.
    pages/       page accounting: which pages each request owns in both tiers, the pool with its
                 prefix index, swap or recompute per preempted victim. Imports no other room.
    process/     the scheduler process around the rule: the asyncio step loop (the Scheduler's single
                 owner), the gRPC servicer (protobuf at the edge only), the worker client and what
                 becomes of a lost worker's requests, request streams, and the Redis side (records,
                 token streams, load reports, re-admission, orphans), metrics and spans.
                 May import the rule and pages/.
    main.py      `python -m scheduler.main`: options.py's SchedulerOptions -> process/, the only top-level
                 module that imports process/.
"""
