"""The benchmark workload: text prompts of an exact token length and seeded output lengths.

Prompts are text (so an HTTP server measures the same thing as the gRPC API) that tokenizes to exactly
prompt_len ids; output lengths are uniform in [min_output, max_output] with a fixed seed, and every
request ignores EOS, so each request generates exactly its output length whatever the model says.
"""
from __future__ import annotations

import argparse
import functools
import random
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.text.tokenizer import TextTokenizer


def add_workload_arguments(parser: argparse.ArgumentParser, *, num_requests: int, prompt_len: int,
                           min_output: int, max_output: int) -> None:
    """The workload's shape, as every closed-loop benchmark takes it; the defaults are each tool's own."""
    parser.add_argument("--num-requests", type=int, default=num_requests)
    parser.add_argument("--prompt-len", type=int, default=prompt_len)
    parser.add_argument("--min-output", type=int, default=min_output)
    parser.add_argument("--max-output", type=int, default=max_output)


def add_side_by_side_arguments(parser: argparse.ArgumentParser, *, rounds: int, kv_cache_mb: int) -> None:
    """What a benchmark of two setups in one run takes beside the workload (the machine is shared and noisy,
    so the sides alternate, and the median round's ratio is the figure)."""
    parser.add_argument("--rounds", type=int, default=rounds,
                        help="the full workload on both sides this many times, alternating which goes first; the "
                             "ratio reported is the median round's (default: %(default)s)")
    parser.add_argument("--kv-cache-mb", type=int, default=kv_cache_mb, help="each side's KV cache (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' and output lengths' seed")


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout; the progress lines go to stderr")


def progress_log(json_on_stdout: bool):
    """print() for a run's progress lines: on stderr while stdout carries the JSON result, flushed so a
    long run shows where it is when piped."""
    return functools.partial(print, file=sys.stderr if json_on_stdout else sys.stdout, flush=True)


WORDS = ("time river light stone garden window music letter market winter island forest number paper "
         "engine silver question mountain morning yellow bridge animal planet ocean story circle doctor "
         "kitchen summer village student machine picture history language pocket theory").split()


def text_prompts(tokenizer: TextTokenizer, count: int, num_tokens: int, seed: int) -> list[str]:
    """Texts that tokenize to exactly num_tokens ids (so both paths see the same prompt ids)."""
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < count:
        text = " ".join(rng.choice(WORDS) for _ in range(num_tokens * 2))
        ids = tokenizer.encode(text)[:num_tokens]
        candidate = tokenizer.decode(ids)
        if tokenizer.encode(candidate) == ids:
            prompts.append(candidate)
    return prompts


# The input-grounded workload (issue 35: "rewrite or edit a given text and answer with it"): a chat asking the
# model to repeat a passage word for word, the passage drawn from these sentences. The answer is in the prompt,
# which is what prompt-lookup speculation (tokenmill's --speculative ngram, llama-server's --spec-type ngram-*)
# proposes from.
REWRITE_INSTRUCTION = "Repeat the following text exactly, word for word:\n\n"
REWRITE_SENTENCES = (
    "The committee met on Tuesday to review the budget for the coming year.",
    "After a long discussion, the members agreed to increase funding for the library and the public parks.",
    "Spending on new office furniture was reduced to make room for the repairs to the old bridge.",
    "The chair thanked everyone for their patience and asked the treasurer to prepare a revised plan.",
    "The next meeting will take place in the town hall at seven in the evening.",
    "Residents who cannot attend may send their questions by letter before the end of the month.",
    "A small group of volunteers has offered to clean the river banks every Saturday morning.",
    "The school asked for a new roof, since the rain has been coming into two of the classrooms.",
    "Several shop owners said that the market square needs better lighting during the winter.",
    "The doctor from the village clinic reported that more families have registered this year.",
    "A local farmer proposed a weekly market where growers could sell fruit and vegetables directly.",
    "The museum will open a new room about the history of the railway and the people who built it.",
    "Some members worried that the cost of heating the swimming pool would rise again next year.",
    "The police thanked the neighbours who helped to find a lost child near the forest last week.",
    "A study of traffic on the main road will be finished before the summer holidays begin.",
    "The choir is looking for new singers and practises every Thursday in the church hall.",
    "Plans for a bicycle path along the old canal were welcomed by almost everyone in the room.",
    "The treasurer explained that the reserve fund is smaller than it was three years ago.",
    "Children from the primary school painted pictures of the harbour for the library's walls.",
    "The meeting closed with a short speech about the town's two hundredth anniversary next spring.",
)


def rewrite_prompts(tokenizer: TextTokenizer, count: int, passage_tokens: int, seed: int) -> list[str]:
    """count chat prompts, as text (special tokens written out, which servers tokenize back to the same ids),
    each asking for a passage of exactly passage_tokens tokens to be repeated: sentences in a seeded order, cut
    at that many tokens."""
    from gateway.prepare.chat_encoding import encode_chat

    rng = random.Random(seed)
    prompts = []
    while len(prompts) < count:
        sentences = list(REWRITE_SENTENCES)
        rng.shuffle(sentences)
        text = " ".join(sentences * (1 + passage_tokens // 200))
        passage = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:passage_tokens])
        if len(tokenizer.encode(passage, add_special_tokens=False)) != passage_tokens:
            continue  # the cut split a word into tokens that merge back differently
        ids = encode_chat(tokenizer, [{"role": "user", "content": REWRITE_INSTRUCTION + passage}])
        prompt = tokenizer.decode(ids, skip_special_tokens=False)
        if tokenizer.encode(prompt, add_special_tokens=False) == ids:
            prompts.append(prompt)
    return prompts


@dataclass(slots=True, frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(vocab_size: int, num_requests: int = 32, prompt_len: int = 128,
                  min_output: int = 32, max_output: int = 256, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    # ids from the low part of the vocabulary: ordinary tokens, no specials at the very top
    prompts = [[rng.randrange(100, min(vocab_size, 20000)) for _ in range(prompt_len)] for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(min_output, max_output) for _ in range(num_requests)])


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

    def head(self, count: int, first_prompt: int = 0) -> BenchWorkload:
        """count requests for one level: the prompts from first_prompt on (cycled past the last), the output
        lengths always from the first (so every level asks the same work of every server)."""
        prompts = [(first_prompt + i) % len(self.prompts) for i in range(count)]
        lengths = [i % len(self.output_lens) for i in range(count)]
        return BenchWorkload([self.prompts[i] for i in prompts], [self.prompt_ids[i] for i in prompts],
                             [self.output_lens[i] for i in lengths], self.prompt_len, self.seed)


def build_workload(tokenizer, num_requests: int, prompt_len: int, min_output: int, max_output: int,
                   seed: int = 0, num_prompts: int | None = None, rewrite: bool = False) -> BenchWorkload:
    """num_requests output lengths; num_prompts distinct prompts (default: num_requests), so that a sweep
    can give every level prompts no server has seen (Levels). rewrite: the input-grounded workload instead
    (rewrite_prompts): prompt_len is each passage's length, and every output that long (the passage again)."""
    if not 1 <= min_output <= max_output:
        raise ValueError(f"output lengths: need 1 <= min_output ({min_output}) <= max_output ({max_output})")
    if rewrite:
        prompts = rewrite_prompts(tokenizer, num_prompts or num_requests, prompt_len, seed)
        return BenchWorkload(prompts, [tokenizer.encode(p, add_special_tokens=False) for p in prompts],
                             [prompt_len] * num_requests, prompt_len, seed)
    prompts = text_prompts(tokenizer, num_prompts or num_requests, prompt_len, seed)
    # the output lengths bench-engine and bench-cluster use for the same seed
    output_lens = make_workload(tokenizer.vocab_size, num_requests, prompt_len, min_output, max_output, seed).output_lens
    return BenchWorkload(prompts, [tokenizer.encode(p) for p in prompts], output_lens, prompt_len, seed)


class Levels:
    """Where each run of a sweep takes its prompts: the warm-up first, then every level (and repeat) the
    next ones, so no level finds its prompts in a server's prefix cache from an earlier level. (Levels that
    reused the first prompts measured cache hits: TTFT of a 512-token prompt at 16 streams read 1.2 s on a
    1.5B model whose cold prefill of 32 such prompts took over 30 s.) Servers get the same prompts at the
    same step of a sweep, each in its own process and cache."""

    def __init__(self, warmup: int) -> None:
        self.next_prompt = warmup

    def take(self, workload: BenchWorkload, count: int) -> BenchWorkload:
        level = workload.head(count, self.next_prompt)
        self.next_prompt += count
        return level

    @staticmethod
    def prompts_needed(levels: list[int], requests_per_level: int, warmup: int, rates: list[float] = (),
                       repeats: int = 1) -> int:
        """How many distinct prompts a sweep takes: warm-up, then each level and rate, repeats times."""
        closed = sum(max(requests_per_level, concurrency) for concurrency in levels)
        return warmup + repeats * (closed + len(rates) * requests_per_level)


def parse_levels(text: str) -> list[int]:
    """--concurrency (and --budgets): comma-separated levels >= 1, each once, in ascending order."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--concurrency {text!r}: expected comma-separated integers like 1,4,8") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"--concurrency {text!r}: every level must be >= 1")
    return sorted(set(levels))
