"""The blocking client is written from the asyncio one (tokenmill.client.generate_sync), never by hand."""
from __future__ import annotations

import pytest

from tokenmill.client.generate_sync import ASYNC_SOURCE, SYNC_TARGET, unasync


def test_committed_blocking_client_is_the_generated_one():
    fresh = unasync(ASYNC_SOURCE.read_text())
    assert SYNC_TARGET.read_text() == fresh, "sync_client.py is stale: run `python -m tokenmill.client.generate_sync`"


def test_generated_client_is_blocking():
    generated = unasync(ASYNC_SOURCE.read_text())
    assert "class Client(ClientBase):" in generated
    assert "time.sleep(attempts.wait_s(error, received))" in generated
    assert "except grpc.RpcError as error:" in generated
    assert "def __enter__(self) -> Client:" in generated


def test_an_asyncio_call_without_a_blocking_form_fails_loudly():
    source = ASYNC_SOURCE.read_text().replace("await asyncio.sleep(", "await asyncio.wait_for(asyncio.sleep(", 1)
    with pytest.raises(ValueError, match="'asyncio' has no blocking form"):
        unasync(source)


def test_a_reworded_docstring_fails_loudly():
    source = ASYNC_SOURCE.read_text().replace("The asyncio client of", "An asyncio client of", 1)
    with pytest.raises(ValueError, match="no longer holds the phrase"):
        unasync(source)
