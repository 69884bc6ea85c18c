"""Chained content hashes of full blocks (invariant 8).

A full block's key hashes its parent's key and its own tokens, so one key names the whole prefix up
to and including that block. blake2b rather than Python's hash(): keys must agree across processes
(the cluster-wide prefix index in Redis uses them) and must not collide in practice.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

ROOT_KEY = b""


def hash_block(parent_key: bytes, token_ids: Sequence[int]) -> bytes:
    digest = hashlib.blake2b(parent_key, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(block_hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        num_tokens: int | None = None) -> None:
    """Appends the keys of blocks of token_ids that became full since block_hashes was last extended.
    num_tokens: hash only token_ids[:num_tokens] (async scheduling: the rest are placeholders)."""
    num_full = (len(token_ids) if num_tokens is None else num_tokens) // block_size
    for index in range(len(block_hashes), num_full):
        parent = block_hashes[-1] if block_hashes else ROOT_KEY
        block_hashes.append(hash_block(parent, token_ids[index * block_size:(index + 1) * block_size]))
