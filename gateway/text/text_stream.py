"""One request's token stream -> text stream: incremental detokenization, then stop strings."""
from __future__ import annotations

from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.stop_strings import StopStringMatcher
from gateway.text.tokenizer import TextTokenizer


class TextStream:
    def __init__(self, tokenizer: TextTokenizer, prompt_ids: list[int], stop: list[str]) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
        self.matcher = StopStringMatcher(stop) if stop else None
        self.stopped = False

    def push(self, token_ids: list[int]) -> str:
        """Text that is safe to show after these tokens; sets .stopped when a stop string matched."""
        text = self.detokenizer.push(token_ids)
        if self.matcher is None:
            return text
        text, self.stopped = self.matcher.push(text)
        return text

    def finish(self) -> str:
        """What was held back (an incomplete character, a possible stop-string start)."""
        if self.stopped:
            return ""
        text = self.detokenizer.finish()
        if self.matcher is None:
            return text
        text, self.stopped = self.matcher.push(text)
        return text if self.stopped else text + self.matcher.finish()

    @property
    def matched_stop(self) -> str:
        return (self.matcher.matched or "") if self.matcher else ""
