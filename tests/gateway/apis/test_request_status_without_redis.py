"""GetRequestStatus and CancelRequest while Redis does not answer: UNAVAILABLE saying so, not INTERNAL."""
from __future__ import annotations

import pytest

from core.errors import Unavailable
from gateway.apis.generation import GenerationServicer
from gateway.apis.served_model import ServedModel
from gateway.generation.generations import Generations
from gateway.prepare.validation import Limits
from kvstore.state_reader import RequestStateReader
from plumbing.rpc import status_for
from protos.tokenmill.v1 import common_pb2, generation_pb2
from tokenmill.cluster.readiness import free_port


async def test_status_while_redis_is_away_is_unavailable_not_internal():
    # a real client of a port nothing listens on: the connection is refused, as when Redis was killed
    reader = RequestStateReader(f"redis://127.0.0.1:{free_port()}", socket_timeout_s=0.5)
    model = ServedModel(Generations(None, None, records=reader), common_pb2.GetModelInfoResponse(), Limits())
    servicer = GenerationServicer(model)
    try:
        with pytest.raises(Unavailable, match="while Redis does not answer") as caught:
            await servicer.GetRequestStatus(generation_pb2.GetRequestStatusRequest(request_id="r1"), None)
        assert status_for(caught.value)[0].name == "UNAVAILABLE"
    finally:
        await reader.aclose()
