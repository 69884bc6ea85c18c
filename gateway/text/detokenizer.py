"""Incremental detokenization: text deltas as tokens arrive, at a cost per token independent of length.

Decoding the whole output on every token costs O(n) per token (O(n^2) per request). Instead we
decode a small sliding window, as vLLM and TGI do:

    window:  [0 ......... read_offset ......... len(window)]
              \\_ emitted _/ \\_ not emitted yet _/
    (everything before the window was emitted earlier and is dropped)

    prefix_text = decode(window[:read_offset])
    new_text    = decode(window)
    delta       = new_text[len(prefix_text):]

The window starts a few tokens back so that decoders which depend on context (SentencePiece's
leading space) see the same context as a full decode. A delta is held back while new_text ends in
U+FFFD: the last token ended in the middle of a UTF-8 character, and the next token may complete
it. An emitted boundary is therefore always a character boundary, and UTF-8 is self-synchronizing,
so for byte-level tokenizers the deltas concatenate to exactly decode(all output ids).
"""
from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# At most this many emitted tokens stay in the window as decoding context (vLLM starts with 5).
CONTEXT_TOKENS = 5
# A character is at most 4 bytes, so at most 4 tokens; holding more means invalid bytes.
MAX_HELD_TOKENS = 8


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """push(new_ids) -> the text they add; finish() -> whatever was held back at the end."""

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-CONTEXT_TOKENS:]) if prompt_ids else []
        # A context ending mid-character would let the first output token complete a character
        # that began in the prompt; decoding the output alone never sees that character.
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []
        # The window: tokens[:read_offset] were emitted (decode context), the rest are held back.
        self._tokens: list[int] = context
        self._read_offset = len(context)

    def push(self, new_ids: list[int]) -> str:
        """Accept newly generated ids; return the text that is now certain (may be "").

        The text out after N tokens does not depend on how they were split into pushes: a resumed stream
        (gateway/generation/resume.py) decodes its client's tokens in other chunks than the first gateway
        did, and sends only what comes after. A chunk whose end settles everything gives what pushing its
        tokens one at a time gives; one that ends held (mid-character) goes one token at a time, so that
        the text before its held tail comes out as it would have (not held with the tail)."""
        if len(new_ids) > 1:
            prefix_text = self._decode(self._tokens[: self._read_offset])
            new_text = self._decode(self._tokens + new_ids)
            if not new_text.endswith(REPLACEMENT_CHAR) and new_text.startswith(prefix_text):
                self._tokens.extend(new_ids)
                return self._emit(prefix_text, new_text, len(self._tokens))
        text = ""
        for token in new_ids:
            self._tokens.append(token)
            text += self._advance(final=False)
        return text

    def finish(self) -> str:
        """End of generation: release any held text, incomplete characters included (as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._tokens):
            return ""
        prefix_text = self._decode(self._tokens[: self._read_offset])
        new_text = self._decode(self._tokens)
        if final or (not new_text.endswith(REPLACEMENT_CHAR) and new_text.startswith(prefix_text)):
            return self._emit(prefix_text, new_text, len(self._tokens))
        # Only invalid byte runs (never valid text) hold this many tokens; emit up to a point where
        # splitting cannot change the decode, so the window stays small.
        if len(self._tokens) - self._read_offset > MAX_HELD_TOKENS:
            split = self._last_safe_split()
            if split is not None:
                return self._emit(prefix_text, self._decode(self._tokens[:split]), split)
        return ""  # hold: the last character is incomplete (or the decoder is not yet stable)

    def _emit(self, prefix_text: str, text: str, end: int) -> str:
        """Emit text (the decode of tokens[:end]) past prefix_text; the tokens just emitted become the context."""
        delta = text[len(prefix_text) :]
        # Cutting the context anywhere is safe: leading partial bytes decode to the same U+FFFD in
        # prefix_text and new_text, and read_offset stays a point where decoding restarts.
        context_start = max(self._read_offset, end - CONTEXT_TOKENS)
        del self._tokens[:context_start]  # older tokens are never decoded again
        self._read_offset = end - context_start
        return delta

    def _last_safe_split(self) -> int | None:
        """The last held index whose token starts with a whole character (ASCII or a full UTF-8 sequence).

        A UTF-8 decoder restarts at a non-continuation byte whatever came before, so there
        decode(a + b) == decode(a) + decode(b). A token starting with a continuation byte decodes alone
        to U+FFFD first; so does one starting with a bare lead byte, which we skip to stay safe.
        """
        for index in range(len(self._tokens) - 1, self._read_offset, -1):
            piece = self._decode([self._tokens[index]])
            if piece and not piece.startswith(REPLACEMENT_CHAR):
                return index
        return None

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
