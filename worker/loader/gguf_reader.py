"""gguf.GGUFReader with its metadata arrays read in bulk: the same fields and tensors, seconds sooner.

GGUFReader walks an array field one element at a time, two numpy views per string, each built through
its byte-order helper: the default model's tokenizer arrays (49,152 tokens, 48,900 merges, 49,152
token types) took ~5.8 s of a ~8 s load, and the loader reads none of them (only the vocabulary's
length). Here a numeric array is one view cut into its per-element rows, and a string array's lengths
are read with struct; every field keeps GGUFReader's parts / data / types, so field.contents() and
len(field.data) answer as they did (tests/worker/loader/test_gguf_reader.py compares the two readers).
"""
from __future__ import annotations

import struct
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType


class FastGGUFReader(GGUFReader):
    def _get_field_parts(self, orig_offs: int,
                         raw_type: int) -> tuple[int, list[np.ndarray], list[int], list[GGUFValueType]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)  # scalars, strings, a byte-swapped file
        raw_item_type = self._get(orig_offs, np.uint32)
        count_part = self._get(orig_offs + 4, np.uint64)
        item_type, count = GGUFValueType(int(raw_item_type[0])), int(count_part[0])
        start = orig_offs + 12
        if item_type == GGUFValueType.STRING:
            items, end = self._string_parts(start, count)
        elif item_type in self.gguf_scalar_to_np:
            values = self._get(start, self.gguf_scalar_to_np[item_type], count)
            items, end = list(values.view(np.ndarray).reshape(count, 1)), start + int(values.nbytes)
        else:  # arrays of arrays: GGUFReader's own walk
            return super()._get_field_parts(orig_offs, raw_type)
        parts: list[np.ndarray] = [raw_item_type, count_part, *items]
        per_item = 2 if item_type == GGUFValueType.STRING else 1  # a string is its length and its bytes
        data = list(range(2 + per_item - 1, len(parts), per_item))
        types = [GGUFValueType.ARRAY] + ([item_type] if count else [])
        return end - orig_offs, parts, data, types

    def _string_parts(self, offset: int, count: int) -> tuple[list[Any], int]:
        """count strings from offset: [length (uint64[1]), bytes (uint8[length])] each, as GGUFReader cuts them."""
        blob, unpack = self.data.view(np.ndarray), struct.Struct("=Q").unpack_from
        parts: list[Any] = []
        for _ in range(count):
            (length,) = unpack(blob, offset)
            parts.append(blob[offset : offset + 8].view(np.uint64))
            parts.append(blob[offset + 8 : offset + 8 + length])
            offset += 8 + length
        return parts, offset
