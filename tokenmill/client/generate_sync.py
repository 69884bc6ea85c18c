"""Writes sync_client.py (Client, blocking) from async_client.py (AsyncClient): `python -m tokenmill.client.generate_sync`.

The two clients are the same steps, awaited or not (httpcore's unasync does the same for its two
connection pools). Writing one from the other keeps a fix to the retry loop or a new method from reaching
only one of them; tests/tokenmill/test_client_generated.py fails when the committed file is stale.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ASYNC_SOURCE = HERE / "async_client.py"
SYNC_TARGET = HERE / "sync_client.py"

HEADER = "# Generated from async_client.py by `python -m tokenmill.client.generate_sync`; edit that file, not this one.\n"

# The code, in this order (each a regex on whole words): the asyncio names first, the keywords last.
TOKENS = (
    (r"\bAsyncClient\b", "Client"),
    (r"\baio_channel\b", "channel"),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\bgrpc\.aio\.AioRpcError\b", "grpc.RpcError"),
    (r"\bimport asyncio\b", "import time"),
    (r"\basyncio\.sleep\b", "time.sleep"),
    (r"\bAsyncIterator\b", "Iterator"),
    (r"\basync (def|for|with) ", r"\1 "),
    (r"\(await (self\._unary\([^()]*\))\)(?=\.)", r"\1"),  # (await call).field: the parentheses served the await
    (r"\bawait ", ""),
)

# After the code's rules: whole phrases of the async file's docstring that are only true of asyncio; each
# must be found (a reworded docstring fails loudly here instead of leaving an asyncio sentence behind).
PHRASES = (
    ("The asyncio client of tokenmill.v1.Generation (grpc.aio); the same methods as Client, awaited.",
     "The blocking client of tokenmill.v1.Generation; AsyncClient has the same methods, awaited."),
    ("Closing a stream early cancels the request; Python closes an\n"
     "async generator left by `break` only when it is collected, so wrap it in contextlib.aclosing.",
     "Leaving a stream early (break) cancels the request."),
)


def unasync(source: str) -> str:
    for pattern, replacement in TOKENS:
        source = re.sub(pattern, replacement, source)
    for phrase, replacement in PHRASES:
        if phrase not in source:
            raise ValueError(f"async_client.py no longer holds the phrase {phrase!r}: update PHRASES in {__file__}")
        source = source.replace(phrase, replacement)
    # what no rule turned blocking would be a coroutine in the blocking client
    leftover = re.search(r"\b(async|await|asyncio|aio)\b", source)
    if leftover:
        line = source.count("\n", 0, leftover.start()) + 1
        raise ValueError(f"async_client.py line {line}: {leftover.group()!r} has no blocking form in TOKENS")
    return HEADER + source


def main() -> int:
    SYNC_TARGET.write_text(unasync(ASYNC_SOURCE.read_text()))
    print(f"wrote {SYNC_TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
