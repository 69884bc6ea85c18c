"""Which file backs an address of this process: weights that should be the file's own pages, not copies."""
from __future__ import annotations

from pathlib import Path


def mapped_file(address: int) -> str | None:
    """The file whose mapping holds address in this process (/proc/self/maps), None for anonymous memory."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(value, 16) for value in fields[0].split("-"))
        if low <= address < high:
            return fields[5].strip() if len(fields) == 6 else None
    return None
