"""Every bad value a client can send: InvalidArgument whose message names field, value and limit."""
import math

import pytest

from gateway.prepare.validation import (
    ClientSampling,
    Limits,
    validate_chat_size,
    validate_priority,
    validate_prompt_ids,
    validate_prompt_text,
    validate_sampling,
    validate_stop_strings,
)
from core.sampling import SamplingParams
from core.errors import InvalidArgument

LIMITS = Limits(max_model_len=1000, max_tokens_limit=512, vocab_size=100, max_stop_strings=2,
                max_stop_string_len=5, max_logprobs=5, max_prompt_chars=50, max_messages=3,
                min_priority=-10, max_priority=10, max_stop_token_ids=2)


def sampling(prompt_len=None, **kwargs):
    return lambda: validate_sampling(LIMITS, ClientSampling(**kwargs), prompt_len=prompt_len)


# (case, call, field, value as shown in the message, the limit or reason as shown)
CASES = [
    ("empty prompt text", lambda: validate_prompt_text("", LIMITS), "prompt", "''", "must not be empty"),
    ("prompt not text", lambda: validate_prompt_text(7, LIMITS), "prompt", "7", "must be a string, not int"),
    ("prompt text too long", lambda: validate_prompt_text("x" * 51, LIMITS), "prompt", "'xxxx", "at most 50 characters, got 51"),
    ("too many messages", lambda: validate_chat_size([{"role": "u", "content": ""}] * 4, LIMITS), "messages", "[{", "at most 3 messages, got 4"),
    ("messages too large", lambda: validate_chat_size([{"role": "u", "content": "x" * 30}] * 2, LIMITS), "messages", "[{", "at most 50 characters of content in all, got 60"),
    ("empty prompt ids", lambda: validate_prompt_ids([], LIMITS), "prompt_token_ids", "[]", "at least one token"),
    ("prompt fills the context", lambda: validate_prompt_ids([1] * 1000, LIMITS), "prompt_token_ids", "[1, 1", "at most 999 tokens (max_model_len=1000 - 1), got 1000"),
    ("prompt ids not a list", lambda: validate_prompt_ids("1 2", LIMITS), "prompt_token_ids", "'1 2'", "list of token ids, not str"),
    ("token id negative", lambda: validate_prompt_ids([5, -1], LIMITS), "prompt_token_ids[1]", "-1", "[0, 99] (vocab_size=100)"),
    ("token id past vocab", lambda: validate_prompt_ids([100], LIMITS), "prompt_token_ids[0]", "100", "[0, 99] (vocab_size=100)"),
    ("token id not an int", lambda: validate_prompt_ids([1.5], LIMITS), "prompt_token_ids[0]", "1.5", "[0, 99]"),
    ("prompt + max_tokens over context", sampling(prompt_len=900, max_tokens=101), "max_tokens", "101", "prompt_tokens=900 + max_tokens must be <= max_model_len=1000 (at most 100 here)"),
    ("max_tokens 0", sampling(max_tokens=0), "max_tokens", "0", "must be in [1, 512]"),
    ("max_tokens negative", sampling(max_tokens=-5), "max_tokens", "-5", "must be in [1, 512]"),
    ("max_tokens above limit", sampling(max_tokens=513), "max_tokens", "513", "must be in [1, 512]"),
    ("max_tokens not int", sampling(max_tokens="10"), "max_tokens", "'10'", "must be an integer [1, 512]"),
    ("max_tokens bool", sampling(max_tokens=True), "max_tokens", "True", "must be an integer [1, 512]"),
    ("temperature negative", sampling(temperature=-0.1), "temperature", "-0.1", "finite number in [0, 100]"),
    ("temperature nan", sampling(temperature=math.nan), "temperature", "nan", "finite number in [0, 100]"),
    ("temperature inf", sampling(temperature=math.inf), "temperature", "inf", "finite number in [0, 100]"),
    ("temperature huge", sampling(temperature=1e9), "temperature", "1000000000.0", "finite number in [0, 100]"),
    ("top_p zero", sampling(top_p=0.0), "top_p", "0.0", "(0, 1]"),
    ("top_p above one", sampling(top_p=1.01), "top_p", "1.01", "(0, 1]"),
    ("top_p nan", sampling(top_p=math.nan), "top_p", "nan", "(0, 1]"),
    ("top_k below -1", sampling(top_k=-2), "top_k", "-2", "must be >= -1 (-1 or 0 disables)"),
    ("top_k float", sampling(top_k=2.5), "top_k", "2.5", "must be an integer >= -1"),
    ("min_p negative", sampling(min_p=-0.01), "min_p", "-0.01", "[0, 1]"),
    ("min_p above one", sampling(min_p=1.5), "min_p", "1.5", "[0, 1]"),
    ("repetition_penalty zero", sampling(repetition_penalty=0.0), "repetition_penalty", "0.0", "(0, 100]"),
    ("repetition_penalty negative", sampling(repetition_penalty=-1.0), "repetition_penalty", "-1.0", "(0, 100]"),
    ("presence_penalty below -2", sampling(presence_penalty=-2.5), "presence_penalty", "-2.5", "[-2, 2]"),
    ("presence_penalty above 2", sampling(presence_penalty=2.01), "presence_penalty", "2.01", "[-2, 2]"),
    ("frequency_penalty above 2", sampling(frequency_penalty=3), "frequency_penalty", "3", "[-2, 2]"),
    ("frequency_penalty inf", sampling(frequency_penalty=-math.inf), "frequency_penalty", "-inf", "[-2, 2]"),
    ("frequency_penalty text", sampling(frequency_penalty="1"), "frequency_penalty", "'1'", "must be a number in [-2, 2]"),
    ("seed too large", sampling(seed=2**64), "seed", str(2**64), f"[{-(2**63)}, {2**64 - 1}]"),
    ("logprobs above max", sampling(logprobs=6), "logprobs", "6", "must be in [0, 5]"),
    ("logprobs negative", sampling(logprobs=-1), "logprobs", "-1", "must be in [0, 5]"),
    ("ignore_eos not bool", sampling(ignore_eos="yes"), "ignore_eos", "'yes'", "true or false"),
    ("stop token id past vocab", sampling(stop_token_ids=[3, 100]), "stop_token_ids[1]", "100", "[0, 99] (vocab_size=100)"),
    ("stop token ids not a list", sampling(stop_token_ids=7), "stop_token_ids", "7", "list of token ids, not int"),
    ("too many stop token ids", sampling(stop_token_ids=[1, 2, 3]), "stop_token_ids", "[1, 2, 3]", "at most 2 ids, got 3"),
    ("too many stop strings", lambda: validate_stop_strings(["a", "b", "c"], LIMITS), "stop", "['a', 'b', 'c']", "at most 2 strings, got 3"),
    ("stop string too long", lambda: validate_stop_strings(["ok", "toolong"], LIMITS), "stop[1]", "'toolong'", "at most 5 characters, got 7"),
    ("empty stop string", lambda: validate_stop_strings([""], LIMITS), "stop[0]", "''", "must not be empty"),
    ("stop not a string", lambda: validate_stop_strings([3], LIMITS), "stop[0]", "3", "must be a string"),
    ("stop wrong type", lambda: validate_stop_strings({"a": 1}, LIMITS), "stop", "{'a': 1}", "string or a list of strings, not dict"),
    ("priority too low", lambda: validate_priority(-11, LIMITS), "priority", "-11", "must be in [-10, 10]"),
    ("priority too high", lambda: validate_priority(11, LIMITS), "priority", "11", "must be in [-10, 10]"),
    ("priority not int", lambda: validate_priority(1.0, LIMITS), "priority", "1.0", "must be an integer [-10, 10]"),
]


@pytest.mark.parametrize(("case", "call", "field", "shown", "limit"), CASES, ids=[c[0] for c in CASES])
def test_invalid_values_name_field_value_and_limit(case, call, field, shown, limit):
    with pytest.raises(InvalidArgument) as caught:
        call()
    message = str(caught.value)
    assert caught.value.field == field
    assert f"{field}={shown}" in message, message
    assert limit in message, message


def test_defaults_give_the_scheduler_defaults():
    assert validate_sampling(LIMITS) == SamplingParams(max_tokens=LIMITS.default_max_tokens)


def test_unset_max_tokens_is_capped_by_the_context_left():
    assert validate_sampling(LIMITS, prompt_len=990).max_tokens == 10


def test_valid_values_pass_through():
    params = validate_sampling(
        LIMITS, ClientSampling(max_tokens=512, temperature=0, top_p=1, top_k=0, min_p=1.0, repetition_penalty=1.2,
                               presence_penalty=-2, frequency_penalty=2.0, seed=0, stop_token_ids=[0, 99],
                               ignore_eos=True, logprobs=5),
        prompt_len=10,
    )
    assert params == SamplingParams(
        max_tokens=512, temperature=0.0, top_k=0, top_p=1.0, min_p=1.0, repetition_penalty=1.2,
        presence_penalty=-2.0, frequency_penalty=2.0, seed=0, stop_token_ids=(0, 99), ignore_eos=True, logprobs=5,
    )
    assert params.greedy and isinstance(params.temperature, float)
    assert validate_prompt_ids([0, 99] * 10, LIMITS) == [0, 99] * 10
    assert validate_stop_strings("END", LIMITS) == ["END"]
    assert validate_stop_strings(None, LIMITS) == []
    assert validate_priority(None, LIMITS) == 0 and validate_priority(-10, LIMITS) == -10
    assert validate_prompt_text("x" * 50, LIMITS) == "x" * 50


def test_long_values_are_cut_in_the_message():
    with pytest.raises(InvalidArgument) as caught:
        validate_prompt_ids(list(range(5000)), Limits(max_model_len=100))
    assert len(str(caught.value)) < 300
