"""Which replica a request goes to: the longest cached prefix unless overloaded, else least loaded."""
from __future__ import annotations

import pytest

from gateway.upstream.replica_choice import ReplicaView, cached_prefix_blocks, choose_replica

KEYS = [bytes([i]) * 16 for i in range(6)]  # a prompt's chained block keys, in order


def test_least_loaded_wins_without_prefixes_and_equals_take_turns():
    replicas = [ReplicaView("a", in_flight=3), ReplicaView("b", reported_requests=1), ReplicaView("c", in_flight=2)]
    assert choose_replica(replicas, KEYS) == 1
    equal = [ReplicaView("a"), ReplicaView("b")]
    assert {choose_replica(equal, KEYS, rotation=r) for r in range(2)} == {0, 1}


def test_kv_usage_breaks_ties_between_equally_busy_replicas():
    replicas = [ReplicaView("a", in_flight=1, kv_usage=0.9), ReplicaView("b", in_flight=1, kv_usage=0.2)]
    assert choose_replica(replicas, [], rotation=0) == 1


def test_longest_cached_prefix_wins_and_a_chain_breaks_at_the_first_miss():
    replicas = [ReplicaView("a", prefixes=set(KEYS[:2])), ReplicaView("b", in_flight=2, prefixes=set(KEYS[:4])),
                ReplicaView("c", prefixes=set(KEYS[1:]))]  # c lacks the first block: holds no prefix
    assert cached_prefix_blocks(KEYS, replicas[2].prefixes) == 0
    assert choose_replica(replicas, KEYS) == 1


def test_an_overloaded_holder_loses_to_the_least_loaded():
    holder = ReplicaView("a", in_flight=6, prefixes=set(KEYS))
    idle = ReplicaView("b", in_flight=1)
    assert choose_replica([holder, idle], KEYS, max_load_imbalance=4) == 1
    assert choose_replica([holder, idle], KEYS, max_load_imbalance=5) == 0
    # what the replica reports counts too (requests sent by other gateways)
    busy_elsewhere = ReplicaView("a", reported_requests=9, prefixes=set(KEYS))
    assert choose_replica([busy_elsewhere, idle], KEYS) == 1


def test_no_replicas_is_an_error_naming_it():
    with pytest.raises(ValueError, match="at least one replica"):
        choose_replica([], KEYS)
