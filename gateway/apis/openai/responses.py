"""One request's GenerationDeltas -> OpenAI response JSON: a whole response, or stream chunks.

    builder = ResponseBuilder(chat=True, request_id=..., model=..., logprobs=None, include_usage=False, n=1)
    for delta in deltas: builder.add(delta)          # then builder.body()
    # or, streaming: for delta in deltas: chunks = builder.chunks(delta); then builder.usage_chunk()

Text is exactly what stream_generation produced, so the concatenated stream deltas equal the
non-streaming text. finish_reason is "stop" or "length" (or vLLM's "abort" when the request was
cancelled from elsewhere), "tool_calls" when a chat with tools stopped after calling one (tool_syntax:
the text is read for calls, gateway.apis.openai.tools); a request that failed inside the cluster raises
GenerationFailed.
With n > 1 each delta's index names its choice (gateway.generation.samples); usage counts the prompt once
and the completion tokens of every choice.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from gateway.generation.stream import Finish, GenerationDelta, TokenLogprob
from gateway.apis.openai.tools import ToolCallDeltas, tool_message
from gateway.text.tool_syntax import ToolSyntax
from core.errors import ServingError
from core.outputs import FinishReason

_MIN_LOGPROB = -9999.0  # JSON has no -Infinity; vLLM reports impossible tokens with this value


class GenerationFailed(ServingError):
    """The scheduler or worker ended the request with an error (HTTP 500)."""


@dataclass(slots=True)
class _Choice:
    """What one choice (one sample) has received so far."""

    echo: str  # completions echo: the prompt text, put before the first text of the completion
    text_parts: list[str] = field(default_factory=list)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    # completions echo with logprobs: the other prompt tokens' logprobs once they arrive (with the first token)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: Finish | None = None
    text_offset: int = 0  # completions logprobs: where the next token's text starts
    sent_role: bool = False
    tool_calls: ToolCallDeltas | None = None  # chat with tools, streaming: the text read for calls


class ResponseBuilder:
    def __init__(self, *, chat: bool, request_id: str, model: str, logprobs: int | None,
                 include_usage: bool = False, echo: str = "", echo_first_token: str | None = None,
                 n: int = 1, tool_syntax: ToolSyntax | None = None) -> None:
        self.chat = chat
        self.request_id = request_id
        self.model = model
        self.logprobs = logprobs  # None: the request asked for none
        self.include_usage = include_usage
        self.created = int(time.time())
        # completions echo with logprobs: the first prompt token's text (it has no logprob)
        self.echo_first_token = echo_first_token
        # chat with tools: each choice's text is read for calls in this syntax (gateway.apis.openai.tools)
        self.tool_syntax = tool_syntax
        self._choices = [_Choice(echo, tool_calls=tool_syntax and ToolCallDeltas(tool_syntax)) for _ in range(n)]

    @property
    def finish(self) -> Finish | None:
        """Every choice's ends combined (usage: the prompt once, all completion tokens); None until all ended."""
        finishes = [choice.finish for choice in self._choices]
        if any(finish is None for finish in finishes):
            return None
        if len(finishes) == 1:
            return finishes[0]
        first = finishes[0]
        # the prompt is read from the cache by every sample but the one that computed it: the
        # request's cached prompt tokens are what that one found there
        return Finish(reason=first.reason, matched_stop=first.matched_stop, prompt_tokens=first.prompt_tokens,
                      completion_tokens=sum(finish.completion_tokens for finish in finishes),
                      cached_prompt_tokens=min(finish.cached_prompt_tokens for finish in finishes),
                      queue_ns=min(finish.queue_ns for finish in finishes),
                      time_to_first_token_ns=min(finish.time_to_first_token_ns for finish in finishes),
                      decode_ns=max(finish.decode_ns for finish in finishes),
                      e2e_ns=max(finish.e2e_ns for finish in finishes))

    # -- whole response ------------------------------------------------------------------------------

    def add(self, delta: GenerationDelta) -> None:
        choice = self._choices[delta.index]
        choice.text_parts.append(delta.text)
        choice.token_logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = delta.prompt_logprobs
        if delta.finish is not None:
            choice.finish = _checked(delta.finish)

    def body(self) -> dict:
        finish = self.finish
        assert finish is not None, "body() before the last delta"
        choices = []
        for index, state in enumerate(self._choices):
            text = state.echo + "".join(state.text_parts)
            choice: dict = {"index": index}
            if self.chat and self.tool_syntax is not None:
                choice["message"] = tool_message(self.tool_syntax, text)
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["logprobs"] = self._logprobs(state, state.token_logprobs, state.prompt_logprobs)
            choice["finish_reason"] = _finish_reason(state.finish, "tool_calls" in choice.get("message", {}))
            choice["stop_reason"] = state.finish.matched_stop or None  # vLLM's field: the stop string that matched
            choices.append(choice)
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": usage(finish)}

    # -- streaming --------------------------------------------------------------------------------------

    def chunks(self, delta: GenerationDelta) -> list[dict]:
        """The chunks to send for this delta (none while text is held back and nothing else is new)."""
        out = []
        state = self._choices[delta.index]
        if self.chat and not state.sent_role:
            state.sent_role = True
            out.append(self._chunk(delta.index, {"role": "assistant", "content": ""}, None, None))
        finish = _checked(delta.finish) if delta.finish is not None else None
        state.finish = finish or state.finish
        text, state.echo = state.echo + delta.text, ""  # an echoed prompt goes out with the first chunk
        if state.tool_calls is not None:
            return out + self._tool_chunks(delta, state, finish)
        if text or delta.logprobs or finish is not None:
            content = ({"content": text} if text or finish is None else {}) if self.chat else text
            logprobs = self._logprobs(state, delta.logprobs, delta.prompt_logprobs)
            out.append(self._chunk(delta.index, content, logprobs, finish))
        return out

    def _tool_chunks(self, delta: GenerationDelta, state: _Choice, finish: Finish | None) -> list[dict]:
        """Chat with tools: the text outside calls as content, the calls as tool_calls deltas."""
        pieces = state.tool_calls.deltas(delta.text, last=finish is not None)
        if not pieces and (delta.logprobs or finish is not None):
            pieces = [{}]
        logprobs = self._logprobs(state, delta.logprobs, delta.prompt_logprobs)
        return [self._chunk(delta.index, piece, logprobs if number == 0 else None,
                            finish if number == len(pieces) - 1 else None, state.tool_calls.called)
                for number, piece in enumerate(pieces)]

    def usage_chunk(self) -> dict:
        """stream_options.include_usage: the last chunk, with usage and no choices (after every choice ended)."""
        finish = self.finish
        assert finish is not None, "usage_chunk() before every choice ended"
        return {**self._head(self._chunk_object), "choices": [], "usage": usage(finish)}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, index: int, content: dict | str, logprobs: dict | None, finish: Finish | None,
               called_tools: bool = False) -> dict:
        choice: dict = {"index": index, ("delta" if self.chat else "text"): content, "logprobs": logprobs,
                        "finish_reason": _finish_reason(finish, called_tools) if finish else None}
        if finish is not None:
            choice["stop_reason"] = finish.matched_stop or None
        chunk = {**self._head(self._chunk_object), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI: null on every chunk but the last
        return chunk

    def _head(self, kind: str) -> dict:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    # -- logprobs -----------------------------------------------------------------------------------------

    def _logprobs(self, state: _Choice, entries: list[TokenLogprob],
                  prompt_entries: list[TokenLogprob] | None = None) -> dict | None:
        """prompt_entries (completions echo with logprobs, on the first chunk or the whole body): the prompt
        tokens after the first, listed before entries behind the first prompt token, whose logprob and
        alternatives are null (OpenAI's and vLLM's echo); text_offset counts from the echoed prompt's start."""
        if self.logprobs is None:
            return None
        if self.chat:
            return {"content": [{**_chat_token(entry.token, entry.logprob),
                                 "top_logprobs": [_chat_token(top.token, top.logprob) for top in entry.top]}
                                for entry in entries], "refusal": None}
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict | None] = []
        if prompt_entries is not None and self.echo_first_token is not None:
            tokens.append(self.echo_first_token)
            token_logprobs.append(None)
            top_logprobs.append(None)
            entries = [*prompt_entries, *entries]
        tokens.extend(entry.token for entry in entries)
        token_logprobs.extend(_finite(entry.logprob) for entry in entries)
        top_logprobs.extend({top.token: _finite(top.logprob) for top in entry.top} for entry in entries)
        offsets = []
        for token in tokens:
            offsets.append(state.text_offset)
            state.text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}


def usage(finish: Finish) -> dict:
    return {"prompt_tokens": finish.prompt_tokens, "completion_tokens": finish.completion_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": finish.cached_prompt_tokens}}


def _chat_token(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def _finish_reason(finish: Finish, called_tools: bool) -> str:
    """OpenAI's: a choice that ended by itself after calling tools finished with "tool_calls"."""
    return "tool_calls" if called_tools and finish.reason is FinishReason.STOP else finish.reason.value


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


def _checked(finish: Finish) -> Finish:
    if finish.reason is FinishReason.ERROR:
        raise GenerationFailed("the request failed inside the cluster (scheduler or worker); see their logs")
    return finish
