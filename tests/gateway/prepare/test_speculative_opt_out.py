"""The per-request opt-out of speculative decoding (issue 35): gRPC GenerateParameters.speculative and the
OpenAI body's `speculative` reach SamplingParams.speculative (unset: true), and through the internal proto to
the scheduler, which then never sends that request drafts."""
from __future__ import annotations

import pytest

from core.errors import InvalidArgument
from core.sampling import SamplingParams
from gateway.apis.openai.requests import parse_completion
from gateway.prepare.request_builder import prepare
from gateway.prepare.validation import ClientSampling, Limits, validate_sampling
from gateway.text.tokenizer import load_tokenizer
from protos import codec
from protos.tokenmill.v1 import generation_pb2
from scheduler.request import Request
from scheduler.speculation import NgramProposer, Speculation

LIMITS = Limits(max_model_len=2048, vocab_size=49152)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def test_grpc_and_openai_requests_can_opt_out(tokenizer):
    def grpc_params(**fields):
        message = generation_pb2.GenerateRequest(prompt="Hello", parameters=generation_pb2.GenerateParameters(**fields))
        return prepare(message, tokenizer, LIMITS, "m").request.sampling_params

    assert grpc_params().speculative and grpc_params(speculative=True).speculative
    assert not grpc_params(speculative=False).speculative

    def openai_params(**body):
        return parse_completion({"model": "m", "prompt": "Hello", **body}, tokenizer, LIMITS, "m",
                                "c").prepared.request.sampling_params

    assert openai_params().speculative and not openai_params(speculative=False).speculative
    with pytest.raises(InvalidArgument, match="speculative.*true or false"):
        openai_params(speculative="no")
    with pytest.raises(InvalidArgument, match="speculative"):
        validate_sampling(LIMITS, ClientSampling(speculative=0))


def test_the_opt_out_crosses_the_wire_and_stops_the_drafts():
    params = SamplingParams(temperature=0.0, speculative=False)
    wire = codec.sampling_params_to_proto(params)
    assert codec.sampling_params_from_proto(type(wire).FromString(wire.SerializeToString())) == params
    assert codec.sampling_params_from_proto(codec.sampling_params_to_proto(SamplingParams())).speculative
    speculation = Speculation(NgramProposer(), 4)
    repeating = [1, 2, 3, 4] * 4
    assert speculation.drafts(Request("a", repeating, SamplingParams(temperature=0.0)), 4) == [1, 2, 3, 4]
    assert speculation.drafts(Request("b", repeating, params), 4) == []
