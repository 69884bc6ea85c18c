"""The CUDA-only paths: decode graphs, pinned staging on a copy stream, the async token readback and the
INT8 and group-quantized (int4 / GGUF formats) kernels inside a model. Skipped without CUDA;
tests/gpu/run.sh runs them on the device machine."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.gpu.random_model import random_llama, tiny_config
from tests.gpu.steps import BLOCK_SIZE, NUM_BLOCKS, PLAIN_GREEDY, assert_same_steps, run_mixed_steps
from worker.linears.group_quant import GroupQuantLinear, quantize_weight
from worker.options import WorkerOptions
from worker.step_batch import RequestSpan, StepBatch
from tokenmill.bench.int8_agreement import window_logits
from worker.linears.int8 import quantize_linears_int8
from worker.model_runner import ModelRunner
from worker.paths.triton.forward import host_metadata, to_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only paths; run by tests/gpu/run.sh")
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def model_and_config():
    config = tiny_config(num_layers=2)
    return random_llama(config, torch.float32, CUDA, seed=3, std=0.2), config


def runner_with(model, config, **options) -> ModelRunner:
    runner = ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype=torch.float32,
                         options=WorkerOptions(graph_batch_sizes=(1, 2, 4), **options))
    runner.warm_up()
    return runner


@pytest.mark.parametrize("cuda_graphs, stream_overlap", [(True, True), (True, False), (False, True), (False, False)])
def test_triton_runner_on_cuda_matches_torch_backend(model_and_config, cuda_graphs, stream_overlap):
    model, config = model_and_config
    triton = runner_with(model, config, cuda_graphs=cuda_graphs, stream_overlap=stream_overlap)
    assert (triton.execution.kernel_backend, triton.execution.cuda_graphs, triton.execution.stream_overlap) == (
        "triton", cuda_graphs, stream_overlap)
    reference = runner_with(model, config, kernel_backend="torch")
    assert_same_steps(run_mixed_steps(reference), run_mixed_steps(triton), logprob_atol=5e-3)
    # plain greedy rows take the argmax + pinned readback path when overlap is on
    assert_same_steps(run_mixed_steps(runner_with(model, config, kernel_backend="torch"), PLAIN_GREEDY),
                      run_mixed_steps(runner_with(model, config, cuda_graphs=cuda_graphs, stream_overlap=stream_overlap),
                                      PLAIN_GREEDY), logprob_atol=0)


def test_graph_replay_pads_to_the_bucket_and_matches_eager(model_and_config):
    model, config = model_and_config
    graphs_runner = runner_with(model, config, cuda_graphs=True)
    graphs = graphs_runner.execution_path.graphs
    assert sorted(graphs.graphs) == [1, 2, 4] and graphs.bucket_for(3, 2) == 4 and graphs.bucket_for(5, 2) is None
    spans = [RequestSpan(0, 1, 6, [3, 5]), RequestSpan(1, 1, 3, [7]), RequestSpan(2, 1, 8, [9, 10])]
    host = host_metadata(spans, BLOCK_SIZE)
    ids = torch.tensor([5, 9, 200], device=CUDA)
    positions = torch.tensor([5, 2, 7], device=CUDA)
    with torch.inference_mode():
        replayed = graphs.replay(ids, positions, to_device(host, CUDA)).clone()  # bucket 4, one padded row
        eager_runner = runner_with(model, config, cuda_graphs=False)
        eager_runner.kv_cache.storage.copy_(graphs_runner.kv_cache.storage)
        batch = StepBatch(0, ids.tolist(), positions.tolist(), spans, sample_rows=[0, 1, 2])
        eager = eager_runner.execution_path.forward(batch, eager_runner.execution_path.prepare(batch))
    torch.testing.assert_close(replayed, eager, atol=1e-3, rtol=1e-3)
    assert int((graphs.slot_mapping[3:4] == -1).sum()) == 1  # the padded row wrote nothing


def test_staging_rotates_slots_and_grows():
    from worker.paths.triton.staging import NUM_SLOTS, StepStager

    stager = StepStager(CUDA, initial_capacity=8)  # tiny buffers: the big step must grow one
    for num_rows in (1, 3, 40, 2, 5):
        spans = [RequestSpan(r, 1, 4 * r + 1, list(range(1, r + 2))) for r in range(num_rows)]
        host = host_metadata(spans, BLOCK_SIZE)
        ids, positions = list(range(num_rows)), [4 * r for r in range(num_rows)]
        rows, sources = list(range(0, num_rows, 2)), [7 * r for r in range(0, num_rows, 2)]
        staged = stager.stage(ids, positions, host, rows, sources)
        staged_ids, staged_positions, metadata, staged_rows, staged_sources = stager.take(staged)
        expected = to_device(host, CUDA)
        stager.mark_consumed(staged)
        assert staged_ids.tolist() == ids and staged_positions.tolist() == positions
        assert staged_rows.tolist() == rows and staged_sources.tolist() == sources
        for name in ("slot_mapping", "block_tables", "query_start_loc", "context_lens"):
            assert torch.equal(getattr(metadata, name), getattr(expected, name)), name
    assert len(stager.slots) == NUM_SLOTS and max(slot.capacity for slot in stager.slots) >= 40 * 40


def test_token_readback_returns_the_ids(model_and_config):
    model, config = model_and_config
    readback = runner_with(model, config, stream_overlap=True).execution_path.readback
    for count in (3, 2000):  # the second grows the pinned buffer
        tokens = torch.arange(count, device=CUDA) * 7
        readback.start(tokens)
        assert readback.finish() == tokens.tolist()


def test_int8_kernel_model_matches_the_torch_int8_path(model_and_config):
    model, config = model_and_config
    with_kernel, with_torch = copy.deepcopy(model), copy.deepcopy(model)
    quantize_linears_int8(with_kernel, use_kernel=True)
    quantize_linears_int8(with_torch, use_kernel=False)
    token_ids = list(range(1, 60))
    expected = window_logits(with_torch, config, token_ids, torch.float32, CUDA)
    actual = window_logits(with_kernel, config, token_ids, torch.float32, CUDA)
    torch.testing.assert_close(actual, expected, atol=2e-3, rtol=2e-3)


# every container / group size the GGUF formats load into: Q4_0/Q4_1/Q4_K/int4 (4, 32), Q8_0/Q5_K/int8 (8, 32), Q6_K (8, 16)
MIXED_LAYOUTS = {"wqkv": (4, 32), "wo": (8, 32), "w_gate_up": (4, 32), "w_down": (8, 16), "lm_head": (8, 32)}


def quantize_mixed(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose linears are group-quantized (on the model's device), a layout per kind of linear."""
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                bits, group_size = MIXED_LAYOUTS[name]
                bias = None if child.bias is None else child.bias.detach().float()
                setattr(parent, name, GroupQuantLinear(quantize_weight(child.weight, bits, group_size), bias))
    return model


# float32: summation order only. bfloat16: every linear's output is rounded, and two random layers carry that
# on; under the interpreter (which casts to bfloat16 by truncation) the kernel's model was 0.036 of the
# logits' largest magnitude from the CPU op's. A wrong nibble or a dropped min moves them by O(1).
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-3), (torch.bfloat16, 0.08)])
def test_group_quant_kernel_model_matches_the_cpu_path(dtype, tolerance):
    config = tiny_config(num_layers=2)
    quantized = quantize_mixed(random_llama(config, dtype, CUDA, seed=4, std=0.2))
    assert {(m.bits, m.group_size) for m in quantized.modules() if isinstance(m, GroupQuantLinear)} == {
        (4, 32), (8, 32), (8, 16)}
    on_cpu = copy.deepcopy(quantized).to("cpu")  # the compiled CPU op, or torch's dequantize where it is not built
    token_ids = list(range(1, 60))
    with torch.inference_mode():
        expected = window_logits(on_cpu, config, token_ids, dtype, torch.device("cpu"))
        actual = window_logits(quantized, config, token_ids, dtype, CUDA)
    error = (actual.cpu().float() - expected.float()).abs().max().item()
    assert error <= tolerance * expected.float().abs().max().item(), error


def dequantized_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose group-quantized linears are float nn.Linear on the weights they stand for."""
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, GroupQuantLinear):
                linear = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                         device=child.codes.device)
                with torch.no_grad():
                    linear.weight.copy_(child.weight_view().dequantize())
                    if child.bias is not None:
                        linear.bias.copy_(child.bias)
                setattr(parent, name, linear)
    return model


def test_group_quant_kernel_runs_in_the_triton_runner_and_its_graphs(model_and_config):
    model, config = model_and_config
    quantized = quantize_mixed(model)
    reference = runner_with(dequantized_twin(quantized), config, kernel_backend="torch")  # float weights, torch ops
    assert_same_steps(run_mixed_steps(reference), run_mixed_steps(runner_with(quantized, config, cuda_graphs=True)),
                      logprob_atol=5e-3)


def test_seeded_sampling_is_the_same_with_and_without_graphs(model_and_config):
    from core.sampling import SamplingParams

    model, config = model_and_config
    seeded = SamplingParams(temperature=1.3, top_k=50, top_p=0.95, seed=99, max_tokens=64)
    with_graphs = run_mixed_steps(runner_with(model, config, cuda_graphs=True), seeded)
    without = run_mixed_steps(runner_with(model, config, cuda_graphs=False, stream_overlap=False), seeded)
    assert_same_steps(without, with_graphs, logprob_atol=0)
