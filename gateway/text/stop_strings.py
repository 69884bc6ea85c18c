"""Stop strings on streamed text: cut the output where a stop string first completes.

Text arrives in deltas, and a stop string may span several of them ("<|" + "end|>"), so a tail that
could still become a stop string is held back until the next delta settles it:

    emitted ........................ | held tail (a prefix of some stop string)

The result does not depend on how the text was split into deltas: the output ends where the first
stop string to complete (earliest end; of those, the longest) begins, as if matched on the whole text.
"""
from __future__ import annotations


class StopStringMatcher:
    """push(delta) -> (text_to_emit, stopped); finish() -> the held tail when generation ends."""

    def __init__(self, stop: list[str], include_stop_string: bool = False):
        if any(not s for s in stop):
            raise ValueError(f"stop={stop!r} holds an empty string: every stop string must be non-empty")
        self._stop = tuple(dict.fromkeys(stop))
        self._include_stop_string = include_stop_string
        self._held = ""  # text not yet emitted: the longest suffix that could start a stop string
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the output

    def push(self, delta: str) -> tuple[str, bool]:
        """Accept the next piece of generated text; return what can be emitted and whether to stop."""
        if self.stopped:
            return "", True
        text = self._held + delta
        match = self._first_completed(text)
        if match is not None:
            start, stop = match
            self.stopped, self.matched, self._held = True, stop, ""
            end = start + len(stop) if self._include_stop_string else start
            return text[:end], True
        keep = self._partial_match_length(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def finish(self) -> str:
        """Generation ended without a stop string: the held tail is plain text after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_completed(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the stop string that completes first in text, or None.

        Every match lies inside text: the held tail starts where the earliest possible match does.
        """
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stop:
            start = text.find(stop)
            if start >= 0:
                candidate = (start + len(stop), -len(stop), stop)
                best = candidate if best is None else min(best, candidate)
        return None if best is None else (best[0] + best[1], best[2])

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        longest = min(len(text), max((len(s) for s in self._stop), default=1) - 1)
        for length in range(longest, 0, -1):
            suffix = text[-length:]
            if any(stop.startswith(suffix) for stop in self._stop):
                return length
        return 0
