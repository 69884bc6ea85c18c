"""Which model replica gets a request: the one holding the longest cached prefix of its prompt, unless
that one is loaded well beyond the least loaded; otherwise the least loaded. Pure: no I/O, no clock.

Load is counted in requests: the larger of what this gateway has in flight there (instant, but blind
to other gateways) and what the replica last reported running + waiting (covers every gateway, but
REPORT_INTERVAL_S old). KV page use (0..1) breaks ties between equally busy replicas.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

# A prefix-holding replica is preferred while it has at most this many more requests than the least
# loaded one; beyond that, recomputing the prefix elsewhere is cheaper than queueing behind it.
DEFAULT_MAX_LOAD_IMBALANCE = 4


@dataclass(slots=True)
class ReplicaView:
    address: str
    in_flight: int = 0  # requests this gateway routed there that have not finished
    reported_requests: int = 0  # running + waiting, from its last load report
    kv_usage: float = 0.0  # used / total KV pages, from its last load report
    prefixes: Collection[bytes] = field(default_factory=frozenset)  # chained block keys it holds

    @property
    def load(self) -> float:
        return max(self.in_flight, self.reported_requests) + self.kv_usage


def cached_prefix_blocks(block_keys: Sequence[bytes], prefixes: Collection[bytes]) -> int:
    """Leading blocks of the prompt the replica holds (keys are chained: a miss ends the prefix)."""
    count = 0
    for key in block_keys:
        if key not in prefixes:
            break
        count += 1
    return count


def choose_replica(replicas: Sequence[ReplicaView], block_keys: Sequence[bytes], *, rotation: int = 0,
                   max_load_imbalance: float = DEFAULT_MAX_LOAD_IMBALANCE) -> int:
    """Index into replicas (at least one). rotation: where to start among equals, so that equally
    loaded replicas take turns instead of the first one taking every burst."""
    if not replicas:
        raise ValueError("choose_replica needs at least one replica; got none")
    order = [(rotation + offset) % len(replicas) for offset in range(len(replicas))]
    least_loaded = min(order, key=lambda index: replicas[index].load)
    limit = replicas[least_loaded].load + max_load_imbalance
    best, best_blocks = least_loaded, 0
    for index in order:
        replica = replicas[index]
        if replica.load > limit:
            continue
        blocks = cached_prefix_blocks(block_keys, replica.prefixes)
        if blocks > best_blocks or (blocks == best_blocks and blocks and replica.load < replicas[best].load):
            best, best_blocks = index, blocks
    return best
