"""OpenAI's (and vLLM's) ways of asking for constrained output -> one core.sampling.OutputConstraint.
The OpenAI API reads them from its JSON body, the KServe API from sampling_parameters.

    response_format: {"type": "json_object"}                                 any JSON object
    response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    guided_json (a schema, object or JSON text), guided_regex, guided_choice, guided_grammar   (vLLM's names)

At most one may be given. A constraint over a size limit or with invalid Unicode is InvalidArgument
naming the field the client used (a 400 with that `param`), found here; one over a structural limit
(nesting, rules) or that does not compile is found by the gateway's grammar sandbox
(gateway.prepare.request_builder.check_constraints), named by the same field (constraint_field).
"""
from __future__ import annotations

import json

from core.errors import InvalidArgument
from core.sampling import ConstraintKind, OutputConstraint
from plumbing.constraint_limits import check_size

_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def openai_constraint(body: dict) -> OutputConstraint | None:
    found = _found(body)
    if not found:
        return None
    field, constraint = found[0]
    check_size(constraint, field)
    return constraint


def constraint_field(body: dict) -> str | None:
    """The field the client put its constraint in (None: none), to name it in a refusal."""
    found = _found(body)
    return found[0][0] if found else None


def _found(body: dict) -> list[tuple[str, OutputConstraint]]:
    found = [(field, value) for field, value in _response_format_constraint(body.get("response_format"))]
    found += [(field, _guided(field, body[field])) for field in _GUIDED_FIELDS if body.get(field) is not None]
    if len(found) > 1:
        names = [field for field, _ in found]
        raise InvalidArgument(names[1], "...", f"only one output constraint may be given, got {', '.join(names)}")
    return found


def _response_format_constraint(response_format: object) -> list[tuple[str, OutputConstraint]]:
    if response_format is None:
        return []
    if not isinstance(response_format, dict):
        raise InvalidArgument("response_format", response_format, 'must be an object like {"type": "json_object"}')
    kind = response_format.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", OutputConstraint(ConstraintKind.JSON_OBJECT))]
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidArgument("response_format.json_schema", spec,
                                  'must be an object like {"name": ..., "schema": {...}, "strict": true}')
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise InvalidArgument("response_format.json_schema.schema", schema, "must be a JSON schema object")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidArgument("response_format.json_schema.strict", strict, "must be true or false")
        # strict or not, the output is held to the schema: constrained decoding always enforces it
        return [("response_format.json_schema.schema",
                 OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)))]
    raise InvalidArgument("response_format.type", kind, 'must be "text", "json_object" or "json_schema"')


def _guided(field: str, value: object) -> OutputConstraint:
    if field == "guided_json":
        if isinstance(value, str):
            return OutputConstraint(ConstraintKind.JSON_SCHEMA, value)
        if isinstance(value, (dict, bool)):
            return OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(value))
        raise InvalidArgument(field, value, "must be a JSON schema (an object, or its JSON text)")
    if field == "guided_choice":
        if not isinstance(value, list):
            raise InvalidArgument(field, value, "must be a list of strings")
        return OutputConstraint(ConstraintKind.CHOICE, choices=tuple(value))
    if not isinstance(value, str):
        raise InvalidArgument(field, value, "must be a string")
    kind = ConstraintKind.REGEX if field == "guided_regex" else ConstraintKind.GRAMMAR
    return OutputConstraint(kind, value)
