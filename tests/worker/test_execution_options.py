"""worker.options and its resolution: what each flag resolves to on CPU and on a CUDA device, the graph
buckets, and that the CPU runner never builds a CUDA-only part. The CUDA paths themselves run in tests/gpu (device script)."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.random_model import random_llama, tiny_config
from worker.main import parse_args
from worker.model_runner import ModelRunner
from worker.options import DEFAULT_GRAPH_BATCH_SIZES, WorkerOptions, parse_batch_sizes
from worker.paths.base import resolve_execution
from worker.paths.torch_path import TorchPath
from worker.paths.triton.cuda_graphs import graph_bucket


def test_auto_is_triton_on_cuda_and_torch_on_cpu():
    cpu = resolve_execution(WorkerOptions(), "cpu")
    assert (cpu.kernel_backend, cpu.cuda_graphs, cpu.stream_overlap) == ("torch", False, False)
    cuda = resolve_execution(WorkerOptions(), torch.device("cuda", 0))  # resolving touches no device
    assert (cuda.kernel_backend, cuda.cuda_graphs, cuda.stream_overlap) == ("triton", True, True)


def test_graphs_need_cuda_and_the_triton_backend():
    assert not resolve_execution(WorkerOptions(kernel_backend="triton"), "cpu").cuda_graphs
    assert not resolve_execution(WorkerOptions(kernel_backend="torch"), "cuda").cuda_graphs
    off = resolve_execution(WorkerOptions(cuda_graphs=False, stream_overlap=False), "cuda")
    assert (off.kernel_backend, off.cuda_graphs, off.stream_overlap) == ("triton", False, False)


def test_graph_bucket_is_the_smallest_that_fits():
    assert [graph_bucket(b, DEFAULT_GRAPH_BATCH_SIZES) for b in (1, 3, 16, 17, 200, 256)] == [1, 4, 16, 32, 256, 256]
    assert graph_bucket(257, DEFAULT_GRAPH_BATCH_SIZES) is None
    assert parse_batch_sizes("8, 1,4") == (1, 4, 8)


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match="kernel_backend='cuda' is not one of"):
        WorkerOptions(kernel_backend="cuda")
    with pytest.raises(ValueError, match="quantization='int3'"):
        WorkerOptions(quantization="int3")
    with pytest.raises(ValueError, match="graph_batch_sizes=\\(0, 2\\)"):
        WorkerOptions(graph_batch_sizes=(0, 2))
    with pytest.raises(ValueError, match="comma-separated integers"):
        parse_batch_sizes("1,two")


def test_worker_flags_build_the_options():
    args = parse_args(["--kernel-backend", "triton", "--quantization", "int8", "--no-cuda-graphs",
                       "--cuda-graph-batch-sizes", "1,2,8"])
    assert args == WorkerOptions(kernel_backend="triton", quantization="int8", cuda_graphs=False,
                                              stream_overlap=True, graph_batch_sizes=(1, 2, 8))
    assert parse_args([]) == WorkerOptions()
    with pytest.raises(SystemExit):
        parse_args(["--cuda-graph-batch-sizes", "0"])


def test_cpu_runner_takes_the_torch_path_and_builds_nothing_cuda():
    config = tiny_config(num_layers=1)
    runner = ModelRunner(random_llama(config, torch.float32, "cpu"), config, num_blocks=4, block_size=4,
                         dtype=torch.float32)
    assert runner.execution.kernel_backend == "torch" and type(runner.execution_path) is TorchPath
    runner.warm_up()


def test_serve_flags_reach_the_worker_command_line():
    from tokenmill.cli import build_parser
    from tokenmill.cluster.config import ClusterConfig
    from tokenmill.cluster.specs import cluster_specs

    serve = build_parser().parse_args(["serve", "--kernel-backend", "torch", "--quantization", "int8",
                                       "--no-cuda-graphs", "--no-stream-overlap", "--device", "cpu"])
    assert (serve.kernel_backend, serve.quantization, serve.cuda_graphs, serve.stream_overlap) == ("torch", "int8", False, False)
    config = ClusterConfig(redis_url="redis://127.0.0.1:1", http_port=None, worker=WorkerOptions(
        device="cpu", kernel_backend="torch", quantization="int8", cuda_graphs=False, stream_overlap=False))
    worker = next(spec for spec in cluster_specs(config) if spec.name == "worker")
    args = parse_args(list(worker.argv[3:]))  # past "python -m worker.main"
    assert args.device == "cpu"
    assert (args.kernel_backend, args.quantization, args.cuda_graphs, args.stream_overlap) == ("torch", "int8", False, False)


def test_fused_cpu_ops_are_the_cpu_default_and_the_reference_one_flag_away():
    from tokenmill.cli import build_parser
    from tokenmill.cluster.config import ClusterConfig
    from tokenmill.cluster.specs import cluster_specs

    assert resolve_execution(WorkerOptions(), "cpu").cpu_fused_ops
    assert not resolve_execution(WorkerOptions(), "cuda").cpu_fused_ops  # the Triton path has its own kernels
    assert not resolve_execution(WorkerOptions(kernel_backend="triton"), "cpu").cpu_fused_ops
    assert parse_args([]).cpu_fused_ops and not parse_args(["--no-cpu-fused-ops"]).cpu_fused_ops
    serve = build_parser().parse_args(["serve", "--no-cpu-fused-ops"])
    assert serve.cpu_fused_ops is False
    for fused in (True, False):
        worker = next(spec for spec in cluster_specs(ClusterConfig(redis_url="redis://127.0.0.1:1", http_port=None,
                                                                   worker=WorkerOptions(cpu_fused_ops=fused))) if spec.name == "worker")
        assert parse_args(list(worker.argv[3:])).cpu_fused_ops == fused


def test_cpu_dense_weights_flag_is_auto_by_default_and_reaches_the_worker():
    from tokenmill import cli
    from tokenmill.cluster.config import ClusterConfig
    from tokenmill.cluster.specs import cluster_specs
    from worker.options import DENSE_WEIGHT_MODES

    assert resolve_execution(WorkerOptions(), "cpu").cpu_dense_weights == "auto"
    assert resolve_execution(WorkerOptions(cpu_dense_weights="on"), "cuda").cpu_dense_weights == "off"
    assert resolve_execution(WorkerOptions(cpu_dense_weights="on", kernel_backend="triton"),
                             "cpu").cpu_dense_weights == "off"
    with pytest.raises(ValueError, match="cpu_dense_weights='bf16' is not one of"):
        WorkerOptions(cpu_dense_weights="bf16")
    assert cli.build_parser().parse_args(["serve", "--cpu-dense-weights", "off"]).cpu_dense_weights == "off"
    for mode in DENSE_WEIGHT_MODES:
        worker = next(spec for spec in cluster_specs(ClusterConfig(redis_url="redis://127.0.0.1:1", http_port=None,
                                                                   worker=WorkerOptions(cpu_dense_weights=mode))) if spec.name == "worker")
        assert parse_args(list(worker.argv[3:])).cpu_dense_weights == mode
