"""Page accounting: which KV pages each request owns (paged or static policy, device and host tiers),
the page pool with its prefix-cache index, and whether a preempted victim swaps or recomputes.

Rule: imports only core/ and this room; it reads a request through the PagedRequest protocol, never
the scheduling rule (scheduler.scheduler, scheduler.request) nor scheduler.process.
"""
