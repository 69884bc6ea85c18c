"""worker.linears.packed: oneDNN-reordered weights give nn.Linear's results, the CPU runner uses them by
default (so the parity tests against transformers run through them), and the switch turns them off."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from core.step import CachedRequestData, NewRequestData, StepPlan
from core.sampling import SamplingParams
from tests.gpu.random_model import random_llama, tiny_config
from worker.paths.base import resolve_execution
from worker.options import WorkerOptions
from worker.linears.packed import PackedLinear, pack_linears
from worker.main import parse_args
from worker.model_runner import ModelRunner


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_linear_matches_nn_linear(bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 160)[:, 32:128]  # a strided view, as a slice of a fused projection is
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


def test_pack_linears_replaces_float32_linears_and_leaves_the_rest():
    config = tiny_config(num_layers=2)
    model = random_llama(config, torch.float32, "cpu")
    embedding = model.embed_tokens.weight
    assert pack_linears(model) == 2 * 4 + 1  # wqkv, wo, w_gate_up, w_down per layer + lm_head
    assert not any(isinstance(module, nn.Linear) for module in model.modules())
    assert model.embed_tokens.weight is embedding  # the lookup keeps its plain weight
    assert pack_linears(model) == 0  # idempotent
    assert pack_linears(random_llama(config, torch.bfloat16, "cpu")) == 0  # float32 only


def _greedy_tokens(options: WorkerOptions) -> tuple[ModelRunner, list[int]]:
    config = tiny_config(num_layers=2)
    runner = ModelRunner(random_llama(config, torch.float32, "cpu", seed=3), config, num_blocks=16, block_size=4,
                         dtype=torch.float32, options=options)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompt = list(range(3, 40, 3))
    request = NewRequestData("r", prompt, len(prompt), params, list(range(16)), 0)
    tokens = [runner.execute(StepPlan(1, [request], num_scheduled_tokens={"r": len(prompt)})).sampled_token_ids["r"]]
    for step in range(2, 12):
        cached = CachedRequestData("r", [], len(prompt) + len(tokens) - 1)
        tokens.append(runner.execute(StepPlan(step, cached_requests=[cached], num_scheduled_tokens={"r": 1})).sampled_token_ids["r"])
    return runner, tokens


def test_cpu_runner_packs_by_default_and_the_switch_turns_it_off():
    packed_runner, packed_tokens = _greedy_tokens(WorkerOptions())
    plain_runner, plain_tokens = _greedy_tokens(WorkerOptions(packed_linears=False))
    assert isinstance(packed_runner.model.lm_head, PackedLinear)
    assert isinstance(plain_runner.model.lm_head, nn.Linear)
    assert packed_tokens == plain_tokens


def test_packing_resolves_off_where_it_does_not_apply():
    assert resolve_execution(WorkerOptions(), "cpu").packed_linears
    assert not resolve_execution(WorkerOptions(), "cuda").packed_linears
    assert not resolve_execution(WorkerOptions(kernel_backend="triton"), "cpu").packed_linears
    # quantized linears are not nn.Linear: pack_linears leaves them and packs any float ones left
    assert resolve_execution(WorkerOptions(quantization="int8"), "cpu").packed_linears


def test_flag_reaches_the_worker_from_serve():
    from tokenmill.cli import build_parser
    from tokenmill.cluster.config import ClusterConfig
    from tokenmill.cluster.specs import cluster_specs

    assert parse_args(["--no-packed-linears"]) == WorkerOptions(packed_linears=False)
    serve = build_parser().parse_args(["serve", "--no-packed-linears"])
    assert serve.packed_linears is False
    config = ClusterConfig(redis_url="redis://127.0.0.1:1", http_port=None, worker=WorkerOptions(packed_linears=False))
    worker = next(spec for spec in cluster_specs(config) if spec.name == "worker")
    assert parse_args(list(worker.argv[3:])).packed_linears is False


def test_int8_activations_flag_reaches_the_worker_from_serve():
    from tokenmill.cli import build_parser
    from tokenmill.cluster.config import ClusterConfig
    from tokenmill.cluster.specs import cluster_specs

    assert parse_args(["--cpu-int8-activations"]) == WorkerOptions(cpu_int8_activations=True)
    assert build_parser().parse_args(["serve", "--cpu-int8-activations"]).cpu_int8_activations
    config = ClusterConfig(redis_url="redis://127.0.0.1:1", http_port=None, worker=WorkerOptions(cpu_int8_activations=True))
    worker = next(spec for spec in cluster_specs(config) if spec.name == "worker")
    assert parse_args(list(worker.argv[3:])).cpu_int8_activations is True
    assert resolve_execution(WorkerOptions(cpu_int8_activations=True), "cpu").cpu_int8_activations
    assert not resolve_execution(WorkerOptions(cpu_int8_activations=True), "cuda").cpu_int8_activations
