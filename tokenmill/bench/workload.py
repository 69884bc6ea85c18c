"""The benchmark workload: text prompts of an exact token length and seeded output lengths.

Prompts are text (so an HTTP server measures the same thing as the gRPC API) that tokenizes to exactly
prompt_len ids; output lengths are uniform in [min_output, max_output] with a fixed seed, and every
request ignores EOS, so each request generates exactly its output length whatever the model says.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.bench_cluster import text_prompts
from tokenmill.bench_engine import make_workload


@dataclass(frozen=True, slots=True)
class BenchWorkload:
    prompts: list[str]
    prompt_ids: list[list[int]]  # [num_requests][prompt_len]
    output_lens: list[int]  # [num_requests]
    prompt_len: int
    seed: int

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def head(self, count: int) -> BenchWorkload:
        """The first count requests (cycled when count is larger), for one concurrency level."""
        index = [i % len(self.prompts) for i in range(count)]
        return BenchWorkload([self.prompts[i] for i in index], [self.prompt_ids[i] for i in index],
                             [self.output_lens[i] for i in index], self.prompt_len, self.seed)


def build_workload(tokenizer, num_requests: int, prompt_len: int, min_output: int, max_output: int,
                   seed: int = 0) -> BenchWorkload:
    if not 1 <= min_output <= max_output:
        raise ValueError(f"output lengths: need 1 <= min_output ({min_output}) <= max_output ({max_output})")
    prompts = text_prompts(tokenizer, num_requests, prompt_len, seed)
    # the output lengths bench-engine and bench-cluster use for the same seed
    output_lens = make_workload(tokenizer.vocab_size, num_requests, prompt_len, min_output, max_output, seed).output_lens
    return BenchWorkload(prompts, [tokenizer.encode(p) for p in prompts], output_lens, prompt_len, seed)
