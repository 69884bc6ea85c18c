"""Where each model replica publishes its load and its cached prefixes in Redis (one place, so the
scheduler that writes and the gateway that reads cannot disagree).

    tokenmill:replica:{replica}:load      hash, LOAD_FIELDS below; expires LOAD_TTL_S after the last report
    tokenmill:replica:{replica}:prefixes  set of hex chained prefix keys (scheduler/pages/block_pool.py) that
                                          the replica's KV cache holds now; expires PREFIX_TTL_S after
                                          the last report

{replica} is the address gateways dial to reach that scheduler (HOST:PORT), so a gateway that found
the replica by DNS or a static list can find its keys without asking it.
"""
from __future__ import annotations

LOAD_TTL_S = 5  # a replica that stopped reporting for this long is treated as unknown load
PREFIX_TTL_S = 30  # its prefixes stop attracting requests after this long
REPORT_INTERVAL_S = 0.5

# hash fields, all integers; reported_at_ms is the report's wall-clock time (Unix milliseconds)
LOAD_FIELDS = ("num_waiting_requests", "num_running_requests", "num_waiting_tokens", "num_kv_pages_used",
               "num_kv_pages_total", "num_requests_total", "prefix_version", "reported_at_ms")


def load_key(replica: str) -> str:
    return f"tokenmill:replica:{replica}:load"


def prefixes_key(replica: str) -> str:
    return f"tokenmill:replica:{replica}:prefixes"
