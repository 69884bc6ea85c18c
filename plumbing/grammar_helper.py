"""One grammar-check helper process: `python -m plumbing.grammar_helper --model PATH --memory-mb N`.

plumbing.grammar_sandbox starts a few of these. Each reads one JSON line per constraint on stdin and
answers one JSON line on stdout, in order:

    -> {"kind": "grammar", "value": "root ::= ...", "choices": []}
    <- {"ok": true, "kind": "grammar", "value": "start: ...", "choices": []}     what the worker compiles
    <- {"ok": false, "reason": "is invalid: ..."}                                the 400's reason

JSON, not pickle (DESIGN invariant 7). Here the compiler may crash, loop or allocate without bound and
only this process pays: its address space is capped (RLIMIT_AS), the compile runs on a thread with an
8 MiB stack (what a worker gives it is 8x that: plumbing.grammar.GrammarCompiler), and the process runs
at a lower CPU priority so serving processes on the same cores go first. The parent kills it on its
time limit and starts another.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys

from core.errors import InvalidArgument
from core.sampling import ConstraintKind, OutputConstraint

HELPER_STACK_BYTES = 8 << 20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m plumbing.grammar_helper", description=__doc__)
    parser.add_argument("--model", required=True, help="the model's GGUF file or HF folder (its vocabulary)")
    parser.add_argument("--memory-mb", type=int, default=1024, help="address-space cap of this process")
    parser.add_argument("--nice", type=int, default=10, help="CPU priority below the serving processes")
    args = parser.parse_args(argv)
    os.nice(args.nice)
    # imported before the cap: loading the library maps address space that is not the compile's
    from plumbing.grammar import check_for_worker, load_vocabulary, run_with_stack

    vocabulary = load_vocabulary(args.model)
    limit = args.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        message = json.loads(line)
        constraint = OutputConstraint(ConstraintKind(message["kind"]), message.get("value", ""),
                                      tuple(message.get("choices", ())))

        try:
            forwarded = run_with_stack(lambda: check_for_worker(constraint, vocabulary), HELPER_STACK_BYTES)
            reply = {"ok": True, "kind": forwarded.kind.value, "value": forwarded.value,
                     "choices": list(forwarded.choices)}
        except InvalidArgument as error:
            reply = {"ok": False, "reason": error.limit_or_reason}
        except MemoryError:
            reply = {"ok": False, "reason": f"needs more than the grammar compiler's {args.memory_mb} MiB "
                                            "(the memory limit)"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
