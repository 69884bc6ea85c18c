"""Constrained decoding's grammar engine (llguidance), shared by the gateway and the worker.

The gateway checks each request's OutputConstraint with check_for_worker() in a helper process
(plumbing.grammar_sandbox): a malformed schema, regex or grammar is InvalidArgument naming the problem,
before any compute. The worker compiles each
constraint against the model's vocabulary (GrammarCompiler, cached by content) into an llguidance
matcher per request, which masks the tokens that would break it before every sampling step.

Why llguidance: scripts/bench_grammar_engines.py on this machine (SmolLM2's 49152-token vocabulary,
a 780-character order schema with nested objects, arrays, enums, bounds and a pattern): llguidance
compiles it in ~2 ms with a ~0.1 ms mean mask per step; xgrammar compiles in ~20 ms with a ~0.01 ms
mask but needs transformers and apache-tvm-ffi at run time; outlines-core takes ~630 ms to compile.
A request's compile sits on its first step, a mask is a fraction of a percent of a CPU decode step,
and llguidance is one dependency-free wheel (it is also vLLM's "guidance" backend).

Both sides translate a constraint the same way (to_grammar), so what the gateway accepts the worker
compiles: JSON schema and any-JSON through llguidance's JSON compiler (compact separators, no free
whitespace: a small model left free to emit whitespace can spend its whole budget on it), regex and
Lark as they are, GBNF through llguidance's converter, a choice as a Lark alternation of literals.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from core.errors import InvalidArgument
from core.sampling import ConstraintKind, OutputConstraint
from plumbing.constraint_limits import check_limits, is_gbnf
from plumbing.schema_satisfiable import has_finite_instance

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's own bounds on a grammar's size, its lexer's states and the work of one mask: the
    same for the gateway's check and the worker's matchers, so what was checked is what runs. A mask
    step past its fuel fails that request's matcher (the request ends), never stalls the step."""
    return llguidance.LLParserLimits(max_grammar_size=200_000, max_lexer_states=100_000,
                                     initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                                     step_max_items=50_000, verbose_errors=False)


def to_grammar(constraint: OutputConstraint) -> str:
    """llguidance's grammar text for constraint. Raises InvalidArgument for a schema that is not JSON
    (the other checks need the compiler: check_for_worker)."""
    kind, value = constraint.kind, constraint.value
    if kind is ConstraintKind.JSON_SCHEMA:
        try:
            schema = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise InvalidArgument("json_schema", _short(value), f"is not JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidArgument("json_schema", _short(value), "must be a JSON object (or true/false)")
        return _json_grammar(schema, "json_schema", value)
    if kind is ConstraintKind.JSON_OBJECT:
        return _json_grammar({"type": "object"}, "json_object", "")
    if kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind is ConstraintKind.CHOICE:
        alternatives = " | ".join(json.dumps(choice) for choice in constraint.choices)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    if kind is ConstraintKind.GRAMMAR:
        return llguidance.LLMatcher.grammar_from_lark(as_lark(constraint).value)
    raise ValueError(f"to_grammar: unknown constraint kind {kind!r}")


def as_lark(constraint: OutputConstraint) -> OutputConstraint:
    """A GBNF grammar as the Lark grammar it converts to (the same language); any other constraint as
    it is. The gateway forwards this, so GBNF's conversion (pure Python, seconds for a large grammar:
    it holds the GIL) runs once, in its helper process, never on a worker beside the model."""
    if constraint.kind is not ConstraintKind.GRAMMAR or not is_gbnf(constraint.value):
        return constraint
    try:
        return OutputConstraint(ConstraintKind.GRAMMAR, gbnf_to_lark(constraint.value))
    except Exception as exc:  # the converter raises its own error types on bad GBNF
        raise InvalidArgument("grammar", _short(constraint.value), f"is not a valid GBNF grammar: {exc}") from None


def _json_grammar(schema: object, field: str, value: str) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except Exception as exc:  # llguidance raises ValueError on schemas it cannot compile
        raise InvalidArgument(field, _short(value), f"is not a JSON schema this server supports: {exc}") from None


def check_for_worker(constraint: OutputConstraint, vocabulary: llguidance.LLTokenizer) -> OutputConstraint:
    """The constraint a worker will compile (GBNF as Lark), after compiling it exactly as the worker will;
    InvalidArgument naming the kind and the problem or limit otherwise. Runs the compiler: serving
    processes call it only in a helper process (plumbing.grammar_helper), never inline."""
    check_limits(constraint)
    if constraint.kind is ConstraintKind.JSON_SCHEMA and not has_finite_instance(json.loads(constraint.value)):
        raise InvalidArgument("json_schema", _short(constraint.value), "is unsatisfiable: no finite JSON matches it "
                              "(a $ref loop every way out of which is required)")
    forwarded = as_lark(constraint)  # GBNF converted once, here
    compile_matcher(vocabulary, forwarded)
    return forwarded


def _short(value: object, limit: int = 200) -> object:
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + "..."
    return value


def load_vocabulary(model_path: str | Path) -> llguidance.LLTokenizer:
    """The model's vocabulary as llguidance needs it: a Hugging Face folder's tokenizer.json, or the
    token list of a GGUF file (byte-level BPE or SentencePiece pieces; control tokens marked special)."""
    path = Path(model_path)
    if path.is_dir():
        return llguidance.LLTokenizer((path / "tokenizer.json").read_text(encoding="utf-8"))
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_GgufVocabulary(path)))


class _GgufVocabulary:
    """What llguidance.TokenizerWrapper reads: tokens as bytes, eos/bos, and a tokenize function (used
    only for forced-token look-ahead, so a greedy longest match is enough)."""

    def __init__(self, path: Path) -> None:
        fields = _read_gguf_tokenizer_fields(path)
        model = fields["tokenizer.ggml.model"]
        pieces = fields["tokenizer.ggml.tokens"]
        types = fields.get("tokenizer.ggml.token_type", [])
        self.eos_token_id = int(fields["tokenizer.ggml.eos_token_id"])
        bos = fields.get("tokenizer.ggml.bos_token_id")
        self.bos_token_id = None if bos is None else int(bos)
        byte_decoder = {char: byte for byte, char in _bytes_to_unicode().items()}
        self.tokens: list[bytes] = []
        for index, piece in enumerate(pieces):
            token_type = types[index] if index < len(types) else 1
            if token_type == 3:  # control: never text
                self.tokens.append(b"\xff" + piece.encode("utf-8"))
            elif model == "gpt2":
                self.tokens.append(bytes(byte_decoder.get(char, 0) for char in piece))
            elif token_type == 6 and piece.startswith("<0x"):  # SentencePiece byte fallback
                self.tokens.append(bytes([int(piece[3:-1], 16)]))
            else:
                self.tokens.append(piece.replace("\u2581", " ").encode("utf-8"))
        self.special_token_ids = [i for i, t in enumerate(types) if t == 3]
        self._ids = {token: i for i, token in reversed(list(enumerate(self.tokens))) if token}
        self._longest = max(len(token) for token in self.tokens)

    def __call__(self, text: bytes) -> list[int]:
        ids, position = [], 0
        while position < len(text):
            for length in range(min(self._longest, len(text) - position), 0, -1):
                token_id = self._ids.get(text[position : position + length])
                if token_id is not None:
                    ids.append(token_id)
                    position += length
                    break
            else:
                position += 1  # a byte no token spells (not in a byte-level vocabulary)
        return ids


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _read_gguf_tokenizer_fields(path: Path) -> dict[str, object]:
    """The tokenizer.* metadata of a GGUF file, read straight from its header (gguf.GGUFReader also
    parses every tensor's info: seconds on a small machine, for a list we read in milliseconds)."""
    import mmap
    import struct

    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        if blob[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _, _, num_fields = struct.unpack_from("<IQQ", blob, 4)
        position = 24

        def read(value_type: int):
            nonlocal position
            if value_type == 8:  # string
                (length,) = struct.unpack_from("<Q", blob, position)
                position += 8 + length
                return blob[position - length : position].decode("utf-8", errors="replace")
            if value_type == 9:  # array
                item_type, count = struct.unpack_from("<IQ", blob, position)
                position += 12
                return [read(item_type) for _ in range(count)]
            fmt = _GGUF_SCALARS[value_type]
            (value,) = struct.unpack_from(fmt, blob, position)
            position += struct.calcsize(fmt)
            return value

        fields: dict[str, object] = {}
        for _ in range(num_fields):
            key = read(8)
            (value_type,) = struct.unpack_from("<I", blob, position)
            position += 4
            value = read(value_type)
            if key.startswith("tokenizer.ggml."):
                fields[key] = value
        return fields


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table of byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


class GrammarCompiler:
    """Compiles constraints against one vocabulary, each distinct constraint once (an LRU of compiled
    matchers; a request gets a deep copy). Thread-safe; the vocabulary loads on first use.

    The compile runs on a thread of its own with a 64 MiB stack: the compiler recurses once per level
    of a grammar's rule chaining, and the gateway's check (plumbing.grammar_sandbox) proved each
    constraint compiles on an 8 MiB stack, so what reaches a worker has 8x the stack it needed."""

    COMPILE_STACK_BYTES = 64 << 20

    def __init__(self, model_path: str | Path, max_cached: int = 256) -> None:
        self.model_path = model_path
        self.max_cached = max_cached
        self._vocabulary: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[OutputConstraint, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    @property
    def vocabulary(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._vocabulary is None:
                self._vocabulary = load_vocabulary(self.model_path)
            return self._vocabulary

    def matcher(self, constraint: OutputConstraint) -> llguidance.LLMatcher:
        """A fresh matcher at the start of constraint. Raises InvalidArgument if it does not compile."""
        vocabulary = self.vocabulary
        with self._lock:
            template = self._compiled.get(constraint)
            if template is not None:
                self._compiled.move_to_end(constraint)
                return template.deep_copy()
        template = run_with_stack(lambda: compile_matcher(vocabulary, constraint), self.COMPILE_STACK_BYTES)
        with self._lock:
            self.num_compiled += 1
            self._compiled[constraint] = template
            while len(self._compiled) > self.max_cached:
                self._compiled.popitem(last=False)
        return template.deep_copy()


def compile_matcher(vocabulary: llguidance.LLTokenizer, constraint: OutputConstraint) -> llguidance.LLMatcher:
    """constraint's matcher at its start, under parser_limits(). Raises InvalidArgument naming its kind
    when it does not compile, or when no output can satisfy it: a schema whose
    every branch recurses forever ({"$ref": "#"}) leaves no token allowed at the start, and the client
    would otherwise get an empty, unparsable 200."""
    name = constraint.kind.value
    shown = _short(constraint.value or list(constraint.choices))
    matcher = llguidance.LLMatcher(vocabulary, to_grammar(constraint), log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise InvalidArgument(name, shown, f"is invalid: {matcher.get_error()}")
    probe = matcher.deep_copy()
    mask = bytearray(probe.compute_bitmask())  # one bit per token of the vocabulary
    eos = vocabulary.eos_token
    mask[eos // 8] &= ~(1 << (eos % 8)) & 0xFF  # ending at once satisfies it only if it accepts ""
    if probe.is_error() or not (any(mask) or probe.is_accepting()):
        raise InvalidArgument(name, shown, "is unsatisfiable: no output can match it (every way to start it "
                              "recurses forever or contradicts itself)")
    return matcher


def run_with_stack(work, stack_bytes: int):
    """work() on a fresh thread with stack_bytes of stack; its result, or its exception re-raised."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["result"] = work()
        except BaseException as error:  # noqa: BLE001 - handed back to the caller's thread
            outcome["error"] = error

    with _STACK_SIZE_LOCK:  # threading.stack_size is process-wide: set, start, restore
        previous = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["result"]


_STACK_SIZE_LOCK = threading.Lock()
