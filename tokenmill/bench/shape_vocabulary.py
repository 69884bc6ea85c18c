"""The byte-level BPE vocabulary a random-weight shape file carries (scripts/peers/make_shapes.py): GPT-2's
byte alphabet, one token per benchmark prompt word (so a prompt's length in tokens is what the workload
asked for), fillers, the model's own special tokens and padding up to its vocabulary size."""
from __future__ import annotations

from dataclasses import dataclass

from gguf import TokenType

from tokenmill.bench.workload import WORDS


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]
    types: list[int]
    merges: list[str]

    def id(self, text: str) -> int:
        return self.tokens.index(text)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {byte: chr(byte) for byte in printable}
    for shifted, byte in enumerate(byte for byte in range(256) if byte not in mapping):
        mapping[byte] = chr(256 + shifted)
    return mapping


def vocabulary(model) -> Vocabulary:
    """Byte tokens, the prompt words' chain tokens, fillers, the model's specials, [PAD]s: model.vocab tokens.
    model: make_shapes' ModelShape (name, vocab, specials as (text, TokenType), pads)."""
    alphabet = bytes_to_unicode()
    tokens = [alphabet[byte] for byte in range(256)]
    merges: list[str] = []
    space = alphabet[ord(" ")]
    for word in WORDS:  # " word" -> Ġw, Ġwo, ... Ġword: each prompt word (after the first) is one token
        piece = space
        for letter in word:
            if piece + letter not in tokens:
                merges.append(f"{piece} {letter}")
                tokens.append(piece + letter)
            piece += letter
    num_ordinary = model.vocab - len(model.specials) - model.pads
    if num_ordinary < len(tokens):
        raise ValueError(f"--vocab {model.vocab} is too small: {model.name} needs at least "
                         f"{len(tokens) + len(model.specials) + model.pads}")
    types = [TokenType.NORMAL] * len(tokens)
    tokens += [f"<filler_{i}>" for i in range(len(tokens), num_ordinary)]
    types += [TokenType.NORMAL] * (num_ordinary - len(types))
    tokens += [text for text, _ in model.specials]
    types += [kind for _, kind in model.specials]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), model.vocab)]
    types += [TokenType.UNUSED] * (model.vocab - len(types))
    return Vocabulary(tokens, [int(kind) for kind in types], merges)
