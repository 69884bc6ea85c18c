"""plumbing.schema_satisfiable: a schema admits a finite document unless every way out of a $ref loop is
required (the loops llguidance compiles and then steers the model into forever)."""
from __future__ import annotations

import pytest

from plumbing.schema_satisfiable import has_finite_instance

LOOP = {"$ref": "#"}
REQUIRED_SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


@pytest.mark.parametrize("schema", [
    LOOP,
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    REQUIRED_SELF,
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"anyOf": [REQUIRED_SELF, {"$ref": "#"}]},
    {"allOf": [{"type": "object"}, False]},
    {"type": "object", "required": ["x"], "additionalProperties": False},
])
def test_schemas_with_no_finite_instance(schema):
    assert not has_finite_instance(schema)


@pytest.mark.parametrize("schema", [
    True, {}, {"type": "object"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}},  # a is optional: {} ends it
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
    {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}]},
    {"$defs": {"node": {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                        "required": ["children"]}}, "$ref": "#/$defs/node"},  # a tree: children may be []
    {"$ref": "https://example.com/elsewhere"},  # not ours to judge
])
def test_schemas_with_a_finite_instance(schema):
    assert has_finite_instance(schema)
