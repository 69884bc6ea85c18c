"""The tensor-parallel flags: what a rank's options refuse, what the execution resolves to, and the in-process
engine's refusal (it has no other ranks to drive)."""
from __future__ import annotations

import pytest

from worker.build import build_sized_runner
from worker.options import WorkerOptions
from worker.paths.base import resolve_execution


def test_a_rank_outside_its_group_or_without_a_rendezvous_is_refused():
    with pytest.raises(ValueError, match=r"rank=2 is outside a worker group of 2 ranks"):
        WorkerOptions(tensor_parallel_size=2, rank=2)
    with pytest.raises(ValueError, match="needs --rendezvous"):
        WorkerOptions(tensor_parallel_size=2, rank=1)
    follower = WorkerOptions(tensor_parallel_size=2, rank=1, rendezvous="tcp://127.0.0.1:1")
    assert WorkerOptions.from_args(WorkerOptions.service_parser("w", "").parse_args(follower.to_argv())) == follower


def test_a_split_model_runs_without_the_compiled_whole_layer_ops_and_triton_without_graphs():
    resolved = resolve_execution(WorkerOptions(tensor_parallel_size=2), "cpu")
    assert (resolved.kernel_backend, resolved.cpu_fused_ops) == ("torch", False)
    assert resolve_execution(WorkerOptions(), "cpu").cpu_fused_ops  # one rank keeps them
    on_triton = resolve_execution(WorkerOptions(tensor_parallel_size=2, kernel_backend="triton"), "cpu")
    assert on_triton.kernel_backend == "triton" and not on_triton.cuda_graphs  # the forward all-reduces: no graph yet
    with pytest.raises(ValueError, match="--deterministic with --tensor-parallel-size 2"):
        resolve_execution(WorkerOptions(tensor_parallel_size=2, deterministic=True), "cpu")


def test_the_in_process_engine_refuses_more_than_one_rank():
    with pytest.raises(ValueError, match="needs the worker process"):
        build_sized_runner(WorkerOptions(tensor_parallel_size=2))


def test_pipeline_stages_take_the_same_path_and_one_kind_of_split_at_a_time():
    resolved = resolve_execution(WorkerOptions(pipeline_parallel_size=2), "cpu")
    assert (resolved.kernel_backend, resolved.cpu_fused_ops) == ("torch", False)
    assert WorkerOptions(pipeline_parallel_size=3).group_size == 3
    with pytest.raises(ValueError, match="one kind of split at a time"):
        WorkerOptions(tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="--pipeline-parallel-size 2 runs on --kernel-backend torch"):
        resolve_execution(WorkerOptions(pipeline_parallel_size=2, kernel_backend="triton"), "cpu")
