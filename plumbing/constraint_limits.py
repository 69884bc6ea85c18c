"""The limits every output constraint is held to before anything compiles it (DESIGN invariant 10).

    check_size(constraint)              # on the gateway's event loop: shape, size, Unicode (one pass)
    check_limits(constraint)            # the helper, before compiling: also nesting and rule counts

Why these and not only the compiler's own limits: the grammar compiler (llguidance, Rust) recurses once
per level of rule chaining and nesting, and a 60 kB Lark grammar of 3,000 chained rules overflows an
8 MiB thread stack (SIGSEGV, which no try/except catches). The compile itself runs in a helper process
(plumbing.grammar_sandbox), so a crash there costs one helper; these checks refuse what is plainly too
deep before it gets that far, with a message that names the limit, in microseconds per kilobyte.
"""
from __future__ import annotations

import re

from core.errors import InvalidArgument
from core.json_limits import MAX_NESTING_DEPTH, check_unicode, load_json
from core.sampling import ConstraintKind, OutputConstraint

MAX_CONSTRAINT_CHARS = 256 * 1024  # a schema / regex / grammar longer than this is refused
# Rules of a Lark or GBNF grammar. Real grammars hold tens to a few hundred (llama.cpp's JSON grammar:
# 9; a C grammar: ~200). 3,000 chained rules crash the compiler on an 8 MiB stack and 2,500 do not, so
# 2,000 leaves the helper's compile well inside its stack.
MAX_GRAMMAR_RULES = 2000

# a rule's definition at a line start: GBNF "name ::=", Lark "name:" / "?name:" / "name.2:" (priority)
_GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z][\w-]*[ \t]*::=", re.MULTILINE)
_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w]*(?:\.-?\d+)?[ \t]*:(?!:)", re.MULTILINE)
# what cannot hold a structural bracket: a "quoted" or 'quoted' literal, a Lark /regex/, a GBNF [class]
# (in Lark, [...] is an optional group: structural)
_LARK_LITERAL = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|/(?:[^/\\\n]|\\.)+/')
_GBNF_LITERAL = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|\[(?:[^\]\\\n]|\\.)*\]')
_BRACKETS = re.compile(r"[()\[\]{}]")  # the kinds of bracket a grammar or regex nests
_REGEX_CLASS = re.compile(r"\[\^?\]?[^\]]*\]")  # a regex's [class] (escapes already removed)


def is_gbnf(grammar: str) -> bool:
    """True for a GBNF grammar (llama.cpp's "name ::= ..." rules), False for Lark. Read from rule
    definitions at line starts, not from "::=" anywhere: a Lark grammar may spell "::=" in a literal."""
    return _GBNF_RULE.search(grammar) is not None


def check_limits(constraint: OutputConstraint, field: str | None = None) -> None:
    """Raises InvalidArgument naming the field and the limit for a constraint no compiler should see.
    field: the name the client used (default: the constraint's kind)."""
    check_size(constraint, field)
    check_structure(constraint, field)


def check_size(constraint: OutputConstraint, field: str | None = None) -> None:
    """The limits that cost nothing to check (shape, size, Unicode: one C-speed pass): the gateway's
    event loop checks these on every request. The structure (check_structure: regex passes and a JSON
    parse over up to 256 kB, ~5-20 ms, measured as half the gateway's busy time under a flood of big
    grammars) is checked in the grammar helper, before it compiles anything."""
    name = field or constraint.kind.value
    if constraint.kind is ConstraintKind.CHOICE:
        if not constraint.choices:
            raise InvalidArgument(name, [], "must list at least one choice")
        if any(not isinstance(choice, str) or not choice for choice in constraint.choices):
            raise InvalidArgument(name, list(constraint.choices), "every choice must be a non-empty string")
    elif constraint.kind is not ConstraintKind.JSON_OBJECT and not constraint.value:
        raise InvalidArgument(name, "", "must not be empty")
    size = len(constraint.value) + sum(len(choice) for choice in constraint.choices)
    if size > MAX_CONSTRAINT_CHARS:
        raise InvalidArgument(name, f"<{size} characters>", f"must be at most {MAX_CONSTRAINT_CHARS} characters")
    for text in (constraint.value, *constraint.choices):
        check_unicode(name, text)


def check_structure(constraint: OutputConstraint, field: str | None = None) -> None:
    """A schema is JSON within the nesting limit; a grammar or regex nests and defines rules within theirs."""
    name = field or constraint.kind.value
    if constraint.kind is ConstraintKind.JSON_SCHEMA:
        schema = load_json(constraint.value, name)
        if not isinstance(schema, (dict, bool)):
            raise InvalidArgument(name, _short(constraint.value), "must be a JSON object (or true/false)")
    elif constraint.kind in (ConstraintKind.GRAMMAR, ConstraintKind.REGEX):
        _check_bracket_depth(name, _without_literals(constraint))
        if constraint.kind is ConstraintKind.GRAMMAR:
            rules = len((_GBNF_RULE if is_gbnf(constraint.value) else _LARK_RULE).findall(constraint.value))
            if rules > MAX_GRAMMAR_RULES:
                raise InvalidArgument(name, f"<a grammar of {rules} rules>",
                                      f"must define at most {MAX_GRAMMAR_RULES} rules (the grammar rule limit)")


def _without_literals(constraint: OutputConstraint) -> str:
    """The constraint's text with what cannot nest removed: a grammar's literals, a regex's escapes and
    [classes] (MAX_NESTING_DEPTH applies to the structure that is left)."""
    text = constraint.value
    if constraint.kind is ConstraintKind.REGEX:
        return _REGEX_CLASS.sub("", re.sub(r"\\.", "", text))
    return (_GBNF_LITERAL if is_gbnf(text) else _LARK_LITERAL).sub("", text)


def _check_bracket_depth(field: str, structure: str) -> None:
    depth = deepest = 0
    for bracket in _BRACKETS.findall(structure):
        depth = depth + 1 if bracket in "([{" else max(depth - 1, 0)
        deepest = max(deepest, depth)
    if deepest > MAX_NESTING_DEPTH:
        raise InvalidArgument(field, _short(structure), f"nests brackets {deepest} levels deep; at most "
                              f"{MAX_NESTING_DEPTH} (the nesting limit)")


def _short(value: object, limit: int = 200) -> object:
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + "..."
    return value
