"""plumbing.grammar: what the gateway refuses (each malformed constraint named, with the engine's reason)
and what the worker compiles (the GGUF vocabulary as the tokenizer spells it; one compile per content)."""
from __future__ import annotations

import json

import pytest

from core.errors import InvalidArgument
from core.sampling import ConstraintKind, OutputConstraint
from gateway.text.tokenizer import load_tokenizer
from plumbing.grammar import GrammarCompiler, check_for_worker
from worker.loader import default_model_path

K = ConstraintKind


@pytest.fixture(scope="module")
def vocabulary():
    return GrammarCompiler(default_model_path()).vocabulary


@pytest.mark.parametrize("constraint", [
    OutputConstraint(K.JSON_SCHEMA, json.dumps({"type": "object", "properties": {"a": {"$ref": "#"}}})),
    OutputConstraint(K.JSON_OBJECT),
    OutputConstraint(K.REGEX, r"\d{3}-[a-z]+"),
    OutputConstraint(K.CHOICE, choices=("yes", 'a "quoted" one', "back\\slash")),
    OutputConstraint(K.GRAMMAR, 'root ::= "a" root | "b"'),  # GBNF
    OutputConstraint(K.GRAMMAR, 'start: "x"+'),  # Lark
])
def test_well_formed_constraints_pass(constraint, vocabulary):
    check_for_worker(constraint, vocabulary)


@pytest.mark.parametrize("constraint, field, words", [
    (OutputConstraint(K.JSON_SCHEMA, '{"type":'), "json_schema", "is not JSON"),
    (OutputConstraint(K.JSON_SCHEMA, '[1, 2]'), "json_schema", "must be a JSON object"),
    (OutputConstraint(K.JSON_SCHEMA, '{"type": "foo"}'), "json_schema", "foo"),
    (OutputConstraint(K.REGEX, "a(b"), "regex", "unclosed group"),
    (OutputConstraint(K.REGEX, ""), "regex", "must not be empty"),
    (OutputConstraint(K.GRAMMAR, "root ::= ("), "grammar", "GBNF"),
    (OutputConstraint(K.GRAMMAR, "start: foo"), "grammar", "unknown name"),
    (OutputConstraint(K.CHOICE), "choice", "at least one"),
    (OutputConstraint(K.CHOICE, choices=("a", "")), "choice", "non-empty"),
])
def test_malformed_constraints_are_named_with_the_engines_reason(constraint, field, words, vocabulary):
    with pytest.raises(InvalidArgument) as caught:
        check_for_worker(constraint, vocabulary)
    assert caught.value.field == field and words in str(caught.value)


def test_the_gguf_vocabulary_spells_tokens_as_the_tokenizer_does_and_compiles_once():
    compiler = GrammarCompiler(default_model_path())
    tokenizer = load_tokenizer(None)
    vocabulary = compiler.vocabulary
    assert vocabulary.vocab_size == tokenizer.vocab_size and vocabulary.eos_token == tokenizer.eos_token_id
    ids = tokenizer.encode("Héllo wörld, {\"key\": [1, 2.5e-3]} 日本語\n\ttabs", add_special_tokens=False)
    assert vocabulary.decode_bytes(ids).decode() == tokenizer.decode(ids)
    assert vocabulary.is_special_token(tokenizer.eos_token_id) and not vocabulary.is_special_token(ids[0])

    constraint = OutputConstraint(K.CHOICE, choices=("yes", "no"))
    first, second = compiler.matcher(constraint), compiler.matcher(OutputConstraint(K.CHOICE, choices=("yes", "no")))
    assert compiler.num_compiled == 1
    assert first.consume_tokens(tokenizer.encode("yes", add_special_tokens=False)) and first.is_accepting()
    assert not second.is_accepting()  # a copy of its own, at the start


def test_the_worker_compiles_on_a_stack_8x_what_the_gateway_check_allowed():
    """3,000 chained rules overflow an 8 MiB stack (the gateway's helper refuses them); the worker's compile
    thread has 64 MiB, so anything that passed the check, with room to spare, never crashes a worker."""
    rules = "".join(f'r{i}: "x{i}" r{i + 1}\n' for i in range(3000))
    compiler = GrammarCompiler(default_model_path())
    matcher = compiler.matcher(OutputConstraint(K.GRAMMAR, f"start: r0\n{rules}r3000: \"end\"\n"))
    assert not matcher.is_error() and compiler.num_compiled == 1
