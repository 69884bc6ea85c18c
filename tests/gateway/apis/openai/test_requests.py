"""OpenAI JSON -> prepared requests (on the default model's tokenizer), deltas -> response JSON, and the
exception -> HTTP error mapping. No cluster: these run in the fast suite."""
from __future__ import annotations

import grpc
import pytest

from core.outputs import FinishReason
from gateway.generation.stream import Finish, GenerationDelta, TokenLogprob, TopLogprob
from gateway.apis.openai.errors import openai_error
from gateway.apis.openai.requests import parse_chat, parse_completion
from gateway.apis.openai.responses import GenerationFailed, ResponseBuilder
from core.sampling import ConstraintKind, OutputConstraint
from gateway.text.tokenizer import load_tokenizer
from gateway.prepare.validation import Limits
from core import errors

MODEL = "SmolLM2"
LIMITS = Limits(max_model_len=2048, vocab_size=49152)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def chat(tokenizer, **body):
    return parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **body}, tokenizer, LIMITS,
                      MODEL, "chatcmpl-1")


def completion(tokenizer, **body):
    return parse_completion({"model": MODEL, "prompt": "Hello", **body}, tokenizer, LIMITS, MODEL, "cmpl-1")


def test_sampling_fields_reach_the_request(tokenizer):
    parsed = completion(tokenizer, max_tokens=7, temperature=0.5, top_p=0.9, seed=-1, stop="\n", logprobs=2,
                        stream=True, stream_options={"include_usage": True}, top_k=5, ignore_eos=True)
    params = parsed.prepared.request.sampling_params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (7, 0.5, 0.9, 5)
    assert params.seed == 2**64 - 1  # OpenAI's int64 seed, as the same 64 bits unsigned
    assert params.logprobs == 2 and params.ignore_eos and parsed.prepared.stop == ["\n"]
    assert parsed.stream and parsed.include_usage and parsed.logprobs == 2
    assert parsed.prepared.request.request_id == "cmpl-1"
    assert parsed.prepared.request.prompt_token_ids == tokenizer.encode("Hello")


def test_logit_bias_and_constraints_reach_the_request(tokenizer):
    params = chat(tokenizer, logit_bias={"5": 100, "3": -100.0},
                  response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"},
                                                                          "strict": True}}).prepared.request.sampling_params
    assert params.logit_bias == ((3, -100.0), (5, 100.0))
    assert params.constraint == OutputConstraint(ConstraintKind.JSON_SCHEMA, '{"type": "integer"}')
    params = completion(tokenizer, guided_choice=["a", "b"]).prepared.request.sampling_params
    assert params.constraint == OutputConstraint(ConstraintKind.CHOICE, choices=("a", "b"))
    assert chat(tokenizer, response_format={"type": "text"}).prepared.request.sampling_params.constraint is None


def test_echo_carries_the_prompt_text(tokenizer):
    assert completion(tokenizer, echo=True).echo == tokenizer.decode(tokenizer.encode("Hello"), skip_special_tokens=False)
    assert completion(tokenizer, echo=False).echo == "" and completion(tokenizer).echo == ""


def test_echo_with_logprobs_asks_for_prompt_logprobs(tokenizer):
    echoed = completion(tokenizer, echo=True, logprobs=2)
    assert echoed.prepared.request.sampling_params.prompt_logprobs == 2
    assert echoed.echo_first_token == tokenizer.decode(tokenizer.encode("Hello")[:1], False)
    for parsed in (completion(tokenizer, logprobs=2), completion(tokenizer, echo=True)):
        assert parsed.prepared.request.sampling_params.prompt_logprobs is None and parsed.echo_first_token is None


def test_prompt_forms_and_chat_content_parts(tokenizer):
    ids = tokenizer.encode("Hello")
    for prompt in ("Hello", ["Hello"], ids, [ids]):
        assert completion(tokenizer, prompt=prompt).prepared.request.prompt_token_ids == ids
    plain = chat(tokenizer, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    parts = chat(tokenizer, messages=[{"role": "developer", "content": [{"type": "text", "text": "Be "},
                                                                        {"type": "text", "text": "brief."}]},
                                      {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert parts.prepared.request.prompt_token_ids == plain.prepared.request.prompt_token_ids
    with_logprobs = chat(tokenizer, logprobs=True, top_logprobs=3, max_completion_tokens=9)
    assert with_logprobs.logprobs == 3 and with_logprobs.prepared.request.sampling_params.max_tokens == 9
    assert chat(tokenizer, logprobs=True).logprobs == 0 and chat(tokenizer).logprobs is None


@pytest.mark.parametrize("make, body, param, words", [
    (completion, {"temperature": -1}, "temperature", "[0, 100]"),
    (completion, {"n": 0}, "n", "[1, 16]"),
    (chat, {"n": 17}, "n", "[1, 16]"),
    (chat, {"n": True}, "n", "integer"),
    (completion, {"n": 3, "best_of": 2}, "best_of", ">= n (3)"),
    (completion, {"best_of": 17}, "best_of", "[1, 16]"),
    (completion, {"n": 2, "best_of": 3, "stream": True}, "best_of", "must equal n (2) when streaming"),
    (completion, {"echo": True, "logprobs": 50}, "logprobs", "[0, 20]"),
    (completion, {"echo": "yes"}, "echo", "true or false"),
    (completion, {"prompt": ["a", "b"]}, "prompt", "2 prompts"),
    (completion, {"prompt": [1, 10**9]}, "prompt[1]", "vocab_size"),
    (completion, {"prompt": None}, "prompt", "required"),
    (completion, {"logprobs": 50}, "logprobs", "[0, 20]"),
    (completion, {"stop": ["x"] * 17}, "stop", "at most 16"),
    (completion, {"stream": "yes"}, "stream", "true or false"),
    (chat, {"max_completion_tokens": 0}, "max_completion_tokens", "[1, 4096]"),
    (chat, {"max_tokens": 5000}, "max_tokens", "[1, 4096]"),
    (chat, {"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    (chat, {"messages": None}, "messages", "required"),
    (chat, {"messages": [{"role": "user"}]}, "messages[0].content", "required"),
    (chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]",
     "only text parts"),
    (chat, {"tools": [{"type": "function"}]}, "tools[0].function", "must be an object"),
    (chat, {"logit_bias": {"1": 500}}, "logit_bias['1']", "[-100, 100]"),
    (completion, {"logit_bias": {"60000": 1}}, "logit_bias['60000']", "vocab_size=49152"),
    (chat, {"logit_bias": [1, 2]}, "logit_bias", "mapping token ids"),
    (chat, {"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    (completion, {"guided_choice": "yes"}, "guided_choice", "list of strings"),
])
def test_bad_fields_name_the_openai_param(tokenizer, make, body, param, words):
    with pytest.raises(errors.InvalidArgument) as caught:
        make(tokenizer, **body)
    error = openai_error(caught.value)
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", param)
    assert words in error.message


def test_unknown_model_is_404_model_not_found(tokenizer):
    with pytest.raises(errors.UnknownModel) as caught:
        completion(tokenizer, model="gpt-4")
    error = openai_error(caught.value)
    assert (error.status, error.code) == (404, "model_not_found") and MODEL in error.message
    assert completion(tokenizer, model=None).prepared  # unset model: the served one


class _RpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str, trailing=()) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


@pytest.mark.parametrize("exc, status, code", [
    (errors.Unauthenticated("no key"), 401, "invalid_api_key"),
    (errors.NotFound("request", "r1"), 404, "not_found"),
    (errors.ResourceExhausted("queue full", retry_after_s=2.0), 429, "rate_limit_exceeded"),
    (errors.Unavailable("scheduler down"), 503, "service_unavailable"),
    (errors.DeadlineExceeded("too slow"), 504, "timeout"),
    (_RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "scheduler queue full", [("retry-after-ms", "1500")]), 429,
     "rate_limit_exceeded"),
    (_RpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad"), 400, None),
    (GenerationFailed("worker died"), 500, "internal_error"),
    (RuntimeError("bug"), 500, "internal_error"),
])
def test_exceptions_and_downstream_statuses_map_to_http(exc, status, code):
    error = openai_error(exc)
    assert (error.status, error.code) == (status, code)
    response = error.response()
    assert response.status == status and response.content_type == "application/json"
    if status == 429:
        assert response.headers["Retry-After"] == "2"


def _deltas() -> list[GenerationDelta]:
    entry = TokenLogprob(5, " Pa", -0.5, [TopLogprob(5, " Pa", -0.5), TopLogprob(6, " Lo", -1.5)])
    finish = Finish(FinishReason.STOP, "\n", 6, 2, 0, 0, 0, 0, 0)
    return [GenerationDelta("id-1", " Pa", [5], [entry]),
            GenerationDelta("id-1", "ris", [7], [TokenLogprob(7, "ris", -0.25, [])], finish)]


@pytest.mark.parametrize("chat_api", [False, True])
def test_stream_chunks_add_up_to_the_whole_body(chat_api):
    whole, streamed = (ResponseBuilder(chat=chat_api, request_id="id-1", model=MODEL, logprobs=1) for _ in range(2))
    chunks = []
    for delta in _deltas():
        whole.add(delta)
        chunks += streamed.chunks(delta)
    body = whole.body()
    key = "delta" if chat_api else "text"
    text = "".join((c["choices"][0][key].get("content", "") if chat_api else c["choices"][0][key]) for c in chunks)
    choice = body["choices"][0]
    assert text == (choice["message"]["content"] if chat_api else choice["text"]) == " Paris"
    assert choice["finish_reason"] == chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    if chat_api:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert [e["token"] for e in choice["logprobs"]["content"]] == [" Pa", "ris"]
    else:
        assert choice["logprobs"]["text_offset"] == [0, 3]
        assert choice["logprobs"]["top_logprobs"][0] == {" Pa": -0.5, " Lo": -1.5}


def test_a_failed_request_raises_instead_of_answering():
    builder = ResponseBuilder(chat=True, request_id="id-1", model=MODEL, logprobs=None)
    with pytest.raises(GenerationFailed):
        builder.chunks(GenerationDelta("id-1", "", [], [], Finish(FinishReason.ERROR, "", 1, 0, 0, 0, 0, 0, 0)))
