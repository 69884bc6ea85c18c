"""Continuous batching and KV page accounting. Pure Python: nothing here imports torch.

Layout, from the scheduling rule outwards (the shared types it works on live in core/):

    the rule        scheduler.py      schedule() / update(), and assume_done() / update_assumed() for async
                                      scheduling; one rule for prefill, decode, prefix hits and recompute
                    request.py        the one state object per request
    its parts       kv_manager.py     which pages each request owns (paged or static policy), in both tiers
                    block_pool.py     pages, reference counts, the prefix-cache index
                    preemption.py     swap or recompute, per victim, by cost
                    latency_targets.py  each step's budget and admissions under --target-itl-ms / --target-ttft-ms
                    step_time.py      the step-time model they learn online
                    queue_policy.py   FCFS or priority waiting queues
                    config.py         the one config object; stats.py: the load figures it reports
    the step loop   step_pipeline.py  schedule -> send the plan -> apply its result, 1 (sync) or 2 (async
                                      scheduling) steps in flight: written once, driven by the two below
                    engine.py         EngineCore: the pipeline over a synchronous, in-process executor
                    loop.py           EngineLoop: the pipeline on asyncio over a worker, the process's single
                                      owner of the Scheduler
                    worker_recovery.py  decides what becomes of a lost worker's requests; the loop acts
                    inbox.py          typed items (AddRequest, AbortRequest) handlers leave for the loop
                    request_streams.py  each request's stream, timings, deadline, Redis sinks
                    admission.py      what may be queued (request checks, bounded waiting queue)
                    executor.py       what plans are sent to (Executor, AsyncExecutor)
    the process     main.py           flags -> config -> WorkerClient, EngineLoop, servicer
                    service.py        the gRPC servicer (protobuf at the edge only)
                    worker_client.py  the worker over gRPC, an AsyncExecutor
                    load_report.py, telemetry.py   load and prefix keys to Redis; metrics and spans
                    readmission.py    a restarted scheduler takes up the resumable requests it ran
                    orphans.py        aborts resumable requests nobody follows (--orphan-timeout-s)
"""
