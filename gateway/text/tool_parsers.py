"""Tool calls in a model's output text -> OpenAI tool_calls, whole or as streamed deltas.

    stream = HermesCallStream()           # or Llama3JsonCallStream()
    for text in deltas: events = stream.feed(text)   # str: content to show; CallDelta: a piece of a call
    events = stream.finish()
    parsed = parse_tool_calls(HermesCallStream, text)    # ParsedOutput(content or None, [ToolCall, ...])

Two syntaxes, the ones the models the loader supports are trained on:
  hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, any number, with text
               around them (Qwen2.5, Hermes; also our fallback prompt for templates without tools)
  llama3_json  {"name": "f", "parameters": {...}}, several separated by ";", at the start of the output,
               after an optional <|python_tag|> (Llama 3.1+); text after the calls is content
A call is a JSON object with a string "name" and an object "arguments" (either syntax may use either key,
"parameters" or "arguments"; none means {}). Its arguments string is the object's text exactly as the model
wrote it. A block that is not such an object stays in the content, verbatim.

The whole-text parse is the stream fed at once, so the streamed content and the calls rebuilt from the deltas
equal the whole response. One difference: a stream sends a call's name once it is read and the arguments
object has begun, then the arguments as they arrive (as OpenAI does), so a call whose arguments turn out not
to be JSON (or are cut off by max_tokens) cannot be taken back; the whole response, which sees the end
first, leaves such a block in the content.
Content is the text outside the calls with leading and trailing whitespace removed (the stream holds
whitespace back until text follows it).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\r\n"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = field(default_factory=new_call_id)


@dataclass(slots=True)
class CallDelta:
    """A piece of call `index`: the first carries id and name (and arguments ""), the rest arguments text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class ParsedOutput:
    content: str | None  # None when nothing but calls (and whitespace) was written
    tool_calls: list[ToolCall]


class _CallScanner:
    """Reads one call object, {"name": ..., "arguments": {...}}, as its text arrives: the top-level keys'
    value spans, the name as soon as its string closes and the arguments object as far as it has come.
    `broken` as soon as the text cannot be such an object; `end` (the index after its closing brace)
    once it is complete. The values themselves are checked by json.loads at the end (CallReader.commit)."""

    def __init__(self) -> None:
        self.text = ""
        self.end: int | None = None
        self.broken = False
        self.name: str | None = None
        self.arguments_start: int | None = None  # where the arguments object starts in text
        self.arguments_end: int | None = None
        self._pos = 0
        self._depth = 0  # brackets open; 1: inside the call object itself
        self._in_string = False
        self._escape = False
        self._expect = "open"  # open, key, key_string, colon, value, string, nested, scalar, next
        self._key = ""
        self._start = 0  # where the current key or value started

    def feed(self, text: str) -> None:
        self.text += text
        while self._pos < len(self.text) and self.end is None and not self.broken:
            self._step(self.text[self._pos])
            self._pos += 1

    @property
    def stopped_at(self) -> int:
        """Where a broken text stopped making sense (the character that broke it)."""
        return self._pos - 1

    def _step(self, char: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
                if self._expect == "key_string":
                    self._key, self._expect = json.loads(self.text[self._start:self._pos + 1]), "colon"
                elif self._expect == "string":
                    self._value_ends(self._pos + 1)
            return
        if self._depth > 1:  # inside a nested value: only brackets and strings matter
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 1:
                    self._value_ends(self._pos + 1)
            return
        if self._expect == "scalar":
            if char not in ",}" + _WHITESPACE:
                return
            self._value_ends(self._pos)
        if char in _WHITESPACE:
            return
        self._top_level(char)

    def _top_level(self, char: str) -> None:
        expect = self._expect
        if expect == "open":
            self._expect, self.broken = "key", char != "{"
            self._depth = 1
        elif expect == "key" and char == '"':
            self._start, self._expect, self._in_string = self._pos, "key_string", True
        elif expect == "colon" and char == ":":
            self._expect = "value"
        elif expect == "value":
            self._start = self._pos
            if self._key in ARGUMENT_KEYS:
                self.broken = char != "{"
                self.arguments_start = self._pos
            if char == '"':
                self._expect, self._in_string = "string", True
            elif char in "{[":
                self._expect, self._depth = "nested", 2
            else:
                self._expect = "scalar"
        elif expect == "next" and char == ",":
            self._expect = "key"
        elif char == "}" and (expect == "next" or (expect == "key" and not self.text[:self._pos].rstrip().endswith(","))):
            self._depth, self.end = 0, self._pos + 1
        else:
            self.broken = True

    def _value_ends(self, end: int) -> None:
        self._expect = "next"
        if self._key == "name":
            name = json.loads(self.text[self._start:end]) if self.text[self._start] == '"' else None
            self.broken = not isinstance(name, str) or not name
            self.name = name
        elif self._key in ARGUMENT_KEYS:
            self.arguments_end = end


class _CallReader:
    """One call being read: its scanner, and what of it has been sent. optimistic: send the name once it is
    read and the arguments object has begun, then the arguments as they arrive (streaming); otherwise only a
    whole, valid call."""

    def __init__(self, index: int, optimistic: bool) -> None:
        self.index = index
        self.optimistic = optimistic
        self.scanner = _CallScanner()
        self.id = new_call_id()
        self.sent_name = False
        self.sent_arguments = 0  # characters of the arguments text sent

    def feed(self, text: str) -> list[CallDelta]:
        self.scanner.feed(text)
        return self._pieces() if self.optimistic else []

    def commit(self) -> list[CallDelta] | None:
        """The call's last pieces once its object is complete, or None when it is not a valid call."""
        scanner = self.scanner
        try:
            valid = scanner.end is not None and scanner.name is not None and not scanner.broken \
                and isinstance(json.loads(scanner.text[:scanner.end]), dict)
        except ValueError:
            valid = False
        if not valid:
            return [] if self.sent_name else None
        pieces = self._pieces()
        if scanner.arguments_start is None:  # no arguments key: an empty object
            pieces.append(CallDelta(self.index, "{}"))
        return pieces

    def give_up(self) -> list[CallDelta] | None:
        """The output ended inside the call: what it sent stands (an unfinished call), else it was not one."""
        return [] if self.sent_name else None

    def _pieces(self) -> list[CallDelta]:
        scanner = self.scanner
        if scanner.broken or scanner.name is None or (scanner.arguments_start is None and scanner.end is None):
            return []  # the name goes out once the arguments have begun (or the call ended without them)
        pieces = []
        if not self.sent_name:
            self.sent_name = True
            pieces.append(CallDelta(self.index, "", self.id, scanner.name))
        if scanner.arguments_start is not None:
            arguments = scanner.text[scanner.arguments_start:scanner.arguments_end or len(scanner.text)]
            if len(arguments) > self.sent_arguments:
                pieces.append(CallDelta(self.index, arguments[self.sent_arguments:]))
                self.sent_arguments = len(arguments)
        return pieces


class _CallStream:
    """What both syntaxes share: content with its outer whitespace held back, and call numbering."""

    def __init__(self, optimistic: bool = True) -> None:
        self.optimistic = optimistic
        self.num_calls = 0
        self._content_started = False
        self._held_whitespace = ""

    def _content(self, text: str) -> list[str]:
        if not self._content_started:
            text = text.lstrip(_WHITESPACE)
            self._content_started = bool(text)
        body = text.rstrip(_WHITESPACE)
        if not body:
            self._held_whitespace += text
            return []
        out, self._held_whitespace = self._held_whitespace + body, text[len(body):]
        return [out]

    def _committed(self, pieces: list[CallDelta] | None, raw: str) -> list[str | CallDelta]:
        """pieces: reader.commit()'s or give_up()'s; raw: the block's text, content when it was no call."""
        if pieces is None:
            return self._content(raw)
        self.num_calls += 1
        return pieces


class HermesCallStream(_CallStream):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, optimistic: bool = True) -> None:
        super().__init__(optimistic)
        self._pending = ""  # outside a call: text that may be the start of START
        self._reader: _CallReader | None = None
        self._raw = ""  # inside a call: the block's text from START on

    def feed(self, text: str) -> list[str | CallDelta]:
        events: list[str | CallDelta] = []
        while text:
            if self._reader is None:
                text = self._outside(text, events)
            else:
                text = self._inside(text, events)
        return events

    def finish(self) -> list[str | CallDelta]:
        if self._reader is not None:
            reader, raw, self._reader = self._reader, self._raw, None
            done = reader.scanner.end is not None
            return self._committed(reader.commit() if done else reader.give_up(), raw)
        pending, self._pending = self._pending, ""
        return self._content(pending)

    def _outside(self, text: str, events: list) -> str:
        """Consumes text up to a call's start (returned: the text after START) or all of it (returns "")."""
        text = self._pending + text
        start = text.find(self.START)
        if start < 0:
            keep = _partial_suffix(text, self.START)
            self._pending = text[len(text) - keep:]
            events += self._content(text[:len(text) - keep])
            return ""
        self._pending = ""
        events += self._content(text[:start])
        self._reader, self._raw = _CallReader(self.num_calls, self.optimistic), self.START
        return text[start + len(self.START):]

    def _inside(self, text: str, events: list) -> str:
        reader = self._reader
        scanner = reader.scanner
        events += reader.feed(text)
        self._raw += text
        if scanner.broken:  # not a call (or one broken after its name was sent): it ends with its END
            end = self._raw.find(self.END, len(self.START))
            if end < 0:
                return ""
            raw, rest = self._raw[:end + len(self.END)], self._raw[end + len(self.END):]
            self._reader = None
            events += self._committed(reader.give_up(), raw)
            return rest
        if scanner.end is None:
            return ""
        tail = scanner.text[scanner.end:]
        stripped = tail.lstrip(_WHITESPACE)
        if len(stripped) < len(self.END) and self.END.startswith(stripped):
            return ""  # the end tag may be coming (finish() ends the call if it does not)
        raw = self._raw[:len(self._raw) - len(tail)]
        if stripped.startswith(self.END):
            rest = stripped[len(self.END):]
            raw += tail[:len(tail) - len(rest)]
        else:  # a model that leaves out END: the call ends with its object
            rest = tail
        self._reader = None
        events += self._committed(reader.commit(), raw)
        return rest


class Llama3JsonCallStream(_CallStream):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, optimistic: bool = True) -> None:
        super().__init__(optimistic)
        self._mode = "start"  # start, calls, text
        self._pending = ""
        self._reader: _CallReader | None = None

    def feed(self, text: str) -> list[str | CallDelta]:
        events: list[str | CallDelta] = []
        while text:
            text = getattr(self, "_" + self._mode)(text, events)
        return events

    def finish(self) -> list[str | CallDelta]:
        pending, self._pending = self._pending, ""
        if self._mode != "calls" or self._reader is None:
            return self._content(pending) if self._mode == "start" else []
        reader, self._reader = self._reader, None
        done = reader.scanner.end is not None
        return self._committed(reader.commit() if done else reader.give_up(), reader.scanner.text)

    def _start(self, text: str, events: list) -> str:
        text = self._pending + text
        body = text.lstrip(_WHITESPACE)
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].lstrip(_WHITESPACE)
            text = body
        if not body or (self.PYTHON_TAG.startswith(body) and len(body) < len(self.PYTHON_TAG)):
            self._pending = text
            return ""
        self._pending = ""
        if body.startswith("{"):
            self._mode, self._reader = "calls", _CallReader(self.num_calls, self.optimistic)
        else:
            self._mode = "text"
        return body

    def _text(self, text: str, events: list) -> str:
        events += self._content(text)
        return ""

    def _calls(self, text: str, events: list) -> str:
        if self._reader is None:  # after a ";": the next call
            text = text.lstrip(_WHITESPACE)
            if not text:
                return ""
            self._reader = _CallReader(self.num_calls, self.optimistic)
        reader = self._reader
        events += reader.feed(text)
        scanner = reader.scanner
        if scanner.broken:  # not a call: the rest is content (after what a call broken late already sent)
            self._reader, self._mode = None, "text"
            pieces = reader.give_up()
            events += self._committed(pieces, "")
            return scanner.text if pieces is None else scanner.text[scanner.stopped_at:]
        if scanner.end is None:
            return ""
        tail = scanner.text[scanner.end:]
        stripped = tail.lstrip(_WHITESPACE)
        if not stripped:
            return ""  # a ";" or the end may be coming
        self._reader = None
        pieces = reader.commit()
        events += self._committed(pieces, scanner.text[:scanner.end])
        if pieces is not None and stripped.startswith(";"):
            return stripped[1:]
        self._mode = "text"
        return stripped


def parse_tool_calls(stream_class: type, text: str) -> ParsedOutput:
    """The whole output at once: the same reading as the stream, sending only whole, valid calls."""
    stream = stream_class(optimistic=False)
    return collect([*stream.feed(text), *stream.finish()])


def collect(events: list[str | CallDelta]) -> ParsedOutput:
    """A stream's events -> the content and the calls they add up to (what a client rebuilds)."""
    calls: dict[int, ToolCall] = {}
    content = []
    for event in events:
        if isinstance(event, str):
            content.append(event)
        elif event.index in calls:
            calls[event.index].arguments += event.arguments
        else:
            calls[event.index] = ToolCall(event.name or "", event.arguments, event.id or new_call_id())
    return ParsedOutput("".join(content) or None, [calls[index] for index in sorted(calls)])


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a beginning of tag (and could grow into it)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[len(text) - length:]):
            return length
    return 0
