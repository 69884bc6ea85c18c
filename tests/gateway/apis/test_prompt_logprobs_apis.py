"""Prompt logprobs through a real cluster (redis-server, worker, scheduler, gateway processes) on a tiny
random-weight model: OpenAI completions echo=true with logprobs=k (the unmodified openai client, whole and
streamed) and tokenmill.v1 GenerateParameters.prompt_logprobs over gRPC equal a direct float32 forward's
log_softmax at the prompt positions, across prefill chunks (a 16-token step budget) and after the same
prompt filled the prefix cache."""
from __future__ import annotations

import grpc
import openai
import pytest
import torch

from protos.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from tests.helpers.tiny_models import make_tiny_hf_model
from tokenmill.cluster.config import ClusterConfig, resolve_ports, with_settings
from tokenmill.cluster.specs import cluster_specs
from tokenmill.cluster.supervisor import Supervisor

pytestmark = pytest.mark.slow

TOLERANCE = 2e-4  # float32 worker vs transformers eager, both float32
TEXT = "a b c d e f g h i j k l m n o p q r s t u v"
PROMPT = [(7 * j + 2) % 120 + 3 for j in range(40)]  # three prefill chunks under a 16-token budget


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder, model = make_tiny_hf_model(tmp_path_factory.mktemp("prompt-logprobs-model"))
    config = resolve_ports(with_settings(ClusterConfig(),
        model=str(folder), gateway_port=0, http_port=0, scheduler_port=0, worker_port=0, redis_port=0,
        num_blocks=64, max_num_batched_tokens=16))
    with Supervisor(cluster_specs(config), echo=False, startup_timeout_s=300):
        yield config, model


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster[0].http_address}/v1", api_key="x", max_retries=0, timeout=120)


def reference(model, prompt: list[int]) -> torch.Tensor:
    """[P, V]: log_softmax of a direct float32 forward, row i predicting token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def complete(client, **extra):
    model = client.models.list().data[0].id
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, **extra)


def check_echo_logprobs(logprobs, model, num_output: int) -> None:
    expected = reference(model, PROMPT)
    num_prompt = len(PROMPT)
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == num_prompt + num_output
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # the first has none
    for position in range(1, num_prompt):
        row = expected[position - 1]
        assert logprobs.token_logprobs[position] == pytest.approx(row[PROMPT[position]].item(), abs=TOLERANCE)
        # token text -> logprob; two byte tokens can share a text ("\ufffd"), so one may hide the other
        best = row.topk(len(logprobs.top_logprobs[1])).values.tolist()
        for value in logprobs.top_logprobs[position].values():
            assert min(abs(value - want) for want in best) < TOLERANCE
    assert all(value is not None for value in logprobs.token_logprobs[num_prompt:])  # the completion's own
    lengths = [len(token) for token in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]  # from the echo's start


def test_completions_echo_logprobs_equal_direct_forward(cluster, client):
    _, model = cluster
    whole = complete(client, echo=True, logprobs=2)
    assert all(len(top) == 2 for top in whole.choices[0].logprobs.top_logprobs[1:4])
    choice = whole.choices[0]
    plain = complete(client).choices[0]
    assert choice.text.endswith(plain.text)
    check_echo_logprobs(choice.logprobs, model, whole.usage.completion_tokens)
    assert "".join(choice.logprobs.tokens) == choice.text

    chunks = [chunk.choices[0] for chunk in complete(client, echo=True, logprobs=2, stream=True) if chunk.choices]
    streamed = [value for chunk in chunks if chunk.logprobs for value in chunk.logprobs.token_logprobs]
    assert streamed == choice.logprobs.token_logprobs
    assert "".join(chunk.text for chunk in chunks) == choice.text


def test_echo_logprobs_after_a_prefix_cache_hit(cluster, client):
    _, model = cluster
    complete(client)
    warm = complete(client)
    assert warm.usage.prompt_tokens_details.cached_tokens == 32  # two full 16-token pages to hit
    echoed = complete(client, echo=True, logprobs=0)
    assert echoed.usage.prompt_tokens_details.cached_tokens == 0  # prompt logprobs read no cached page
    check_echo_logprobs(echoed.choices[0].logprobs, model, echoed.usage.completion_tokens)
    assert echoed.choices[0].text.endswith(warm.choices[0].text)
    assert complete(client).usage.prompt_tokens_details.cached_tokens == 32  # the others still hit


def test_grpc_prompt_logprobs_equal_direct_forward(cluster):
    config, model = cluster
    with grpc.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        prompt_ids = list(stub.Tokenize(generation_pb2.TokenizeRequest(text=TEXT, add_special_tokens=True)).token_ids)
        parameters = generation_pb2.GenerateParameters(max_tokens=2, temperature=0.0, prompt_logprobs=1)
        request = generation_pb2.GenerateRequest(prompt=TEXT, parameters=parameters)
        response = stub.Generate(request, timeout=120)
        streamed = list(stub.GenerateStream(request, timeout=120))
    expected = reference(model, prompt_ids)
    assert len(prompt_ids) > 16  # chunked
    assert [entry.token_id for entry in response.prompt_logprobs] == prompt_ids[1:]
    for position, entry in enumerate(response.prompt_logprobs, start=1):
        assert entry.logprob == pytest.approx(expected[position - 1, prompt_ids[position]].item(), abs=TOLERANCE)
        assert entry.top_logprobs[0].token_id == expected[position - 1].argmax().item()
    assert [len(message.prompt_logprobs) for message in streamed if message.prompt_logprobs] == [len(prompt_ids) - 1]
    assert not list(response.logprobs)  # prompt logprobs alone: no logprobs of the generated tokens
