"""Speculative decoding in the in-process engine: `python scripts/bench_speculative.py [--max-tokens 96]`.

One request at a time (sync tokens/s, greedy; --concurrency N runs N copies of each prompt at once and
reports output tokens/s over them all), the default model, two workloads: an input-grounded prompt
(repeat a given paragraph word for word: prompt lookup finds the answer in the prompt) and an open-ended one
(a short story: little to look up). For each: without speculation (async scheduling, the default, and the
synchronous loop a batch of speculating requests runs) and with --speculative ngram at two --num-speculative-tokens; the
best of --repeats runs, the drafts accepted, and whether the greedy outputs are identical.

--draft-model PATH (or "default": the default model) adds --speculative draft at the same two counts, the worker
running that draft beside the target (--model PATH, default: the default model; e.g. a random-weight SmolLM2-360M
from scripts/make_smollm2_target.py, whose tokenizer is the default model's).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.sampling import SamplingParams  # noqa: E402
from gateway.prepare.chat_encoding import encode_chat  # noqa: E402
from gateway.text.tokenizer import load_tokenizer  # noqa: E402
from scheduler.options import SchedulerOptions  # noqa: E402
from tokenmill.bench.workload import REWRITE_INSTRUCTION  # noqa: E402
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig  # noqa: E402
from worker.loader import default_model_path  # noqa: E402

TEXT = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, the members "
        "agreed to increase funding for the library and the public parks, while reducing spending on new office "
        "furniture. The chair thanked everyone for their patience and asked the treasurer to prepare a revised plan "
        "before the next meeting, which will take place in the town hall at seven in the evening.")
WORKLOADS = {"input-grounded": REWRITE_INSTRUCTION + TEXT,  # what `tokenmill bench --workload rewrite` asks too
             "open-ended": "Write a short story about a lighthouse keeper."}
SETTINGS = {"plain": {}, "plain, sync loop": {"async_scheduling": False},
            "ngram k=4": {"speculative": "ngram", "num_speculative_tokens": 4},
            "ngram k=8": {"speculative": "ngram", "num_speculative_tokens": 8}}
DRAFT_SETTINGS = {"draft k=4": {"speculative": "draft", "num_speculative_tokens": 4},
                  "draft k=8": {"speculative": "draft", "num_speculative_tokens": 8}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0, help="above 0: sampled (the rejection sampler)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of: " + ", ".join(WORKLOADS))
    parser.add_argument("--model", default=None, help="the target (default: the default model)")
    parser.add_argument("--draft-model", default=None, help='adds --speculative draft with this draft ("default": '
                                                            'the default model)')
    parser.add_argument("--ignore-eos", action="store_true", help="every run decodes --max-tokens tokens")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos,
                            stop_token_ids=() if args.ignore_eos else tuple(tokenizer.stop_token_ids))
    worker = replace(ENGINE_WORKER, model=args.model)
    plain = LLM(EngineConfig(worker=worker), progress=False)
    engines = {name: (plain, settings) for name, settings in SETTINGS.items()}
    if args.draft_model:
        draft = str(default_model_path()) if args.draft_model == "default" else args.draft_model
        drafting = LLM(EngineConfig(worker=replace(worker, draft_model=draft),
                                    scheduler=SchedulerOptions(**DRAFT_SETTINGS["draft k=4"])), progress=False)
        engines.update({name: (drafting, settings) for name, settings in DRAFT_SETTINGS.items()})
    for workload in args.workloads.split(","):
        text = WORKLOADS[workload]
        prompt = encode_chat(tokenizer, [{"role": "user", "content": text}])
        outputs = {}
        for name, (llm, settings) in engines.items():
            llm.engine = llm.new_engine(EngineConfig(worker=worker, scheduler=SchedulerOptions(**settings)))
            llm.generate_token_ids([prompt], params)  # warm-up, not timed
            best = float("inf")
            for _ in range(args.repeats):
                started = time.perf_counter()
                batch = llm.generate_token_ids([prompt] * args.concurrency, params)
                best = min(best, time.perf_counter() - started)
                outputs[name] = batch[0]
            num_out = sum(map(len, batch))
            speculation = llm.engine.scheduler.speculation
            accepted = (f"  drafts accepted {speculation.num_accepted_tokens}/{speculation.num_draft_tokens}"
                        if speculation else "")
            print(f"{workload:15s} {name:17s} {len(prompt)} prompt tokens, {args.concurrency} x "
                  f"{len(outputs[name])} out, {num_out / best:6.1f} tok/s{accepted}", flush=True)
        if params.greedy:
            same = all(tokens == outputs["plain"] for tokens in outputs.values())
            print(f"{workload}: greedy outputs identical with and without speculation: {same}", flush=True)


if __name__ == "__main__":
    main()
