"""JSON from clients, parsed under a nesting limit: a 400 naming the limit, never a RecursionError.

    schema = load_json(text, "json_schema")        # text a client sent inside a field
    check_document(body, "body")                    # a document already parsed (an HTTP body)

Python's json.loads recurses once per level and raises RecursionError near 1,000 levels, which an edge
that catches ValueError turns into a 500; and a schema 500 levels deep that does parse still recurses
that deep in every compiler after it. Real documents nest under 20 levels, so the limit is 100.

JSON may also spell a lone surrogate ("\ud800"), which parses into a Python str that is not Unicode
text: tokenizers, regex engines and UTF-8 encoders each fail on it in their own way (a 500). Every
string of a document is checked once, here, and refused by its path.
"""
from __future__ import annotations

import json
import re

from core.errors import InvalidArgument

MAX_NESTING_DEPTH = 100

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def load_json(text: str | bytes, field: str, max_depth: int = MAX_NESTING_DEPTH) -> object:
    """json.loads for a client's JSON text: malformed, or nested deeper than max_depth, is InvalidArgument."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidArgument(field, _short(text), f"is not UTF-8 text: {exc}") from None
    depth = json_depth(text)
    if depth > max_depth:
        raise InvalidArgument(field, _short(text), f"nests {depth} levels deep; at most {max_depth} (the nesting limit)")
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(field, _short(text), f"is not JSON: {exc}") from None
    check_document(document, field, max_depth)
    return document


def check_document(value: object, field: str, max_depth: int = MAX_NESTING_DEPTH) -> None:
    """A parsed document: nested at most max_depth deep, every string and key valid Unicode. Walked
    without recursion; the error names the path of the offending value (field.key[2]...)."""
    stack = [(value, 1, field)]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, str):
            check_unicode(path, item)
        elif isinstance(item, (dict, list)):
            if depth > max_depth:
                raise InvalidArgument(path, "...", f"nests more than {max_depth} levels deep (the nesting limit)")
            if isinstance(item, dict):
                for key, child in item.items():
                    check_unicode(f"{path} key", key)
                    stack.append((child, depth + 1, f"{path}.{key}"))
            else:
                stack.extend((child, depth + 1, f"{path}[{index}]") for index, child in enumerate(item))


def check_unicode(field: str, text: str) -> None:
    """Raises InvalidArgument for a str holding a lone surrogate (not Unicode text)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        raise InvalidArgument(field, _short(text), f"holds a lone surrogate U+{code:04X} at character {error.start}: "
                              "not valid Unicode (send a whole surrogate pair or the character itself)") from None


def json_depth(text: str) -> int:
    """The deepest [ / { nesting of JSON text outside its strings (regex passes, no recursion)."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRING.sub('""', text)):
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _short(value: object, limit: int = 200) -> object:
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return value[:limit] + ("..." if isinstance(value, str) else b"...")
    return value
