"""Incremental detokenization on the default model's real byte-level vocabulary."""
import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.text.detokenizer import CONTEXT_TOKENS, MAX_HELD_TOKENS, IncrementalDetokenizer
from gateway.text.gguf_tokenizer import _bytes_to_unicode
from gateway.text.tokenizer import load_tokenizer

MULTIBYTE_TEXT = "😀👍🏽🇫🇷 日本語 中文 한국어 naïve ½ ∑ 𝟙 — “quotes”"


@functools.cache
def tokenizer():
    return load_tokenizer(None)


@functools.cache
def byte_token_ids() -> dict[int, int]:
    """byte -> id of its single-byte token (SmolLM2 lacks a few: C0, C1, F5..FF, some controls)."""
    alphabet = _bytes_to_unicode()
    ids = {b: tokenizer().token_to_id(alphabet[b]) for b in range(256)}
    return {b: token_id for b, token_id in ids.items() if token_id is not None}


def has_byte_tokens(text: str) -> bool:
    return all(b in byte_token_ids() for b in text.encode("utf-8"))


def ids_of_bytes(data: bytes) -> list[int]:
    return [byte_token_ids()[b] for b in data]


def run(detokenizer: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    deltas = [detokenizer.push(chunk) for chunk in chunks]
    return deltas + [detokenizer.finish()]


def chunked(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


# Ids that exercise the hard cases: single bytes (split characters), pieces of emoji/CJK, specials.
_any_id = st.one_of(
    st.sampled_from(sorted(byte_token_ids().values())),
    st.sampled_from(sorted(set(load_tokenizer(None).encode(MULTIBYTE_TEXT, False)))),
    st.sampled_from([0, 1, 2]),
    st.integers(min_value=0, max_value=49151),
)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(_any_id, max_size=40), cuts=st.lists(st.integers(0, 40), max_size=10), skip=st.booleans())
def test_deltas_concatenate_to_full_decode(ids, cuts, skip):
    deltas = run(IncrementalDetokenizer(tokenizer(), None, skip_special_tokens=skip), chunked(ids, cuts))
    assert "".join(deltas) == tokenizer().decode(ids, skip_special_tokens=skip)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=30).filter(has_byte_tokens), cuts=st.lists(st.integers(0, 200), max_size=10))
def test_valid_text_byte_by_byte_never_emits_a_broken_character(text, cuts):
    ids = ids_of_bytes(text.encode("utf-8"))
    deltas = run(IncrementalDetokenizer(tokenizer()), chunked(ids, cuts))
    assert "".join(deltas) == text
    assert not any("\ufffd" in delta for delta in deltas if "\ufffd" not in text)


@settings(max_examples=100, deadline=None)
@given(prompt=st.lists(_any_id, max_size=12), ids=st.lists(_any_id, max_size=20))
def test_prompt_context_does_not_change_the_output_text(prompt, ids):
    deltas = run(IncrementalDetokenizer(tokenizer(), prompt), [[i] for i in ids])
    assert "".join(deltas) == tokenizer().decode(ids)


def test_emoji_split_into_bytes_is_held_until_complete():
    detokenizer = IncrementalDetokenizer(tokenizer())
    emoji_bytes = "😀".encode("utf-8")
    assert [detokenizer.push(ids_of_bytes(emoji_bytes[i : i + 1])) for i in range(4)] == ["", "", "", "😀"]
    assert detokenizer.push(tokenizer().encode(" ok", False)) == " ok"
    assert detokenizer.finish() == ""


def test_finish_releases_an_incomplete_character():
    detokenizer = IncrementalDetokenizer(tokenizer())
    assert detokenizer.push(tokenizer().encode("a", False)) == "a"
    assert detokenizer.push(ids_of_bytes(b"\xe4\xb8")) == ""  # first two bytes of 中
    assert detokenizer.finish() == "\ufffd"


class CountingDecoder:
    """Records how many ids each decode call sees."""

    def __init__(self, inner):
        self.inner = inner
        self.window_sizes: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.window_sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_cost_per_token_does_not_grow_with_output_length():
    text = ("The quick brown fox 🦊 jumps over the lazy dog; 日本語のテキスト. " * 60).encode("utf-8")
    ids = tokenizer().encode(text.decode(), False) + ids_of_bytes(text[:400])  # words, then raw bytes
    counting = CountingDecoder(tokenizer())
    detokenizer = IncrementalDetokenizer(counting, prompt_ids=list(range(100, 200)))
    for token_id in ids:
        detokenizer.push([token_id])
    detokenizer.finish()
    assert len(ids) > 1000
    assert max(counting.window_sizes) <= CONTEXT_TOKENS + 4  # context plus a 4-byte character
    assert len(counting.window_sizes) <= 2 * len(ids) + 4  # two window decodes per token


def test_runs_that_never_end_a_character_keep_a_bounded_window():
    # "ĠÂ" is a space followed by a UTF-8 lead byte: every decode ends in U+FFFD, forever.
    space_lead = tokenizer().token_to_id("ĠÂ")
    counting = CountingDecoder(tokenizer())
    detokenizer = IncrementalDetokenizer(counting)
    deltas = run(detokenizer, [[space_lead]] * 200)
    assert "".join(deltas) == tokenizer().decode([space_lead] * 200) == " \ufffd" * 200
    assert max(counting.window_sizes) <= CONTEXT_TOKENS + MAX_HELD_TOKENS + 1


def emitted_after_each_token(ids: list[int], chunks: list[list[int]]) -> dict[int, str]:
    """The text emitted once each chunk's last token was pushed, keyed by the number of tokens pushed."""
    detokenizer, text, pushed, emitted = IncrementalDetokenizer(tokenizer(), None), "", 0, {}
    for chunk in chunks:
        text += detokenizer.push(chunk)
        pushed += len(chunk)
        emitted[pushed] = text
    return emitted


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(_any_id, max_size=40), cuts=st.lists(st.integers(0, 40), max_size=10))
def test_the_text_emitted_after_n_tokens_does_not_depend_on_how_they_were_chunked(ids, cuts):
    """A resumed stream (gateway/generation/resume.py) decodes the tokens its client already has in the
    token stream's chunks, then sends the text of the rest: that is the client's text only if the text out
    after N tokens is the same however the N arrived (the first gateway pushed them in other deltas)."""
    one_at_a_time = emitted_after_each_token(ids, [[token] for token in ids])
    for pushed, text in emitted_after_each_token(ids, chunked(ids, cuts)).items():
        assert text == one_at_a_time.get(pushed, ""), pushed


def test_a_character_before_a_run_of_broken_bytes_comes_out_with_it_whatever_the_chunks():
    """The case CI's gateway-kill test hit: "1" then more stray continuation bytes than are held; pushed
    one by one, "1" goes out at once; pushed together, it was held with the run (no safe split after it)."""
    ids = [tokenizer().token_to_id("1")] + ids_of_bytes(b"\x80" * (MAX_HELD_TOKENS + 2))
    assert emitted_after_each_token(ids, [ids]) == {len(ids): emitted_after_each_token(ids, [[t] for t in ids])[len(ids)]}
