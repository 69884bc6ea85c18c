"""A restarted worker keeps the page count of its first start (issue 31 item 3): the first sizing from
memory is recorded and reused while its pages fit, whatever a fresh sizing from the memory free now
would give; only pages that no longer fit, or other settings, size anew. The free memory is given
explicitly, so each start's fresh sizing is known."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.tiny_models import make_tiny_hf_model
from worker.build import build_sized_runner
from worker.kv_sizing import REUSED_SIZING, SizingRecord, read_sizing_record, size_from_memory_or_record
from worker.model.kv_cache import bytes_per_block
from worker.options import WorkerOptions

CPU = torch.device("cpu")
MIB = 2**20
BLOCK_SIZE = 16


def test_the_first_sizing_is_recorded_and_reused_while_its_pages_fit():
    first, record = size_from_memory_or_record(None, "settings", 1000 * MIB, 100 * MIB, 0.5, MIB, CPU)
    assert first.num_blocks == 450 and record == SizingRecord(450, MIB, "settings", first.reason)

    # a restart finds less memory free: afresh it would take 0.5 x 600 = 300 pages; the 450 still fit
    again, to_write = size_from_memory_or_record(record, "settings", 700 * MIB, 100 * MIB, 0.5, MIB, CPU)
    assert (again.num_blocks, again.kv_cache_bytes, to_write) == (450, 450 * MIB, None)
    assert again.reason.startswith(f"{REUSED_SIZING}: 450 pages from 0.5 x (1000 MiB")
    # ... or more: still the first count, not 0.5 x 1900
    assert size_from_memory_or_record(record, "settings", 2000 * MIB, 100 * MIB, 0.5, MIB, CPU)[0].num_blocks == 450


def test_pages_that_no_longer_fit_size_anew_and_the_record_stays():
    record = SizingRecord(450, MIB, "settings", "0.5 x (1000 MiB free ...)")
    smaller, to_write = size_from_memory_or_record(record, "settings", 400 * MIB, 100 * MIB, 0.5, MIB, CPU)
    assert smaller.num_blocks == 150 and to_write is None  # memory that comes back brings the 450 back
    assert "the recorded 450 pages (450.0 MiB) of the first start no longer fit in 300 MiB" in smaller.reason


def test_other_settings_or_page_size_are_an_explicit_resize():
    record = SizingRecord(450, MIB, "fraction=0.5", "...")
    resized, to_write = size_from_memory_or_record(record, "fraction=0.25", 1000 * MIB, 100 * MIB, 0.25, MIB, CPU)
    assert resized.num_blocks == 225 and to_write == SizingRecord(225, MIB, "fraction=0.25", resized.reason)
    other_pages, to_write = size_from_memory_or_record(record, "fraction=0.5", 1000 * MIB, 100 * MIB, 0.5, 2 * MIB, CPU)
    assert other_pages.num_blocks == 225 and to_write.bytes_per_block == 2 * MIB


def test_a_missing_or_unreadable_record_is_none(tmp_path):
    assert read_sizing_record(tmp_path / "absent.json") is None
    (tmp_path / "broken.json").write_text("{not json")
    assert read_sizing_record(tmp_path / "broken.json") is None


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder, _ = make_tiny_hf_model(tmp_path_factory.mktemp("sizing-record"), "llama_gqa")
    return folder


def start(folder, record, free_bytes, fraction=0.001):
    """One worker start's model and KV cache, sized from free_bytes of memory."""
    options = WorkerOptions(model=str(folder), dtype="float32", block_size=BLOCK_SIZE, device="cpu",
                            kv_cache_memory_fraction=fraction, max_num_batched_tokens=64, kv_sizing_record=record)
    return build_sized_runner(options, progress=False, free_bytes=free_bytes)


def test_a_second_start_reuses_the_first_starts_page_count(tiny_folder, tmp_path):
    record = tmp_path / "kv-sizing.json"
    runner, sizing = start(tiny_folder, record, free_bytes=8 * 2**30)
    per_block = bytes_per_block(runner.model_config, torch.float32, BLOCK_SIZE)
    first = sizing.num_blocks
    assert first >= 0.001 * (8 * 2**30 - 64 * MIB) // per_block  # the activation peak is far below 64 MiB
    assert json.loads(record.read_text())["num_blocks"] == first

    # half the memory free now: sized afresh it would get about half the pages; it gets the first count
    runner, sizing = start(tiny_folder, record, free_bytes=4 * 2**30)
    assert runner.num_blocks == sizing.num_blocks == first and sizing.kv_cache_bytes == first * per_block
    assert sizing.reason.startswith(f"{REUSED_SIZING}: {first} pages")
    assert json.loads(record.read_text())["num_blocks"] == first  # unchanged

    # another fraction is an explicit resize: sized afresh, and recorded for the next start
    runner, sizing = start(tiny_folder, record, free_bytes=4 * 2**30, fraction=0.0005)
    assert runner.num_blocks < first // 3 and not sizing.reason.startswith(REUSED_SIZING)
    assert json.loads(record.read_text())["num_blocks"] == runner.num_blocks


def test_without_a_record_each_start_sizes_from_the_memory_free_then(tiny_folder):
    first = start(tiny_folder, None, free_bytes=8 * 2**30)[1].num_blocks
    assert start(tiny_folder, None, free_bytes=4 * 2**30)[1].num_blocks < first * 0.6
