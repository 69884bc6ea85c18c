"""Message size limits: every server refuses a larger message with RESOURCE_EXHAUSTED before
decoding it, so one client cannot make a process allocate without bound.

The public gateway defaults to gRPC's own 4 MiB (a 500,000-character prompt in UTF-8 is at most 2 MB).
The internal links carry step plans, which hold whole prompts of new requests: max_num_seqs prompts of
up to max_model_len token ids each (64 x 32,768 ids at <= 5 bytes is 10 MiB), so 64 MiB leaves room.
"""
from __future__ import annotations

import argparse
from typing import Any

from plumbing.options import ranged

PUBLIC_MAX_MESSAGE_BYTES = 4 * 2**20
INTERNAL_MAX_MESSAGE_BYTES = 64 * 2**20


def message_size_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """grpc server or channel options capping both directions."""
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]


_MESSAGE_BYTES = ranged(int, 1024, what=">= 1024 (bytes)")


def add_message_size_argument(parser: argparse.ArgumentParser, default: int) -> None:
    parser.add_argument("--max-message-bytes", type=_MESSAGE_BYTES, default=default,
                        help="largest gRPC message (and HTTP body) accepted or sent; larger ones get "
                             "RESOURCE_EXHAUSTED (default: %(default)s)")
