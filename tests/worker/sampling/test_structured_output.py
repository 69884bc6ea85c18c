"""Constrained decoding through the real model (SmolLM2-135M, in process): every output of the schema
suite validates with jsonschema, regex and choice outputs match, a grammar is followed, a request cut by
max_tokens is a valid prefix, a preempted-and-recomputed constrained request ends with the same output,
and random schemas from a small generator always give valid JSON (hypothesis)."""
from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import llguidance
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.outputs import FinishReason
from core.sampling import ConstraintKind, OutputConstraint, SamplingParams
from gateway.text.tokenizer import load_tokenizer
from plumbing.grammar import to_grammar
from scheduler.engine import EngineCore
from scheduler.scheduler import Scheduler
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig

pytestmark = pytest.mark.slow

NAME = {"type": "string", "maxLength": 12}
SCHEMAS = {
    "nested objects": {
        "type": "object",
        "properties": {"user": {"type": "object", "properties": {
            "name": NAME,
            "address": {"type": "object", "properties": {"city": NAME}, "required": ["city"],
                        "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False,
    },
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 2, "maxItems": 4},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
             "additionalProperties": False},
    "bounded numbers": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["age", "score"], "additionalProperties": False},
    "required and optional": {"type": "object", "properties": {"id": {"type": "integer"}, "nickname": NAME,
                                                                "active": {"type": "boolean"}},
                              "required": ["id"], "additionalProperties": False},
    "recursive ref": {
        "$defs": {"node": {"type": "object", "properties": {
            "value": {"type": "integer", "minimum": 0, "maximum": 9},
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 1}},
            "required": ["value"], "additionalProperties": False}},
        "$ref": "#/$defs/node",
    },
    "recursive ref through anyOf": {
        "$defs": {"person": {"type": "object", "properties": {
            "name": NAME, "boss": {"anyOf": [{"$ref": "#/$defs/person"}, {"type": "null"}]}},
            "required": ["name", "boss"], "additionalProperties": False}},
        "$ref": "#/$defs/person",
    },
}
# a small model follows a recursive schema as deep as it likes unless shown where to stop
PROMPTS = {"recursive ref": 'A tree as JSON, e.g. {"value":1,"children":[{"value":2}]}',
           "recursive ref through anyOf": 'A person and their boss as JSON, e.g. {"name":"Ann","boss":{"name":"Bob","boss":null}}'}
MODES = {"greedy": SamplingParams(temperature=0.0), "sampled": SamplingParams(temperature=1.0, top_p=0.95, seed=3)}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(EngineConfig(worker=dataclasses.replace(ENGINE_WORKER, num_blocks=256)), progress=False)


def chat_prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def run(llm: LLM, tokenizer, prompts: list[str], params: list[SamplingParams]) -> list[tuple[str, FinishReason]]:
    results = llm.generate([chat_prompt(tokenizer, p) for p in prompts], params)
    return [(tokenizer.decode([t for out in outputs for t in out.new_token_ids]), outputs[-1].finish_reason)
            for outputs in results]


def schema_params(schema: dict, mode: SamplingParams, max_tokens: int = 100) -> SamplingParams:
    return dataclasses.replace(mode, max_tokens=max_tokens,
                               constraint=OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)))


def test_every_schema_of_the_suite_gives_valid_json_in_every_mode(llm, tokenizer):
    cases = [(name, schema, mode) for name, schema in SCHEMAS.items() for mode in MODES]
    outputs = run(llm, tokenizer, [PROMPTS.get(name, f"Answer in JSON: an example of {name}.") for name, _, _ in cases],
                  [schema_params(schema, MODES[mode]) for _, schema, mode in cases])
    for (name, schema, mode), (text, finish) in zip(cases, outputs):
        assert finish is FinishReason.STOP, (name, mode, text)
        jsonschema.validate(json.loads(text), schema)  # raises, naming the case, if the output is invalid


def test_any_json_object_regex_choice_and_grammar(llm, tokenizer):
    regex = r"[0-9]{3}-[0-9]{4}"
    choices = ("Paris", "London", "Berlin")
    constraints = [
        OutputConstraint(ConstraintKind.JSON_OBJECT),
        OutputConstraint(ConstraintKind.REGEX, regex),
        OutputConstraint(ConstraintKind.CHOICE, choices=choices),
        OutputConstraint(ConstraintKind.GRAMMAR, 'root ::= "(" answer ")"\nanswer ::= "yes" | "no"'),
        OutputConstraint(ConstraintKind.GRAMMAR, 'start: WORD ("," WORD)~1..3\nWORD: /[a-z]{1,8}/'),
    ]
    for mode in MODES.values():
        outputs = run(llm, tokenizer,
                      ["Describe a cat in JSON.", "What is your phone number?", "What is the capital of France?",
                       "Is the sky blue?", "List some fruit."],
                      [dataclasses.replace(mode, max_tokens=80, constraint=c) for c in constraints])
        assert all(finish is FinishReason.STOP for _, finish in outputs[1:]), outputs
        # any JSON object, sampled at temperature 1, may still be open at max_tokens: then a valid prefix
        if outputs[0][1] is FinishReason.STOP:
            assert isinstance(json.loads(outputs[0][0]), dict)
        else:
            assert_valid_prefix(llm, constraints[0], tokenizer.encode(outputs[0][0], add_special_tokens=False))
        assert re.fullmatch(regex, outputs[1][0]), outputs[1]
        assert outputs[2][0] in choices
        assert outputs[3][0] in ("(yes)", "(no)")
        assert re.fullmatch(r"[a-z]{1,8}(,[a-z]{1,8}){1,3}", outputs[4][0]), outputs[4]


def assert_valid_prefix(llm: LLM, constraint: OutputConstraint, tokens: list[int]) -> None:
    matcher = llguidance.LLMatcher(llm.runner.structured_output.compiler.vocabulary, to_grammar(constraint))
    assert matcher.consume_tokens(tokens), matcher.get_error()


def test_a_request_cut_by_max_tokens_is_a_valid_prefix(llm, tokenizer):
    schema = SCHEMAS["nested objects"]
    [outputs] = llm.generate([chat_prompt(tokenizer, "A user as JSON.")], [schema_params(schema, MODES["greedy"], 6)])
    tokens = [t for out in outputs for t in out.new_token_ids]
    assert outputs[-1].finish_reason is FinishReason.LENGTH and len(tokens) == 6
    assert_valid_prefix(llm, OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)), tokens)


def test_a_preempted_constrained_request_ends_with_the_same_output(llm, tokenizer):
    """Too few pages for four requests at once: the scheduler preempts and recomputes, and the worker
    rebuilds each matcher by replaying the output it arrives with."""
    prompts = [chat_prompt(tokenizer, f"Give user number {i} as JSON.") for i in range(4)]
    params = [schema_params(SCHEMAS["nested objects"], MODES[mode], 60) for mode in ("greedy", "sampled") * 2]
    undisturbed = llm.generate(prompts, params)
    # 7 pages of 16 tokens: three requests start (2 prompt pages each) and run out as they grow
    tight = llm.config.scheduler.scheduler_config(num_blocks=7, block_size=llm.runner.block_size,
                                                  model_max_len=llm.model_config.max_position_embeddings)
    llm.engine = EngineCore(Scheduler(tight), llm.runner)
    try:
        under_pressure = llm.generate(prompts, params)
        assert llm.engine.scheduler.num_preemptions > 0
    finally:  # a fresh scheduler: the tight one wrote over pages the old one's prefix cache indexes
        llm.engine = llm.new_engine(llm.config)

    tokens = [[t for out in outputs for t in out.new_token_ids] for outputs in under_pressure]
    assert tokens == [[t for out in outputs for t in out.new_token_ids] for outputs in undisturbed]


PROPERTY_SCHEMAS = st.one_of(
    st.builds(lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "boolean"}),
    st.lists(st.sampled_from(["alpha", "beta", "gamma", "delta"]), min_size=1, max_size=3, unique=True)
    .map(lambda values: {"enum": values}),
    st.integers(1, 10).map(lambda n: {"type": "string", "maxLength": n}),
    st.integers(1, 3).map(lambda n: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "maxItems": n}),
)
OBJECT_SCHEMAS = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), PROPERTY_SCHEMAS, min_size=1, max_size=3) \
    .flatmap(lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
        lambda required: {"type": "object", "properties": props, "required": required, "additionalProperties": False}))


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schemas=st.lists(OBJECT_SCHEMAS, min_size=4, max_size=4))
def test_random_schemas_always_give_valid_output(llm, tokenizer, schemas):
    outputs = run(llm, tokenizer, ["Reply in JSON."] * len(schemas),
                  [schema_params(schema, mode) for schema, mode in zip(schemas, [*MODES.values()] * 2)])
    for schema, (text, finish) in zip(schemas, outputs):
        assert finish is FinishReason.STOP, (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_speculative_drafts_pass_the_grammar_and_change_no_greedy_output(llm, tokenizer):
    """--speculative ngram on constrained requests (issue 35): each verified row is masked at the grammar's
    state after the drafts before it, so greedy output is the same token for token, sampled output stays valid,
    and the drafts the grammar allows are accepted."""
    from scheduler.options import SchedulerOptions

    people = {"type": "array", "minItems": 4, "maxItems": 4, "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}}
    cases = [*SCHEMAS.items(), ("people", people)]
    prompts = [PROMPTS.get(name, f"Answer in JSON: an example of {name}.") for name, _ in cases]
    plain_engine = llm.engine
    try:
        expected = run(llm, tokenizer, prompts, [schema_params(schema, MODES["greedy"], 120) for _, schema in cases])
        llm.engine = llm.new_engine(EngineConfig(worker=llm.config.worker, scheduler=SchedulerOptions(
            speculative="ngram", num_speculative_tokens=8)))
        got = run(llm, tokenizer, prompts, [schema_params(schema, MODES["greedy"], 120) for _, schema in cases])
        assert got == expected
        assert llm.engine.scheduler.speculation.num_accepted_tokens > 0
        unseeded = dataclasses.replace(MODES["sampled"], seed=None)  # seeded requests are not sent drafts
        sampled = run(llm, tokenizer, prompts, [schema_params(schema, unseeded, 120) for _, schema in cases])
        for (name, schema), (text, finish) in zip(cases, sampled):
            if finish is FinishReason.STOP:
                jsonschema.validate(json.loads(text), schema)
            else:
                assert_valid_prefix(llm, OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)),
                                    tokenizer.encode(text, add_special_tokens=False))
    finally:
        llm.engine = plain_engine


def test_a_draft_models_guesses_pass_the_grammar_and_change_no_greedy_output(llm, tokenizer):
    """--speculative draft on constrained requests (issue 35): the draft guesses from its own logits, unmasked;
    each verified row is masked at the grammar's state after the guesses before it, so greedy output is the same
    token for token, and guesses the grammar allows are accepted (the default model drafting for itself)."""
    from scheduler.options import SchedulerOptions
    from worker.loader import default_model_path

    drafting = LLM(EngineConfig(worker=dataclasses.replace(llm.config.worker, draft_model=str(default_model_path())),
                                scheduler=SchedulerOptions(speculative="draft", num_speculative_tokens=4)),
                   progress=False)
    cases = list(SCHEMAS.items())
    prompts = [PROMPTS.get(name, f"Answer in JSON: an example of {name}.") for name, _ in cases]
    params = [schema_params(schema, MODES["greedy"], 120) for _, schema in cases]
    # against a fresh engine: the module's warm one answers these prompts from its prefix cache, whose chunk
    # boundaries move a 135M model's near-tie logits enough to flip a greedy token (order-dependent before)
    plain = LLM(EngineConfig(worker=llm.config.worker), progress=False)
    assert run(drafting, tokenizer, prompts, params) == run(plain, tokenizer, prompts, params)
    assert drafting.engine.scheduler.speculation.num_accepted_tokens > 0
