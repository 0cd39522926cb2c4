"""Structured-output fields of the OpenAI routes -> the engine's constraint.

Accepted (at most one per request; two give a 400 naming both):

- OpenAI ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type":
  "json_object"}`` (any JSON object), ``{"type": "json_schema", "json_schema": {"name": str,
  "schema": object, "strict": bool | null, "description": str}}`` (``strict`` true: no
  properties beyond the schema's; OpenAI's default false keeps xgrammar's non-strict mode).
- vLLM's ``guided_json`` (a schema object or its JSON text), ``guided_regex``,
  ``guided_choice`` (list of strings), ``guided_grammar`` (EBNF), and ``structured_outputs``
  ``{"json" | "regex" | "choice" | "grammar": ..., "json_object": true}`` (exactly one key;
  vLLM's tuning keys such as ``disable_any_whitespace`` are refused, not ignored).

The result is ``{"structured": StructuredSpec}`` for the sampling params
(:class:`~specdial.worker.grammar_spec.StructuredSpec`); bad shapes are a 400 naming the field
(``response_format.json_schema.schema``, ``guided_choice``, ...). A schema / regex / grammar
that does not compile is a 400 too, from the engine's compile (naming the same field).
"""

from __future__ import annotations

import json
from typing import Any

from specdial.server.protocol import bad_request
from specdial.worker.grammar_spec import StructuredSpec

__all__ = ["structured_sampling"]

_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "ebnf"}
_STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf"}


def _spec(kind: str, value: Any, field: str, strict: bool = True) -> StructuredSpec:
    if kind in ("json_schema", "choice") and not isinstance(value, str):
        if kind == "json_schema" and not isinstance(value, (dict, bool)):
            raise bad_request(f"'{field}' must be a JSON schema (an object, or its JSON text)",
                              field, "invalid_type")
        value = json.dumps(value)
    try:
        return StructuredSpec(kind, value, strict=strict, field=field)
    except ValueError as e:
        raise bad_request(str(e), field, "invalid_value") from None


def _response_format(rf: Any) -> StructuredSpec | None:
    if not isinstance(rf, dict) or "type" not in rf:
        raise bad_request("'response_format' must be an object with a 'type': 'text', "
                          "'json_object' or 'json_schema'", "response_format", "invalid_type")
    kind = rf["type"]
    extra = set(rf) - ({"type", "json_schema"} if kind == "json_schema" else {"type"})
    if extra:
        raise bad_request(f"'response_format' of type {kind!r} has unknown keys "
                          f"{sorted(extra)}", "response_format", "invalid_value")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object", field="response_format")
    if kind != "json_schema":
        raise bad_request(f"'response_format.type' {kind!r} is not one of 'text', "
                          "'json_object', 'json_schema'", "response_format.type", "invalid_value")
    js = rf.get("json_schema")
    if not isinstance(js, dict) or "schema" not in js:
        raise bad_request("'response_format.json_schema' must be an object with 'name' and "
                          "'schema'", "response_format.json_schema", "invalid_type")
    unknown = set(js) - {"name", "schema", "strict", "description"}
    if unknown:
        raise bad_request(f"'response_format.json_schema' has unknown keys {sorted(unknown)}",
                          "response_format.json_schema", "invalid_value")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("'response_format.json_schema.strict' must be a bool or null",
                          "response_format.json_schema.strict", "invalid_type")
    return _spec("json_schema", js["schema"], "response_format.json_schema.schema",
                 strict=bool(strict))


def _structured_outputs(so: Any) -> StructuredSpec | None:
    if not isinstance(so, dict):
        raise bad_request("'structured_outputs' must be an object", "structured_outputs",
                          "invalid_type")
    given = {k: v for k, v in so.items() if v is not None and v is not False}
    unknown = set(given) - set(_STRUCTURED) - {"json_object"}
    if unknown:
        raise bad_request(f"'structured_outputs' keys {sorted(unknown)} are not supported; "
                          f"allowed: one of {sorted([*_STRUCTURED, 'json_object'])}",
                          "structured_outputs", "unsupported_parameter")
    if len(given) > 1:
        raise bad_request(f"'structured_outputs' gives {sorted(given)}; give one constraint",
                          "structured_outputs", "invalid_value")
    if not given:
        return None
    (key, value), = given.items()
    if key == "json_object":
        if value is not True:
            raise bad_request("'structured_outputs.json_object' must be true",
                              "structured_outputs.json_object", "invalid_value")
        return StructuredSpec("json_object", field="structured_outputs.json_object")
    return _spec(_STRUCTURED[key], value, f"structured_outputs.{key}")


def structured_sampling(req: Any) -> dict[str, Any]:
    """``{"structured": StructuredSpec}`` from the request's structured-output fields, or
    ``{}``. Raises :class:`~specdial.server.protocol.APIError` 400 naming the field."""
    found: list[tuple[str, StructuredSpec]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(("response_format", spec))
    for name, kind in _GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            found.append((name, _spec(kind, value, name)))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        spec = _structured_outputs(so)
        if spec is not None:
            found.append(("structured_outputs", spec))
    if len(found) > 1:
        raise bad_request(f"'{found[0][0]}' and '{found[1][0]}' both constrain the output; "
                          "give one", found[1][0], "invalid_value")
    return {"structured": found[0][1]} if found else {}
