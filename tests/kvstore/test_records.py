from core.outputs import FinishReason
from dataclasses import fields

import pytest

from kvstore.records import FIELD_TYPES, RecordStatus, RequestRecord, encode_field, record_key
from tests.kvstore.conftest import timed_record


def test_mapping_round_trip_keeps_every_field_exactly():
    record = timed_record("req-1", RecordStatus.FINISHED, finished_at=1_700_000_001.0,
                          finish_reason=FinishReason.LENGTH)
    mapping = record.to_mapping()
    assert "error" not in mapping  # None is absent, not the string "None"
    as_bytes = {k.encode(): v.encode() for k, v in mapping.items()}  # HGETALL without decoding
    assert RequestRecord.from_mapping(as_bytes) == record
    assert RequestRecord.from_mapping(mapping) == record


def test_field_types_cover_every_settable_record_field():
    counted_by_server = {"request_id", "status", "num_preemptions"}
    assert {f.name for f in fields(RequestRecord)} == set(FIELD_TYPES) | counted_by_server


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("num_output_tokens", "3", "must be an int"),
        ("num_output_tokens", True, "must be an int"),
        ("finished_at", "soon", "unix seconds"),
        ("num_preemptions", 1, "unknown record field 'num_preemptions'"),
    ],
)
def test_encode_field_names_field_and_value(name, value, message):
    with pytest.raises(ValueError, match=message):
        encode_field(name, value)


def test_from_mapping_names_missing_status():
    with pytest.raises(ValueError, match="missing field 'status'"):
        RequestRecord.from_mapping({"request_id": "x"})


def test_key_layout():
    assert record_key("abc") == "tokenmill:req:abc"
