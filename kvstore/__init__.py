"""The Redis layer: request state records (see kvstore.records), written off the hot path."""
from kvstore.records import RecordStatus, RequestRecord
from kvstore.state_reader import RequestStateReader
from kvstore.state_writer import RequestStateWriter, WriterStats

__all__ = ["RecordStatus", "RequestRecord", "RequestStateReader", "RequestStateWriter", "WriterStats"]
