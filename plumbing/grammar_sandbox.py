"""Where a serving process checks client constraints: a bounded pool of helper processes.

    sandbox = GrammarSandbox(model_path, num_helpers=2, timeout_s=5.0, memory_mb=1024)
    forwarded = await sandbox.check(constraint, "guided_grammar")   # InvalidArgument names field and limit
    await sandbox.close()

Why processes, measured (docs/reliability.md, "Hostile constraints"): the grammar compiler is native
code. A 3,000-rule chained Lark grammar overflows its stack with SIGSEGV, which no thread, try/except
or stack guard inside the gateway survives; a 6,000-rule GBNF grammar holds the GIL in the pure-Python
GBNF converter for 30 s, which a thread would not take off the event loop either. A helper process
(plumbing.grammar_helper) contains both: a crash costs that helper, a runaway is killed at timeout_s,
its memory is capped, and it runs at a lower CPU priority than the serving processes.

Each distinct constraint is checked once: verdicts (the forwarded constraint, or the refusal) are
cached by content, and concurrent requests with one constraint share one check. The forwarded form is
what the scheduler and worker see: GBNF already converted to Lark, so no worker ever runs the converter.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

from core.errors import InvalidArgument
from core.sampling import ConstraintKind, OutputConstraint
from core.json_limits import MAX_NESTING_DEPTH
from plumbing.constraint_limits import MAX_GRAMMAR_RULES, check_size
from plumbing.telemetry.metrics import CONSTRAINT_CHECKS, model_name

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0  # a helper's start: Python, llguidance and the model's vocabulary


class _Helper:
    """One helper process and its pipes, used by one check at a time, from a worker thread: spawning
    (a fork of this process), writing a 256 kB grammar and waiting for the answer all stay off the
    event loop, which only awaits the thread (measured: forking the gateway on its loop for each
    crashed helper's replacement put 100+ ms into a concurrent Tokenize call's P99)."""

    def __init__(self, argv: list[str]) -> None:
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._buffer = b""
        if self._read_line(deadline=time.monotonic() + _START_TIMEOUT_S) is None:  # the vocabulary loaded
            self.kill()
            raise RuntimeError(f"the grammar helper {argv} exited with {self.process.returncode} before it was ready")

    def ask(self, constraint: OutputConstraint, timeout_s: float) -> dict | None:
        """The helper's reply; None when it died before answering. Raises TimeoutError past timeout_s."""
        line = json.dumps({"kind": constraint.kind.value, "value": constraint.value,
                           "choices": list(constraint.choices)}) + "\n"
        try:
            self.process.stdin.write(line.encode())
            self.process.stdin.flush()
        except (BrokenPipeError, ConnectionResetError):
            return None
        reply = self._read_line(deadline=time.monotonic() + timeout_s)
        return json.loads(reply) if reply else None

    def _read_line(self, deadline: float) -> bytes | None:
        stdout = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            readable, _, _ = select.select([stdout], [], [], left)
            if readable:
                chunk = os.read(stdout, 1 << 20)
                if not chunk:
                    return None  # the helper is gone
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def kill(self) -> int:
        if self.process.poll() is None:
            self.process.kill()
        return self.process.wait()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


class GrammarSandbox:
    def __init__(self, model_path: str | Path, *, num_helpers: int = 2, timeout_s: float = 5.0,
                 memory_mb: int = 1024, max_cached: int = 1024) -> None:
        if num_helpers < 1 or timeout_s <= 0 or memory_mb < 64:
            raise ValueError(f"num_helpers={num_helpers} must be >= 1, timeout_s={timeout_s} > 0 and "
                             f"memory_mb={memory_mb} >= 64")
        self.model_path = str(model_path)
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_cached = max_cached
        self._num_helpers = num_helpers
        self._idle: asyncio.Queue[_Helper | None] | None = None  # None: a helper slot not started yet
        self._verdicts: OrderedDict[OutputConstraint, OutputConstraint | str] = OrderedDict()
        self._pending: dict[OutputConstraint, asyncio.Task] = {}
        self.num_checks = self.num_cache_hits = self.num_crashes = self.num_timeouts = 0

    async def check(self, constraint: OutputConstraint, field: str | None = None) -> OutputConstraint:
        """The constraint to forward (GBNF as Lark; any other as it is). Raises InvalidArgument naming
        field (default: the kind) and the problem or limit. Only the free limits are checked here, inline
        (check_size); the structural ones run in the helper, before its compile."""
        name = field or constraint.kind.value
        check_size(constraint, name)
        verdict = self._verdicts.get(constraint)
        if verdict is not None:
            self.num_cache_hits += 1
            _count("cached")
            self._verdicts.move_to_end(constraint)
        else:
            check = self._pending.get(constraint)
            if check is None:  # the first asker starts the check; others with the same constraint await it
                check = self._pending[constraint] = asyncio.ensure_future(self._checked(constraint))
                check.add_done_callback(lambda _: self._pending.pop(constraint, None))
            # shielded: a client that goes away mid-check leaves it running for the others and the cache
            # (a cancelled read would leave the helper's reply behind in its pipe)
            verdict = await asyncio.shield(check)
        if isinstance(verdict, str):
            raise InvalidArgument(name, _short(constraint.value or list(constraint.choices)), verdict)
        return verdict

    async def _checked(self, constraint: OutputConstraint) -> OutputConstraint | str:
        self.num_checks += 1
        verdict = await self._ask_a_helper(constraint)
        self._verdicts[constraint] = verdict
        while len(self._verdicts) > self.max_cached:
            self._verdicts.popitem(last=False)
        return verdict

    async def _ask_a_helper(self, constraint: OutputConstraint) -> OutputConstraint | str:
        idle = self._idle_helpers()
        helper = await idle.get()
        try:
            helper, verdict = await asyncio.to_thread(self._ask_blocking, helper, constraint)
            return verdict
        finally:
            idle.put_nowait(helper if helper is not None and helper.alive else None)

    def _ask_blocking(self, helper: _Helper | None, constraint: OutputConstraint
                      ) -> tuple[_Helper | None, OutputConstraint | str]:
        """On a worker thread: (the helper, alive or not, and the verdict)."""
        helper = helper if helper is not None and helper.alive else self._start_helper()
        try:
            reply = helper.ask(constraint, self.timeout_s)
        except TimeoutError:
            self.num_timeouts += 1
            _count("timed_out")
            helper.kill()
            logger.warning("grammar check of a %s constraint (%d characters) passed %.1fs: helper killed",
                           constraint.kind.value, len(constraint.value), self.timeout_s)
            return helper, f"takes longer than {self.timeout_s:g}s to compile (the compile time limit)"
        if reply is None:
            return helper, self._crashed(helper, constraint)
        _count("compiled" if reply["ok"] else "refused")
        if not reply["ok"]:
            return helper, reply["reason"]
        return helper, OutputConstraint(ConstraintKind(reply["kind"]), reply["value"], tuple(reply["choices"]))

    def _crashed(self, helper: _Helper, constraint: OutputConstraint) -> str:
        self.num_crashes += 1
        _count("crashed")
        code = helper.kill()
        how = _signal_name(-code) if code < 0 else f"exit {code}"
        logger.warning("a %s constraint (%d characters) crashed the grammar compiler helper (%s)",
                       constraint.kind.value, len(constraint.value), how)
        return (f"crashed the grammar compiler ({how}): it nests or chains rules too deep, or needs more than "
                f"{self.memory_mb} MiB (limits: {MAX_GRAMMAR_RULES} rules, {MAX_NESTING_DEPTH} levels of nesting, "
                f"{self.memory_mb} MiB)")

    def _idle_helpers(self) -> asyncio.Queue:
        if self._idle is None:  # made on first use, inside the event loop that runs the checks
            self._idle = asyncio.Queue()
            for _ in range(self._num_helpers):
                self._idle.put_nowait(None)
        return self._idle

    def _start_helper(self) -> _Helper:
        return _Helper([sys.executable, "-m", "plumbing.grammar_helper", "--model", self.model_path,
                        "--memory-mb", str(self.memory_mb)])

    async def start(self, num: int | None = None) -> None:
        """Starts helpers now (else on first use), so the first constrained request does not wait for one."""
        idle = self._idle_helpers()
        slots = [idle.get_nowait() for _ in range(min(num or self._num_helpers, idle.qsize()))]
        try:
            slots = await asyncio.gather(*(asyncio.to_thread(self._start_helper) if slot is None
                                           else asyncio.sleep(0, slot) for slot in slots))
        finally:
            for slot in slots:
                idle.put_nowait(slot)

    async def close(self) -> None:
        if self._idle is None:
            return
        while not self._idle.empty():
            helper = self._idle.get_nowait()
            if helper is not None:
                await asyncio.to_thread(helper.kill)


def _count(outcome: str) -> None:
    CONSTRAINT_CHECKS.labels(model_name(), outcome).inc()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _short(value: object, limit: int = 200) -> object:
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + "..."
    return value
