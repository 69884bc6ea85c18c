"""gRPC keepalive for every server and channel tokenmill makes (plumbing.rpc.create_server and
plumbing.tls.channel / aio_channel add these; options a caller passes win).

Without keepalive a peer that vanished without closing its TCP connection (a node lost, a NAT or load
balancer that dropped the flow, a frozen process) is noticed only when the next call times out, and an
idle connection may be cut silently by whatever sits in between. With it:

- channels ping after CHANNEL_KEEPALIVE_TIME_S without activity, also with no call open, and drop the
  connection when a ping is unanswered for KEEPALIVE_TIMEOUT_S (then reconnect as usual);
- servers ping their clients likewise (SERVER_KEEPALIVE_TIME_S) and accept client pings as often as
  every MIN_CLIENT_PING_INTERVAL_S, even without calls: gRPC's default (one per 5 minutes, none
  without calls) answers a keepalive client with GOAWAY "too_many_pings";
- a public server (the gateway) can also end connections after a maximum age
  (`--max-connection-age-s`), so clients behind a load balancer spread over new replicas; calls in
  flight then finish first (the grace is unbounded).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CHANNEL_KEEPALIVE_TIME_S = 30.0
SERVER_KEEPALIVE_TIME_S = 60.0
KEEPALIVE_TIMEOUT_S = 10.0
MIN_CLIENT_PING_INTERVAL_S = 5.0  # below our channels' interval, so theirs are never refused

CHANNEL_KEEPALIVE_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.keepalive_time_ms", int(CHANNEL_KEEPALIVE_TIME_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),  # idle connections are exactly the ones to check
)

SERVER_KEEPALIVE_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.keepalive_time_ms", int(SERVER_KEEPALIVE_TIME_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", int(MIN_CLIENT_PING_INTERVAL_S * 1000)),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.http2.max_pings_without_data", 0),
)


def merged(defaults: Sequence[tuple[str, Any]], options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """defaults overridden by options of the same name (gRPC would otherwise see both)."""
    return list({**dict(defaults), **dict(options)}.items())


def channel_options(options: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    return merged(CHANNEL_KEEPALIVE_OPTIONS, options)


def server_options(options: Sequence[tuple[str, Any]] = (), max_connection_age_s: float = 0.0) -> list[tuple[str, Any]]:
    """max_connection_age_s: 0 keeps connections for ever (internal servers: a scheduler treats its
    worker's connection going away as the worker going away)."""
    age = [("grpc.max_connection_age_ms", int(max_connection_age_s * 1000))] if max_connection_age_s > 0 else []
    return merged([*SERVER_KEEPALIVE_OPTIONS, *age], options)
