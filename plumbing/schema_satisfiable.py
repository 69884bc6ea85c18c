"""Does a JSON schema admit any finite document? The check that catches $ref loops with no way out.

    if not has_finite_instance(schema): refuse it as unsatisfiable

llguidance compiles {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]} without
complaint, and its first mask even allows "{": the loop only shows after the model has been steered into
it (an endless, unparsable output). Here each subschema is "productive" when some finite document
matches it, computed as a least fixed point over the schema graph ($ref edges included), the way a
grammar's productive nonterminals are found:

    true, const, enum, a scalar type          productive
    false                                     not
    allOf / $ref beside other keywords        every part productive
    anyOf / oneOf                             some branch productive
    an object                                 every required property's schema productive
    an array with minItems n > 0              the schemas of its first n items productive

Anything else (formats, bounds, patterns) is taken as satisfiable: llguidance refuses the contradictions
it can see ("minimum 5 > maximum 3"), and this only adds the recursion it cannot.
"""
from __future__ import annotations

from urllib.parse import unquote


def has_finite_instance(schema: object) -> bool:
    nodes = _subschemas(schema)
    productive: set[int] = set()
    changed = True
    while changed:  # each pass marks at least one more node, or stops: at most len(nodes) passes
        changed = False
        for node in nodes:
            if id(node) not in productive and _productive(node, schema, productive):
                productive.add(id(node))
                changed = True
    return _is(schema, productive)


def _is(schema: object, productive: set[int]) -> bool:
    if isinstance(schema, bool):
        return schema
    return id(schema) in productive


def _productive(node: dict, root: object, productive: set[int]) -> bool:
    parts = list(node.get("allOf", []))
    if "$ref" in node:
        target = _resolve(root, node["$ref"])
        if target is None:
            return True  # an external or unknown reference: llguidance reports it, not this check
        parts.append(target)
    if not all(_is(part, productive) for part in parts):
        return False
    for key in ("anyOf", "oneOf"):
        if key in node and not any(_is(branch, productive) for branch in node[key]):
            return False
    properties = node.get("properties", {})
    extra = node.get("additionalProperties", True)
    for name in node.get("required", []):
        if not _is(properties.get(name, extra), productive):
            return False
    needed = node.get("minItems", 0)
    if isinstance(needed, int) and needed > 0:
        prefix = node.get("prefixItems", [])
        items = node.get("items", True)
        for index in range(min(needed, len(prefix) + 1)):
            if not _is(prefix[index] if index < len(prefix) else items, productive):
                return False
    return True


def _subschemas(schema: object) -> list[dict]:
    """Every dict reachable in schema (subschemas, and harmlessly some plain objects), without recursion."""
    found, stack, seen = [], [schema], set()
    while stack:
        item = stack.pop()
        if isinstance(item, dict) and id(item) not in seen:
            seen.add(id(item))
            found.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _resolve(root: object, reference: object) -> object | None:
    """A local reference ("#", "#/$defs/a") into root; None for anything else."""
    if not isinstance(reference, str) or not reference.startswith("#"):
        return None
    node = root
    for part in filter(None, reference[1:].split("/")):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, (dict, bool)) else None
