"""plumbing.grammar_sandbox: constraints checked in helper processes. A compiler crash or an overrun costs
one helper and is an InvalidArgument naming the limit; the next check gets a fresh helper; each distinct
constraint is compiled once (concurrent askers share one check); GBNF comes back as Lark."""
from __future__ import annotations

import asyncio
import json

import pytest

from core.errors import InvalidArgument
from core.sampling import ConstraintKind, OutputConstraint
from gateway.text.tokenizer import default_model_path
from plumbing.constraint_limits import MAX_GRAMMAR_RULES, is_gbnf
from plumbing.grammar_sandbox import GrammarSandbox
from plumbing.telemetry.metrics import CONSTRAINT_CHECKS, model_name

K = ConstraintKind


def chained(num_rules: int, body: str = '"x{i}" r{j}', gbnf: bool = False) -> str:
    define, start = (" ::= ", "root") if gbnf else (": ", "start")
    rules = "".join(f"r{i}{define}" + body.format(i=i, j=i + 1) + "\n" for i in range(num_rules))
    return f"{start}{define}r0\n{rules}r{num_rules}{define}\"end\"\n"


@pytest.fixture
async def sandbox():
    sandbox = GrammarSandbox(default_model_path(), num_helpers=1, timeout_s=20.0)
    yield sandbox
    await sandbox.close()


async def test_a_compiler_crash_costs_one_helper_and_names_the_limits(sandbox):
    crashed = CONSTRAINT_CHECKS.labels(model_name(), "crashed")
    before = crashed._value.get()
    stack_deep = OutputConstraint(K.GRAMMAR, chained(MAX_GRAMMAR_RULES - 2, '("x{i}" ((r{j})))'))
    with pytest.raises(InvalidArgument) as caught:
        await sandbox.check(stack_deep, "guided_grammar")
    assert caught.value.field == "guided_grammar" and "crashed the grammar compiler (SIGSEGV)" in str(caught.value)
    assert f"{MAX_GRAMMAR_RULES} rules" in str(caught.value) and sandbox.num_crashes == 1
    assert crashed._value.get() == before + 1  # tokenmill:constraint_checks_total{outcome="crashed"}
    assert await sandbox.check(OutputConstraint(K.REGEX, "[0-9]+")) == OutputConstraint(K.REGEX, "[0-9]+")
    with pytest.raises(InvalidArgument):  # the crash's verdict is cached: no second crash
        await sandbox.check(stack_deep)
    assert sandbox.num_crashes == 1


async def test_a_compile_past_the_time_limit_is_refused_and_the_helper_replaced():
    sandbox = GrammarSandbox(default_model_path(), num_helpers=1, timeout_s=0.2)
    try:
        await sandbox.start()
        slow = OutputConstraint(K.GRAMMAR, chained(1900, gbnf=True))  # ~1 s of pure-Python GBNF conversion
        with pytest.raises(InvalidArgument) as caught:
            await sandbox.check(slow)
        assert "takes longer than 0.2s to compile (the compile time limit)" in str(caught.value)
        assert sandbox.num_timeouts == 1
        assert (await sandbox.check(OutputConstraint(K.CHOICE, choices=("a", "b")))).choices == ("a", "b")
    finally:
        await sandbox.close()


async def test_each_distinct_constraint_compiles_once_and_concurrent_askers_share_it(sandbox):
    schema = OutputConstraint(K.JSON_SCHEMA, json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    results = await asyncio.gather(*(sandbox.check(schema) for _ in range(5)))
    assert results == [schema] * 5 and sandbox.num_checks == 1
    await sandbox.check(OutputConstraint(K.JSON_SCHEMA, schema.value))  # equal content, another object
    assert sandbox.num_checks == 1 and sandbox.num_cache_hits == 1


async def test_gbnf_comes_back_as_the_lark_grammar_the_worker_compiles(sandbox):
    forwarded = await sandbox.check(OutputConstraint(K.GRAMMAR, 'root ::= "a" root | "b"'))
    assert forwarded.kind is K.GRAMMAR and not is_gbnf(forwarded.value) and "start" in forwarded.value


@pytest.mark.parametrize("constraint, words", [
    (OutputConstraint(K.GRAMMAR, chained(3000)), f"at most {MAX_GRAMMAR_RULES} rules"),
    (OutputConstraint(K.GRAMMAR, "start: " + "(" * 500 + '"a"' + ")" * 500), "nests brackets 500 levels deep"),
    (OutputConstraint(K.REGEX, "(" * 300 + "a" + ")" * 300), "the nesting limit"),
    (OutputConstraint(K.JSON_SCHEMA, "[" * 5000 + "]" * 5000), "nests 5000 levels deep"),
    (OutputConstraint(K.REGEX, "a\ud800"), "lone surrogate U+D800"),
    (OutputConstraint(K.JSON_SCHEMA, json.dumps({"$ref": "#"})), "unsatisfiable"),
])
async def test_over_a_limit_is_refused_naming_it(sandbox, constraint, words):
    with pytest.raises(InvalidArgument) as caught:
        await sandbox.check(constraint)
    assert words in str(caught.value)
    assert sandbox.num_crashes == 0
