"""The draft model of --speculative draft (issue 35): a small model of the target's tokenizer, run by the worker
beside the target; its greedy guesses are the drafts the scheduler's DraftProposer hands out for the next step.

Its KV cache is its own tensors (its layers and heads) with the target's page ids: the same block tables and
slot mapping, since position p holds the same token in both (vLLM V1's draft-model path shares the block table
the same way). The scheduler's page accounting is the target's alone; the worker sizes the cache by the bytes of
a page of both (worker.build).

Right after a step's sampling and verification, for every request the step scheduled (DraftWork, one batch):

    tokens:    t_0 .. t_{c-1} | t_c .. t_{L-2}  | t_{L-1}         | d_1        ..  d_{n-1}
    draft KV:  already there  | catch-up rows   | last catch-up   | one guess step each, all requests
                              |                 | row: logits d_1 | batched: row j's logits give d_{j+1}
    position:  < c            | c .. L-2        | L-1             | L          ..  L+n-2

c = the request's num_draft_computed, L = its tokens now (the target has computed L-1 of them: t_{L-1} is
the token this step sampled), except that the catch-up skips the positions where the draft's last guesses went
in and the target accepted them (first_to_compute): the same token in the same slot, its K/V already there. A request that makes no guesses this step (mid-prompt, opted out) still
catches up to the target's computed count, so every page holding the target's K/V holds the draft's too: a
prefix-cache hit, a swap-in and a recompute after preemption find both.

Why sharing the page ids is safe: the draft writes K/V of real tokens only at positions the target has computed
or computes next (t_{L-1}), in pages the request holds. Its guesses land at L .. L+n-2, in the lookahead slots
the scheduler allocated for this step (StepPlan.num_draft_tokens), and num_draft_computed stops at L: the next
step's catch-up keeps the positions whose guess the target accepted (the K/V of the token that is really there)
and rewrites every position after them with the tokens actually accepted, before any draft row reads them. So
K/V past the accepted tokens is simply overwritten later, in the same slots. The guesses' K/V is kept only in
pages the request never gave back since (ModelRunner trims draft_guess_inputs when a plan drops pages). A
lookahead page the scheduler gives back afterwards (free_tail) holds nothing before L; whoever gets it writes
each slot before reading it, as with any fresh page, and it never entered the prefix cache (only full pages of
known tokens do).

Greedy drafting makes each draft a point mass, so worker.sampling.speculative's point-mass rejection sampler
is exact for temperature > 0 too (q(d) = 1 for the draft drawn, 0 elsewhere). CUDA graphs are off for the draft's
steps (eager kernels): capturing its decode steps is a later change.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import torch

from worker.model.attention import DECODE_GROUP_BYTES
from worker.model.config import ModelConfig
from worker.model.kv_cache import HostSwapSpace, allocate_kv_cache
from worker.model.llama import LlamaModel
from worker.options import WorkerOptions
from worker.paths import build_execution_path, resolve_execution
from worker.step_batch import RequestSpan, StepBatch

DRAFT_STEP_ID = -3  # the draft's batches are no plan's step
# what must match for the draft's token ids to mean the target's (the tokenizer's size and its special ids)
VOCABULARY_FIELDS = ("vocab_size", "bos_token_id", "eos_token_id")


def check_same_vocabulary(target: ModelConfig, draft: ModelConfig, draft_path: str) -> None:
    """ValueError naming the first vocabulary fact the draft model does not share with the target."""
    for name in VOCABULARY_FIELDS:
        if getattr(draft, name) != getattr(target, name):
            raise ValueError(f"--draft-model {draft_path}: its {name} is {getattr(draft, name)}, the target's is "
                             f"{getattr(target, name)}; a draft model must have the target's tokenizer (the same "
                             f"vocabulary size and special token ids)")


def first_to_compute(token_ids: Sequence[int], start: int, stop: int, guess_inputs: Sequence[int]) -> int:
    """The first position from start on whose draft K/V must be computed: past those (before stop) whose token is
    the guess the draft wrote there (guess_inputs[i] went in at position start + i)."""
    reused = 0
    while start + reused < stop and reused < len(guess_inputs) and token_ids[start + reused] == guess_inputs[reused]:
        reused += 1
    return start + reused


@dataclass(slots=True)
class DraftWork:
    """One scheduled request's share of the draft's work after a step."""

    token_ids: Sequence[int]  # its tokens (read only)
    start: int  # positions start .. end - 1 get the draft's K/V from token_ids (the catch-up)
    end: int
    block_table: Sequence[int]  # its pages; cover end - 1 + num_guesses - 1
    num_guesses: int  # 0: catch up only; else the row at end - 1 predicts the first guess
    guesses: list[int] = field(default_factory=list)


class DraftModel:
    """The draft network, its own KV tensors over the target's page ids, and its own execution path."""

    def __init__(self, model: LlamaModel, model_config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, options: WorkerOptions = WorkerOptions(), num_host_blocks: int = 0,
                 decode_group_bytes: int = DECODE_GROUP_BYTES) -> None:
        self.model_config = model_config
        self.block_size = block_size
        device = next(model.parameters()).device
        self.kv_cache = allocate_kv_cache(model_config, num_blocks, block_size, dtype, device)
        self.swap_space = HostSwapSpace(self.kv_cache, num_host_blocks)  # the target's page copies, on these
        execution = dataclasses.replace(resolve_execution(options, device, model_config), cuda_graphs=False)
        self.execution_path = build_execution_path(model, self.kv_cache, block_size, execution, device,
                                                   decode_group_bytes)

    def capacity(self, block_table: Sequence[int], num_tokens: int) -> int:
        """Guesses the pages allow a request of num_tokens tokens: its guess steps write positions
        num_tokens .. num_tokens + n - 2, and the row before them num_tokens - 1."""
        return max(len(block_table) * self.block_size - num_tokens + 1, 0)

    def run(self, works: list[DraftWork]) -> None:
        """The catch-up of every work (one batch), then the guess steps (one batch each); fills work.guesses."""
        batch = StepBatch(DRAFT_STEP_ID)
        guessing = []
        for work in works:
            if work.end <= work.start:
                continue
            first_row = len(batch.input_ids)
            batch.spans.append(RequestSpan(first_row, work.end - work.start, work.end, work.block_table))
            batch.input_ids.extend(work.token_ids[work.start:work.end])
            batch.positions.extend(range(work.start, work.end))
            if work.num_guesses:
                batch.sample_rows.append(len(batch.input_ids) - 1)
                guessing.append(work)
        if batch.spans:
            self._guess(batch, guessing)
        for step in range(1, max((work.num_guesses for work in guessing), default=0)):
            guessing = [work for work in guessing if work.num_guesses > step]
            batch = StepBatch(DRAFT_STEP_ID)
            for row, work in enumerate(guessing):
                position = work.end - 1 + step  # the input is the guess before: d_step
                batch.spans.append(RequestSpan(row, 1, position + 1, work.block_table))
                batch.input_ids.append(work.guesses[-1])
                batch.positions.append(position)
                batch.sample_rows.append(row)
            self._guess(batch, guessing)

    def _guess(self, batch: StepBatch, guessing: list[DraftWork]) -> None:
        """Runs batch; each sample row's argmax is its work's next guess."""
        with torch.inference_mode():
            logits = self.execution_path.forward(batch, self.execution_path.prepare(batch))  # [R, vocab]
            if not guessing:
                return
            tokens = torch.argmax(logits, dim=-1).tolist()
        for work, token in zip(guessing, tokens):
            work.guesses.append(int(token))

    def warm_up(self) -> None:
        """The target's warm-up batch shape through the draft (writes garbage into page 0, like the target's)."""
        batch = StepBatch(DRAFT_STEP_ID, input_ids=[0, 0, 0], positions=[0, 1, 2], sample_rows=[1, 2],
                          spans=[RequestSpan(0, 2, 2, [0, 0]), RequestSpan(2, 1, 3, [0, 0, 0])])
        self._guess(batch, [])
