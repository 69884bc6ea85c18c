"""One request's GenerationDeltas -> OpenAI response JSON: a whole response, or stream chunks.

    builder = ResponseBuilder(chat=True, request_id=..., model=..., logprobs=None, include_usage=False)
    for delta in deltas: builder.add(delta)          # then builder.body()
    # or, streaming: for delta in deltas: chunks = builder.chunks(delta); then builder.usage_chunk()

Text is exactly what stream_generation produced, so the concatenated stream deltas equal the
non-streaming text. finish_reason is "stop" or "length" (or vLLM's "abort" when the request was
cancelled from elsewhere); a request that failed inside the cluster raises GenerationFailed.
"""
from __future__ import annotations

import math
import time

from gateway.generation_stream import Finish, GenerationDelta, TokenLogprob
from core.errors import ServingError
from core.outputs import FinishReason

_MIN_LOGPROB = -9999.0  # JSON has no -Infinity; vLLM reports impossible tokens with this value


class GenerationFailed(ServingError):
    """The scheduler or worker ended the request with an error (HTTP 500)."""


class ResponseBuilder:
    def __init__(self, *, chat: bool, request_id: str, model: str, logprobs: int | None,
                 include_usage: bool = False, echo: str = "", echo_first_token: str | None = None) -> None:
        self.chat = chat
        self.request_id = request_id
        self.model = model
        self.logprobs = logprobs  # None: the request asked for none
        self.include_usage = include_usage
        self.created = int(time.time())
        self.text_parts: list[str] = []
        self.token_logprobs: list[TokenLogprob] = []
        self.finish: Finish | None = None
        self._text_offset = 0  # completions logprobs: where the next token's text starts
        self._sent_role = False
        self.echo = echo  # completions echo: the prompt text, before the first text of the completion
        # completions echo with logprobs: the first prompt token's text (it has no logprob), and the
        # other prompt tokens' logprobs once they arrive (with the first token)
        self.echo_first_token = echo_first_token
        self.prompt_logprobs: list[TokenLogprob] = []

    # -- whole response ------------------------------------------------------------------------------

    def add(self, delta: GenerationDelta) -> None:
        self.text_parts.append(delta.text)
        self.token_logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish is not None:
            self.finish = _checked(delta.finish)

    def body(self) -> dict:
        assert self.finish is not None, "body() before the last delta"
        text = self.echo + "".join(self.text_parts)
        choice: dict = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(self.token_logprobs, self.prompt_logprobs)
        choice["finish_reason"] = self.finish.reason.value
        choice["stop_reason"] = self.finish.matched_stop or None  # vLLM's field: the stop string that matched
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage(self.finish)}

    # -- streaming --------------------------------------------------------------------------------------

    def chunks(self, delta: GenerationDelta) -> list[dict]:
        """The chunks to send for this delta (none while text is held back and nothing else is new)."""
        out = []
        if self.chat and not self._sent_role:
            self._sent_role = True
            out.append(self._chunk({"role": "assistant", "content": ""}, None, None))
        finish = _checked(delta.finish) if delta.finish is not None else None
        text, self.echo = self.echo + delta.text, ""  # an echoed prompt goes out with the first chunk
        if text or delta.logprobs or finish is not None:
            content = ({"content": text} if text or finish is None else {}) if self.chat else text
            out.append(self._chunk(content, self._logprobs(delta.logprobs, delta.prompt_logprobs), finish))
        return out

    def usage_chunk(self, finish: Finish) -> dict:
        """stream_options.include_usage: the last chunk, with usage and no choices."""
        return {**self._head(self._chunk_object), "choices": [], "usage": usage(finish)}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, content: dict | str, logprobs: dict | None, finish: Finish | None) -> dict:
        choice: dict = {"index": 0, ("delta" if self.chat else "text"): content, "logprobs": logprobs,
                        "finish_reason": finish.reason.value if finish else None}
        if finish is not None:
            choice["stop_reason"] = finish.matched_stop or None
        chunk = {**self._head(self._chunk_object), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI: null on every chunk but the last
        return chunk

    def _head(self, kind: str) -> dict:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    # -- logprobs -----------------------------------------------------------------------------------------

    def _logprobs(self, entries: list[TokenLogprob], prompt_entries: list[TokenLogprob] | None = None) -> dict | None:
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
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}


def usage(finish: Finish) -> dict:
    return {"prompt_tokens": finish.prompt_tokens, "completion_tokens": finish.completion_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": finish.cached_prompt_tokens}}


def _chat_token(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


def _checked(finish: Finish) -> Finish:
    if finish.reason is FinishReason.ERROR:
        raise GenerationFailed("the request failed inside the cluster (scheduler or worker); see their logs")
    return finish
