"""Speculative decoding through real processes (issue 35): gateway -> scheduler -> worker on a tiny random
model, once without, once with `--speculative ngram` and once with `--speculative draft` (the model as its own draft). Greedy outputs (plain, streamed, with a stop string,
n > 1, with logprobs, opted out, sharing a prefix) and seeded ones at temperature 0.8 are identical, and the
scheduler's /metrics counts accepted draft tokens."""
from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from tests.helpers.tiny_models import make_tiny_hf_model
from tokenmill.cluster.config import ClusterConfig, resolve_ports, with_settings
from tokenmill.cluster.specs import cluster_specs
from tokenmill.cluster.supervisor import Supervisor

pytestmark = pytest.mark.slow

# prompts that repeat themselves (prompt lookup finds its drafts there) and one that does not
PROMPTS = ["one two three four five " * 6, "the cat sat on the mat; " * 5 + "the cat", "abc abd abe abf " * 4,
           "Write something new."]


def request(prompt: str, max_tokens: int = 40, **params) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=prompt, parameters=generation_pb2.GenerateParameters(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params))


async def outputs(address: str, seeded: bool = False) -> dict[str, object]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        plain = await asyncio.gather(*(stub.Generate(request(prompt)) for prompt in PROMPTS))
        streamed = []
        async for message in stub.GenerateStream(request(PROMPTS[0], 48)):
            streamed.extend(message.token_ids)
        samples = await stub.Generate(request(PROMPTS[1], 24, n=2))
        # a stop string the greedy text reaches: nothing past it, with or without drafts
        stop_text = plain[0].text[len(plain[0].text) // 2:][:6]
        stopped = await stub.Generate(request(PROMPTS[0], 40, stop=[stop_text]))
        with_logprobs = await stub.Generate(request(PROMPTS[2], 24, logprobs=2))
        opted_out = await stub.Generate(request(PROMPTS[1], 24, speculative=False))
        # seeded requests at temperature 0.8, one with n=2 (sample i draws from seed + i): their own draws, drafts
        # or not (a draft is accepted when it is the draw)
        seeded_replies = await asyncio.gather(*(stub.Generate(generation_pb2.GenerateRequest(
            prompt=prompt, parameters=generation_pb2.GenerateParameters(max_tokens=32, temperature=0.8, seed=2024,
                                                                         ignore_eos=True, n=n)))
            for prompt, n in ((PROMPTS[0], 1), (PROMPTS[2], 2)))) if seeded else []
    return {"plain": [list(reply.token_ids) for reply in plain], "texts": [reply.text for reply in plain],
            "streamed": streamed, "samples": [choice.text for choice in samples.choices],
            "stopped": (stopped.text, stopped.finish_reason, stop_text),
            "logprobs": [(entry.token_id, entry.logprob, [top.token_id for top in entry.top_logprobs])
                         for entry in with_logprobs.logprobs],
            "opted_out": list(opted_out.token_ids),
            "seeded": [[reply.text, *(choice.text for choice in reply.choices)] for reply in seeded_replies]}


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if "spec_decode" in sample.name and sample.labels.get("position") in (None, "0")}


def run_cluster(folder, seeded: bool = False, **settings) -> tuple[dict[str, object], dict[str, float]]:
    config = resolve_ports(with_settings(
        ClusterConfig(), gateway_port=0, scheduler_port=0, worker_port=0, redis_port=0, scheduler_metrics_port=0,
        model=str(folder), block_size=4, num_blocks=256, max_num_batched_tokens=256, **settings))
    with Supervisor(cluster_specs(config), echo=False, startup_timeout_s=300):
        results = asyncio.run(outputs(config.gateway_address, seeded))
        return results, scrape(config.scheduler_metrics_port)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("speculative"), "llama")[0]


def test_greedy_output_is_identical_and_drafts_are_accepted(tiny_model):
    plain, plain_metrics = run_cluster(tiny_model, seeded=True)
    speculative, metrics = run_cluster(tiny_model, seeded=True, speculative="ngram", num_speculative_tokens=4)
    assert len(plain["seeded"]) == 2 and len(set(plain["seeded"][1][1:])) == 2  # two samples that differ
    logprobs, plain_logprobs = speculative.pop("logprobs"), plain.pop("logprobs")
    assert speculative == plain
    assert [(token, top) for token, _, top in logprobs] == [(token, top) for token, _, top in plain_logprobs]
    assert all(abs(got - want) < 1e-4 for (_, got, _), (_, want, _) in zip(logprobs, plain_logprobs))
    assert all(len(tokens) == 40 for tokens in plain["plain"]) and len(plain["streamed"]) == 48
    assert len(plain_logprobs) == 24 and plain["opted_out"] == plain["plain"][1][:24]
    text, _, stop_text = plain["stopped"]
    assert stop_text and stop_text not in text  # the stop string ended it (and is not part of the text)
    assert plain_metrics["vllm:spec_decode_num_draft_tokens_total"] == 0
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] > 0
    assert metrics["tokenmill:spec_decode_num_accepted_tokens_total"] == metrics["vllm:spec_decode_num_accepted_tokens_total"]
    assert metrics["vllm:spec_decode_num_draft_tokens_total"] >= metrics["vllm:spec_decode_num_accepted_tokens_total"]
    assert metrics["vllm:spec_decode_num_accepted_tokens_per_pos_total"] > 0  # position 0


def test_a_draft_model_keeps_greedy_output_and_its_guesses_are_accepted(tiny_model):
    """--speculative draft --draft-model (the target as its own draft: every guess the target's own argmax), through
    gateway, scheduler and worker: the same outputs as without speculation, and the metrics count its guesses."""
    plain, _ = run_cluster(tiny_model)
    drafted, metrics = run_cluster(tiny_model, speculative="draft", draft_model=str(tiny_model), num_speculative_tokens=4)
    logprobs, plain_logprobs = drafted.pop("logprobs"), plain.pop("logprobs")
    assert drafted == plain
    assert [(token, top) for token, _, top in logprobs] == [(token, top) for token, _, top in plain_logprobs]
    accepted, drafts = (metrics[f"vllm:spec_decode_num_{name}_tokens_total"] for name in ("accepted", "draft"))
    assert drafts > 100 and accepted > 0.9 * drafts  # a request with a stop string may end amid accepted guesses
    assert metrics["vllm:spec_decode_num_accepted_tokens_per_pos_total"] > 0
