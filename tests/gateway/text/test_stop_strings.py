from hypothesis import given, settings
from hypothesis import strategies as st

import pytest

from gateway.text.stop_strings import StopStringMatcher


def reference_cut(text: str, stop: list[str]) -> tuple[str, str | None]:
    """Scan ends left to right; the first end where a stop string ends (longest wins) cuts the text."""
    for end in range(1, len(text) + 1):
        completed = [s for s in stop if text[:end].endswith(s)]
        if completed:
            longest = max(completed, key=len)
            return text[: end - len(longest)], longest
    return text, None


def stream(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, bool]:
    emitted, stopped = [], False
    for delta in deltas:
        text, stopped = matcher.push(delta)
        emitted.append(text)
    emitted.append(matcher.finish())
    return "".join(emitted), stopped


def test_stop_string_spanning_deltas_is_held_then_cut():
    matcher = StopStringMatcher(["<|end|>"])
    assert matcher.push("Hello <") == ("Hello ", False)
    assert matcher.push("|end") == ("", False)
    assert matcher.push("|> trailing") == ("", True)
    assert matcher.matched == "<|end|>"
    assert matcher.push("more") == ("", True)
    assert matcher.finish() == ""


def test_held_tail_is_released_when_it_stops_matching():
    matcher = StopStringMatcher(["<|end|>"])
    assert matcher.push("a <|en") == ("a ", False)
    assert matcher.push("try") == ("<|entry", False)
    assert matcher.push(" <") == (" ", False)
    assert matcher.finish() == "<"


def test_earliest_completed_stop_string_wins():
    assert StopStringMatcher(["world", "lo w"]).push("hello world") == ("hel", True)
    # "bc" completes before "abcd" could: streaming cannot wait for a longer match to finish
    assert StopStringMatcher(["abcd", "bc"]).push("xabcd") == ("xa", True)
    # both end at the same place: the longer one cuts earlier
    assert StopStringMatcher(["c", "abc"]).push("xabc") == ("x", True)


def test_include_stop_string():
    matcher = StopStringMatcher(["STOP"], include_stop_string=True)
    assert matcher.push("go ST") == ("go ", False)
    assert matcher.push("OP now") == ("STOP", True)


def test_no_stop_strings_passes_everything_through():
    matcher = StopStringMatcher([])
    assert matcher.push("anything") == ("anything", False)
    assert matcher.finish() == ""


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        StopStringMatcher(["ok", ""])


_alphabet = st.sampled_from("ab😀\n")


@settings(max_examples=500, deadline=None)
@given(
    text=st.text(_alphabet, max_size=30),
    stop=st.lists(st.text(_alphabet, min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_any_split_into_deltas_gives_the_whole_text_result(text, stop, cuts):
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    matcher = StopStringMatcher(stop)
    expected_text, expected_stop = reference_cut(text, stop)
    assert stream(matcher, deltas) == (expected_text, expected_stop is not None)
    assert matcher.matched == expected_stop
