"""Logits parity with transformers: ModelRunner over the paged cache, driven by hand-built StepPlans.

One scenario mixes everything a step can hold: a prompt prefilled in two chunks across two steps, a
full prefill, decode rows interleaved with prefill chunks in one packed batch, a request that starts
from a prefix-cache hit (its first blocks are another request's), and an all-decode step. Every
computed row's logits are compared with transformers run on the final full sequences: on the plain-torch
reference path (fused=False, explicitly) and on the compiled decoder ops (fused=True: norms, SwiGLU, RoPE
+ cache write, decode attention reading the pages in place; worker.paths.fused_ops), every family.
"""
from __future__ import annotations

import random

import pytest
import torch

from core.step import CachedRequestData, NewRequestData, StepPlan
from core.sampling import SamplingParams
from tests.helpers.tiny_models import FLAVOURS, VOCAB_SIZE, make_tiny_hf_model
from worker.loader import load_model
from worker.model_runner import ModelRunner
from worker.native_ops import cpu_ops_available
from worker.options import WorkerOptions

MAX_REL_ERR = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


class PlanBuilder:
    """A minimal stand-in for the scheduler: tracks tokens and pages, hands out shuffled block ids."""

    def __init__(self, num_blocks: int, block_size: int, seed: int) -> None:
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)  # non-contiguous pages exercise the block tables
        self.tokens: dict[str, list[int]] = {}
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.step_id = 0

    def add(self, request_id: str, prompt: list[int], shared_blocks: list[int] = ()) -> None:
        self.tokens[request_id] = list(prompt)
        self.block_tables[request_id] = list(shared_blocks)
        self.num_computed[request_id] = len(shared_blocks) * self.block_size  # prefix-cache hit

    def plan(self, schedule: dict[str, int], new: set[str] = frozenset(), finished: list[str] = ()) -> StepPlan:
        self.step_id += 1
        plan = StepPlan(self.step_id, num_scheduled_tokens=dict(schedule), finished_request_ids=list(finished))
        for request_id, num_tokens in schedule.items():
            table = self.block_tables[request_id]
            needed = -(-(self.num_computed[request_id] + num_tokens) // self.block_size)
            new_blocks = [self.free_blocks.pop() for _ in range(needed - len(table))]
            table.extend(new_blocks)
            if request_id in new:
                plan.new_requests.append(
                    NewRequestData(request_id, list(self.tokens[request_id]), len(self.tokens[request_id]), GREEDY, list(table), self.num_computed[request_id])
                )
            else:
                plan.cached_requests.append(CachedRequestData(request_id, new_blocks, self.num_computed[request_id]))
        return plan

    def record(self, plan: StepPlan, sampled: dict[str, int]) -> None:
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            self.num_computed[request_id] += num_tokens
        for request_id, token_id in sampled.items():
            self.tokens[request_id].append(token_id)


@pytest.fixture(scope="module", params=FLAVOURS)
def tiny(request, tmp_path_factory):
    folder, hf_model = make_tiny_hf_model(tmp_path_factory.mktemp(request.param), request.param)
    model, config = load_model(folder, progress=False)
    return hf_model, model, config


def run_scenario(model, config, block_size: int, decode_group_bytes: int | None = None, fused: bool = False):
    """Returns (builder, rows) where rows lists (request_id, position, our logits [V]) for every computed token."""
    group = {} if decode_group_bytes is None else {"decode_group_bytes": decode_group_bytes}
    if fused and not cpu_ops_available():
        pytest.skip("compiled CPU ops not built (scripts/build_cpu_ops.py)")
    runner = ModelRunner(model, config, num_blocks=256 // block_size * 4, block_size=block_size, dtype=torch.float32,
                         options=WorkerOptions(cpu_fused_ops=fused), **group)
    assert runner.execution_path.fused_ops == fused
    captured: list[torch.Tensor] = []
    # the path's forward: the model itself, or the compiled-op forward over its weights (fused)
    hook = runner.execution_path.decoder.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        return _run_steps(runner, model, block_size, captured)
    finally:
        hook.remove()


def _run_steps(runner, model, block_size, captured):
    gen = torch.Generator().manual_seed(1)
    prompt = lambda n: torch.randint(0, VOCAB_SIZE, (n,), generator=gen).tolist()  # noqa: E731
    builder = PlanBuilder(runner.num_blocks, block_size, seed=block_size)
    prompt_a = prompt(37)
    builder.add("A", prompt_a)
    builder.add("B", prompt(25))
    steps = [
        (dict(A=20, B=25), {"A", "B"}, []),  # A: first prefill chunk; B: whole prompt
        (dict(B=1, A=17), set(), []),  # decode row before A's last chunk
        (dict(A=1, C=30, B=1, D=5), {"C", "D"}, []),  # decode rows interleaved with chunks; D starts from a prefix hit
        (dict(C=15, A=1, B=1, D=1), set(), []),
        (dict(A=1, B=1, C=1, D=1), set(), []),  # all decode
        (dict(D=1, A=1, C=1), set(), ["B"]),
    ]
    rows = []
    for step_index, (schedule, new, finished) in enumerate(steps):
        if step_index == 2:
            prefix_len = 32 // block_size * block_size
            builder.add("C", prompt(45))
            builder.add("D", prompt_a[:prefix_len] + prompt(5), shared_blocks=builder.block_tables["A"][: prefix_len // block_size])
        plan = builder.plan(schedule, new, finished)
        starts = {rid: builder.num_computed[rid] for rid in schedule}
        result = runner.execute(plan)
        logits = model.compute_logits(captured.pop())  # [T, V]: every row, not only the sampled ones
        row = 0
        for request_id, num_tokens in schedule.items():
            rows.extend((request_id, starts[request_id] + i, logits[row + i]) for i in range(num_tokens))
            row += num_tokens
        assert set(result.sampled_token_ids) == {
            rid for rid, n in schedule.items() if starts[rid] + n == len(builder.tokens[rid])
        }, "exactly the requests that reached their full length sample"
        builder.record(plan, result.sampled_token_ids)
    return builder, rows


@pytest.mark.parametrize(
    "block_size, decode_group_bytes, fused",
    # 1 byte: every decode row in its own group, in context-length order (the gather path's groups)
    [(4, None, False), (16, None, False), (16, 1, False), (4, None, True), (16, None, True)],
)
def test_mixed_prefill_and_decode_steps_match_transformers(tiny, block_size, decode_group_bytes, fused):
    hf_model, model, config = tiny
    builder, rows = run_scenario(model, config, block_size, decode_group_bytes, fused)
    with torch.no_grad():
        reference = {rid: hf_model(torch.tensor([tokens])).logits[0] for rid, tokens in builder.tokens.items()}
    assert {rid for rid, _, _ in rows} == {"A", "B", "C", "D"}
    for request_id, position, ours in rows:
        expected = reference[request_id][position]
        rel_err = ((ours - expected).norm() / expected.norm()).item()
        assert rel_err <= MAX_REL_ERR, f"{request_id} position {position}: relative error {rel_err:.2e}"
    # D skipped its first 32 tokens (prefix-cache hit): only its own tokens were computed
    assert min(pos for rid, pos, _ in rows if rid == "D") == 32 // block_size * block_size


@pytest.mark.parametrize("fused", [False, True])
def test_greedy_tokens_are_transformers_argmax(tiny, fused):
    hf_model, model, config = tiny
    builder, _ = run_scenario(model, config, block_size=16, fused=fused)
    with torch.no_grad():
        for request_id, tokens in builder.tokens.items():
            num_prompt = {"A": 37, "B": 25, "C": 45, "D": 37}[request_id]
            logits = hf_model(torch.tensor([tokens])).logits[0]  # [S, V]
            expected = logits[num_prompt - 1 : len(tokens) - 1].argmax(-1).tolist()
            assert tokens[num_prompt:] == expected, request_id


def test_decode_groups_sort_by_context_and_fit_the_gather_budget():
    from worker.model.attention import GatherWorkspace, build_attention_metadata
    from worker.step_batch import RequestSpan

    block_numel = 4 * 2 * 8  # block_size 4, 2 KV heads, head_dim 8
    block_bytes = 2 * block_numel * 4  # K + V, float32
    workspace = GatherWorkspace(block_numel, torch.float32, group_bytes=6 * block_bytes)
    context_lens = [9, 2, 4, 3, 12]  # blocks: 3, 1, 1, 1, 3
    spans = [RequestSpan(i, 1, n, list(range(10 * i, 10 * i + 3))) for i, n in enumerate(context_lens)]
    metadata = build_attention_metadata(spans, 4, workspace=workspace)
    groups = [group.token_index.tolist() for group in metadata.decodes]
    assert groups == [[1, 3, 2], [0, 4]]  # shortest first; 3 rows x 1 block, then 2 rows x 3 blocks
    assert metadata.decodes[1].mask.shape == (2, 1, 1, 12) and metadata.decodes[1].mask[0].sum() == 9
