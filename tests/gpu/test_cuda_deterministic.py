"""CUDA only: --deterministic on the Triton path (worker.paths.triton.batch_invariant) where it matters, on real tile
shapes and tensor-core instructions. A request's greedy tokens and their logprobs, to the bit, are the same
run alone, in the middle of a batch, and recomputed after a preemption (prompt + the tokens generated so far
prefilled again in chunks beside another request), in float32 and bfloat16, with float, int8 and
group-quantized int4 linears; and a decode graph replayed over the mode's kernels equals the eager step (the
evidence that would let resolve_execution keep CUDA graphs on in the mode, which it turns off today).
Without the mode the same runs (float linears) print how many logprobs moved. Skipped without CUDA; tests/gpu/run.sh runs
tests/gpu on the device machine. The CPU-interpreted twin: tests/worker/paths/test_triton_batch_invariant.py."""
from __future__ import annotations

import pytest
import torch

from core.sampling import SamplingParams
from core.step import CachedRequestData, NewRequestData, StepPlan
from tests.gpu.random_model import random_llama
from worker.linears.group_quant import quantize_linears
from worker.linears.int8 import quantize_linears_int8
from worker.model.config import ModelConfig
from worker.model_runner import ModelRunner
from worker.options import WorkerOptions
from worker.paths.triton.batch_invariant import token_host_metadata
from worker.paths.triton.cuda_graphs import DecodeGraphs
from worker.paths.triton.forward import to_device, triton_forward
from worker.step_batch import RequestSpan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only paths; run by tests/gpu/run.sh")
CUDA = torch.device("cuda")
BLOCK_SIZE = 16
NUM_BLOCKS = 96
PARAMS = SamplingParams(temperature=0.0, logprobs=0, max_tokens=1024)
NUM_TOKENS = 16
QUANTIZE = {"float": lambda model: None, "int8": lambda model: quantize_linears_int8(model, use_kernel=True),
            "int4": lambda model: quantize_linears(model, 4)}


def small_config() -> ModelConfig:
    """Big enough for several K steps per tile, several key steps per token and a vocabulary of many column
    tiles; std 0.02 weights keep the logits close together, so a last-bit change would flip an argmax."""
    return ModelConfig(
        architecture="llama", vocab_size=4096, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8,
        num_kv_heads=2, head_dim=64, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attention_bias=False, max_position_embeddings=1024, bos_token_id=None, eos_token_id=None)


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 4096, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def drive(runner: ModelRunner, requests: dict[str, tuple[list[int], int]], chunk: int, num_tokens: int,
          ) -> dict[str, list[tuple[int, float]]]:
    """Every request in every step, in the given order: its token_ids prefilled `chunk` at a time, then one
    decode step per token until each has num_tokens; requests: id -> (token_ids, num_prompt_tokens).
    Returns each request's (token, logprob) in order. Pages: each request its own run of them."""
    tokens = {rid: list(ids) for rid, (ids, _) in requests.items()}
    computed = dict.fromkeys(requests, 0)
    sampled: dict[str, list[tuple[int, float]]] = {rid: [] for rid in requests}
    pages, next_page = {}, 1
    for rid, (ids, _) in requests.items():
        count = -(-(len(ids) + num_tokens) // BLOCK_SIZE)
        pages[rid], next_page = list(range(next_page, next_page + count)), next_page + count
    step = 0
    while any(len(out) < num_tokens for out in sampled.values()):
        step += 1
        scheduled = {rid: min(chunk, len(tokens[rid]) - computed[rid]) for rid in requests
                     if len(sampled[rid]) < num_tokens}
        new = [NewRequestData(rid, tokens[rid], requests[rid][1], PARAMS, pages[rid], 0)
               for rid in scheduled if step == 1]
        cached = [CachedRequestData(rid, [], computed[rid]) for rid in scheduled if step > 1]
        out = runner.execute(StepPlan(step, new, cached, scheduled))
        for rid, count in scheduled.items():
            computed[rid] += count
            if rid in out.sampled_token_ids:
                token = out.sampled_token_ids[rid]
                sampled[rid].append((token, out.logprobs[rid].logprob))
                tokens[rid].append(token)
    return sampled


def runner_for(model, config, dtype, deterministic: bool) -> ModelRunner:
    return ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype=dtype,
                       options=WorkerOptions(deterministic=deterministic, graph_batch_sizes=(1, 2, 4)))


def alone_batched_recomputed(model, config, dtype, deterministic: bool):
    a, b, c = prompt(1, 150), prompt(2, 37), prompt(3, 90)
    alone = drive(runner_for(model, config, dtype, deterministic), {"a": (a, len(a))}, 512, NUM_TOKENS)["a"]
    batched = drive(runner_for(model, config, dtype, deterministic), {"b": (b, len(b)), "a": (a, len(a)),
                                                                     "c": (c, len(c))}, 512, NUM_TOKENS)["a"]
    done = 6  # preempted after 6 tokens: prompt + those 6 prefilled again, in chunks of 48, beside b
    again = a + [token for token, _ in alone[:done]]
    recomputed = drive(runner_for(model, config, dtype, deterministic), {"b": (b, len(b)), "a": (again, len(a))},
                       48, NUM_TOKENS - done)["a"]
    return alone, batched, alone[:done] + recomputed


@pytest.mark.parametrize("weights", QUANTIZE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_output_is_identical_alone_batched_and_recomputed(dtype, weights):
    config = small_config()
    model = random_llama(config, dtype, CUDA, seed=5)
    QUANTIZE[weights](model)
    alone, batched, recomputed = alone_batched_recomputed(model, config, dtype, True)
    assert batched == alone, "tokens and logprobs (exact floats), batched vs alone"
    assert recomputed == alone, "prompt + generated tokens recomputed in chunks vs alone"
    if weights != "float":
        return  # the default mode's drift, printed once per dtype: run.sh gives tests/gpu 150 s in all
    default = alone_batched_recomputed(model, config, dtype, False)
    moved = sum(x != y for x, y in zip(default[0], default[1])) + sum(x != y for x, y in zip(default[0], default[2]))
    print(f"without --deterministic ({dtype}, {weights} linears): {moved} of {2 * NUM_TOKENS} (token, logprob) "
          "pairs differ from the request's run alone")


def test_a_decode_graph_over_the_modes_kernels_replays_the_eager_step():
    config = small_config()
    model = random_llama(config, torch.bfloat16, CUDA, seed=6)
    runner = runner_for(model, config, torch.bfloat16, True)
    path = runner.execution_path
    assert path.graphs is None, "resolve_execution keeps graphs off in the mode"
    graphs = DecodeGraphs(model, runner.kv_cache, path.kernels, (1, 2, 4), 8, CUDA)
    graphs.capture()
    spans = [RequestSpan(0, 1, 70, [3, 5, 9, 11, 12]), RequestSpan(1, 1, 20, [7, 8]), RequestSpan(2, 1, 33, [20, 21, 22])]
    metadata = to_device(token_host_metadata(spans, BLOCK_SIZE), CUDA)
    ids = torch.tensor([5, 9, 200], device=CUDA)
    positions = torch.tensor([69, 19, 32], device=CUDA)
    with torch.inference_mode():
        eager = model.compute_logits(triton_forward(model, ids, positions, runner.kv_cache, metadata, path.kernels))
        replayed = graphs.replay(ids, positions, metadata).clone()  # bucket 4: one padding row
    assert torch.equal(replayed, eager)
