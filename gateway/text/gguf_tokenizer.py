"""Build a `tokenizers.Tokenizer` from a GGUF file's metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, the merges, the token types and
the special token ids as metadata keys, and names the pre-tokenizer (`tokenizer.ggml.pre`) rather
than spelling it out. We rebuild the tokenizer the file describes from those keys.

Why not `gguf.GGUFReader`: it builds a numpy view per array element for the whole file, ~150k of
them for a 49k vocabulary, which takes 4-8 s. We only need the metadata section, so we walk it with
`struct` (the value types are the gguf package's `GGUFValueType`) and stop at the tensor table:
~0.3 s for SmolLM2.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp's token types (gguf.TokenType / llama_token_type)
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "B",
    gguf.GGUFValueType.INT8: "b",
    gguf.GGUFValueType.UINT16: "H",
    gguf.GGUFValueType.INT16: "h",
    gguf.GGUFValueType.UINT32: "I",
    gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.FLOAT32: "f",
    gguf.GGUFValueType.BOOL: "?",
    gguf.GGUFValueType.UINT64: "Q",
    gguf.GGUFValueType.INT64: "q",
    gguf.GGUFValueType.FLOAT64: "d",
}

# GPT-2's split: contractions, letters, numbers, other symbols, each with one optional leading space.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> the regexes llama.cpp (src/llama-vocab.cpp) splits with, applied in order.
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **{name: (_GPT2_SPLIT,) for name in ("gpt-2", "gpt2", "phi-2", "roberta-bpe", "olmo", "mpt", "jina-es", "jina-de")},
    **{name: (_LLAMA3_SPLIT,) for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx")},
    **{name: (_QWEN2_SPLIT,) for name in ("qwen2", "deepseek-r1-qwen")},
}
# The StarCoder family (SmolLM2 among them) isolates every digit before the GPT-2 split. llama.cpp
# writes that as a \p{N} split; we use the Digits pre-tokenizer of these models' own tokenizer.json,
# whose is_numeric() covers a few code points \p{N} misses. transformers' GGUF converter (5.x) drops
# this step, so it differs from the real tokenizer on a non-ASCII numeral after a space (" ½").
DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"})


def build_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer a tokenizer.ggml.pre name stands for (ends in the byte-level mapping)."""
    if pre in DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre not in PRE_TOKENIZER_SPLITS:
        supported = sorted(PRE_TOKENIZER_SPLITS.keys() | DIGITS_THEN_GPT2)
        raise ValueError(f"tokenizer.ggml.pre={pre!r} is not supported: must be one of {supported}")
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in PRE_TOKENIZER_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def read_gguf_metadata(path: str, prefixes: tuple[str, ...] = ("general.", "tokenizer.")) -> dict[str, object]:
    """The metadata key/values of a GGUF file whose key starts with one of `prefixes`.

    Arrays come back as lists (strings decoded as UTF-8); other keys are skipped without decoding.
    Never touches the tensor table or tensor data.
    """
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        magic, version, _tensor_count, kv_count = struct.unpack_from("<IIQQ", blob, 0)
        if magic != gguf.GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file: magic={magic:#x}, expected {gguf.GGUF_MAGIC:#x}")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version={version} is not supported: must be 2 or 3")
        pos = 24
        metadata: dict[str, object] = {}
        for _ in range(kv_count):
            key, pos = _read_string(blob, pos)
            (value_type,) = struct.unpack_from("<I", blob, pos)
            wanted = key.startswith(prefixes)
            value, pos = _read_value(blob, pos + 4, gguf.GGUFValueType(value_type), decode=wanted)
            if wanted:
                metadata[key] = value
        return metadata


def _read_string(blob: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    start = pos + 8
    return blob[start : start + length].decode("utf-8"), start + length


def _read_value(blob: mmap.mmap, pos: int, value_type: gguf.GGUFValueType, decode: bool) -> tuple[object, int]:
    """(value, position after it); with decode=False only the position is computed (value None)."""
    if value_type in _SCALAR_FORMATS:
        fmt = "<" + _SCALAR_FORMATS[value_type]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if value_type == gguf.GGUFValueType.STRING:
        (length,) = struct.unpack_from("<Q", blob, pos)
        value = blob[pos + 8 : pos + 8 + length].decode("utf-8") if decode else None
        return value, pos + 8 + length
    if value_type == gguf.GGUFValueType.ARRAY:
        element_type, count = struct.unpack_from("<IQ", blob, pos)
        element_type = gguf.GGUFValueType(element_type)
        pos += 12
        if element_type in _SCALAR_FORMATS:
            fmt = f"<{count}{_SCALAR_FORMATS[element_type]}"
            values = list(struct.unpack_from(fmt, blob, pos)) if decode else None
            return values, pos + struct.calcsize(fmt)
        values = [] if decode else None
        for _ in range(count):
            value, pos = _read_value(blob, pos, element_type, decode)
            if values is not None:
                values.append(value)
        return values, pos
    raise ValueError(f"GGUF metadata value type={value_type} is not supported")


@dataclass(frozen=True, slots=True)
class GgufTokenizerSpec:
    """What the rest of the gateway needs besides the `tokenizers.Tokenizer` itself."""

    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_id: int | None  # end of turn, where a file has one besides eos
    pad_token_id: int | None
    chat_template: str | None


SPM_SPACE = "\u2581"  # SentencePiece's visible space
# files without tokenizer.ggml.eot_token_id: the end-of-turn token is found by its text, as llama.cpp does
END_OF_TURN_TEXTS = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|end_of_turn|>", "<EOT>")


def build_gguf_tokenizer(metadata: dict[str, object]) -> GgufTokenizerSpec:
    """A `tokenizers.Tokenizer` from the metadata of a GGUF file (see read_gguf_metadata): byte-level
    BPE (tokenizer.ggml.model 'gpt2') or SentencePiece BPE with byte fallback ('llama': Llama 2,
    Mistral, Gemma, Phi-3)."""
    model = metadata.get("tokenizer.ggml.model")
    if model == "gpt2":
        tokenizer, tokens = _byte_level_bpe(metadata)
    elif model == "llama":
        tokenizer, tokens = _sentencepiece_bpe(metadata)
    else:
        raise ValueError(
            f"tokenizer.ggml.model={model!r} is not supported: must be 'gpt2' (byte-level BPE) or 'llama' (SentencePiece)"
        )
    bos_token_id = _optional_id(metadata, "tokenizer.ggml.bos_token_id")
    eos_token_id = _optional_id(metadata, "tokenizer.ggml.eos_token_id")
    tokenizer.post_processor = _special_token_template(
        tokens,
        bos_token_id if metadata.get("tokenizer.ggml.add_bos_token", model == "llama") else None,
        eos_token_id if metadata.get("tokenizer.ggml.add_eos_token", False) else None,
    )
    return GgufTokenizerSpec(
        tokenizer=tokenizer,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        eot_token_id=_end_of_turn_id(metadata, tokens),
        pad_token_id=_optional_id(metadata, "tokenizer.ggml.padding_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),  # type: ignore[arg-type]
    )


def _end_of_turn_id(metadata: dict[str, object], tokens: list[str]) -> int | None:
    explicit = _optional_id(metadata, "tokenizer.ggml.eot_token_id")
    if explicit is not None:
        return explicit
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or []  # type: ignore[assignment]
    marked = {index for index, kind in enumerate(token_types) if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)}
    by_text = {token: index for index, token in enumerate(tokens) if index in marked}
    return next((by_text[text] for text in END_OF_TURN_TEXTS if text in by_text), None)


def _add_typed_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int], usable) -> None:
    # Control tokens (<|im_start|>, <start_of_turn>, ...) are matched whole and are "special" (skipped
    # on decode); user-defined ones are matched whole but kept. Without this they would be cut into pieces.
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, token_type in zip(tokens, token_types)
            if token_type == TOKEN_TYPE_CONTROL and usable(token)
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, token_type in zip(tokens, token_types)
            if token_type == TOKEN_TYPE_USER_DEFINED and usable(token)
        ]
    )


def _sentencepiece_bpe(metadata: dict[str, object]) -> tuple[Tokenizer, list[str]]:
    """llama.cpp's SPM vocabulary (pieces with scores, <0xNN> byte tokens) as a BPE with byte fallback.

    llama.cpp merges the adjacent pair whose joined piece scores highest; a BPE whose merges are
    ranked by the joined piece's score does the same (how transformers converts SentencePiece BPE
    models). Spaces become U+2581; llama files prepend one to the text, gemma's do not
    (tokenizer.ggml.add_space_prefix)."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]  # type: ignore[assignment]
    scores: list[float] = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)  # type: ignore[assignment]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)  # type: ignore[assignment]
    vocab = {token: index for index, token in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score, token_type in zip(tokens, scores, token_types):
        if token_type != 1:  # only normal pieces are merge results
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    unk_id = _optional_id(metadata, "tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(models.BPE(
        vocab=vocab, merges=[(left, right) for *_, left, right in ranked],
        unk_token=None if unk_id is None else tokens[unk_id], fuse_unk=True, byte_fallback=True,
    ))
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    # one space before the text's first fragment only, not after each special token (llama.cpp's rule)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPM_SPACE, prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    _add_typed_tokens(tokenizer, tokens, token_types, lambda token: True)
    return tokenizer, tokens


def _byte_level_bpe(metadata: dict[str, object]) -> tuple[Tokenizer, list[str]]:
    pre = str(metadata.get("tokenizer.ggml.pre", "gpt-2"))
    if pre == "default":  # old files; llama.cpp then uses its own GPT-2-like split, we use GPT-2's
        pre = "gpt-2"
    pre_tokenizer = build_pre_tokenizer(pre)  # first, so an unknown name fails before the slow part
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]  # type: ignore[assignment]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)  # type: ignore[assignment]
    merge_lines: list[str] = metadata.get("tokenizer.ggml.merges", [])  # type: ignore[assignment]
    merges = [tuple(merge.split(" ", 1)) for merge in merge_lines]

    # Tokens are stored in GPT-2's byte alphabet already; a token using any other character (a
    # mislabelled control token) is respelled byte by byte so the vocabulary stays consistent.
    alphabet = _bytes_to_unicode()
    allowed = set(alphabet.values())
    vocab = {
        token if set(token) <= allowed else "".join(alphabet[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    _add_typed_tokens(tokenizer, tokens, token_types, lambda token: set(token) <= allowed and token in vocab)
    return tokenizer, tokens


def _optional_id(metadata: dict[str, object], key: str) -> int | None:
    value = metadata.get(key)
    return int(value) if value is not None else None  # type: ignore[arg-type]


def _special_token_template(tokens: list[str], bos_id: int | None, eos_id: int | None) -> processors.TemplateProcessing:
    """encode(add_special_tokens=True) adds BOS / EOS only where the file asks for them."""
    prefix = [tokens[bos_id]] if bos_id is not None else []
    suffix = [tokens[eos_id]] if eos_id is not None else []
    special = [(tokens[i], i) for i in {bos_id, eos_id} if i is not None]
    return processors.TemplateProcessing(
        single=prefix + ["$A"] + suffix,
        pair=prefix + ["$A"] + suffix + ["$B:1"] + suffix,
        special_tokens=special,
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping
