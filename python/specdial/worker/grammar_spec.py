"""What a request constrains its output to: :class:`StructuredSpec`, validated, no backend.

One request carries at most one constraint. The API spellings map onto it:

- SGLang sampling params ``json_schema`` (a JSON string), ``regex``, ``ebnf``
  (:func:`structured_from_sampling` reads them out of a ``sampling_params`` dict);
- OpenAI ``response_format`` ``{"type": "json_object"}`` and
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
- vLLM ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and
  ``structured_outputs`` ``{"json" | "regex" | "choice" | "grammar" | "json_object"}``
  (those two families are turned into SGLang's keys by :mod:`specdial.server.structured`).

Kinds: ``json_schema`` (``text`` a JSON schema; ``strict``: no properties beyond the schema's,
xgrammar's ``strict_mode``), ``json_object`` (any JSON object), ``regex``, ``ebnf``
(xgrammar's / GBNF syntax, start rule ``root``), ``choice`` (``text`` a JSON list of strings,
compiled to an EBNF alternation). ``field`` is the API field the constraint came from, so a
compile error names it. Nothing here imports the backend (:mod:`specdial.worker.grammar`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, MutableMapping

__all__ = ["KINDS", "SGLANG_KEYS", "StructuredSpec", "structured_from_sampling"]

#: The kinds of constraint (see the module docstring).
KINDS = ("json_schema", "json_object", "regex", "ebnf", "choice")

#: SGLang's sampling-parameter names of a constraint -> the kind each gives.
SGLANG_KEYS = {"json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf"}


@dataclass(frozen=True)
class StructuredSpec:
    """One request's output constraint: ``kind`` (one of :data:`KINDS`), ``text`` (the schema
    as JSON text, the regex, the EBNF, or the choices as a JSON list; ``""`` for
    ``json_object``), ``strict`` (``json_schema`` only) and ``field`` (the API field it came
    from, named in errors). Hashable: the compile cache's key with the tokenizer.

    Raises ``ValueError`` naming ``field`` for an unknown kind, a non-string or empty text, a
    schema that is not JSON, or choices that are not a non-empty list of strings.
    """

    kind: str
    text: str = ""
    strict: bool = True
    field: str = "structured"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.field}: unknown constraint kind {self.kind!r}; allowed: "
                             f"{', '.join(KINDS)}")
        if not isinstance(self.text, str):
            raise ValueError(f"{self.field}: expected a string, got {type(self.text).__name__}")
        if not isinstance(self.strict, bool):
            raise ValueError(f"{self.field}: strict must be a bool, got {self.strict!r}")
        if self.kind != "json_object" and not self.text.strip():
            raise ValueError(f"{self.field}: must not be empty")
        if self.kind in ("json_schema", "choice"):
            try:
                value = json.loads(self.text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{self.field}: not valid JSON: {e}") from None
            if self.kind == "json_schema" and not isinstance(value, (dict, bool)):
                raise ValueError(f"{self.field}: a JSON schema must be an object (or a bool), "
                                 f"got {type(value).__name__}")
            if self.kind == "choice" and (not isinstance(value, list) or not value or not all(
                    isinstance(c, str) for c in value)):
                raise ValueError(f"{self.field}: choices must be a non-empty list of strings")

    def ebnf(self) -> str:
        """The ``choice`` kind as EBNF: ``root ::= "a" | "b"`` (JSON string escapes, which
        xgrammar's EBNF literals read the same way)."""
        if self.kind != "choice":
            raise ValueError(f"{self.field}: ebnf() is for the choice kind, not {self.kind!r}")
        return "root ::= " + " | ".join(json.dumps(c) for c in json.loads(self.text))


def _as_text(key: str, value: Any) -> str:
    """A schema given as a dict (vLLM's ``guided_json`` allows it) -> JSON text."""
    if isinstance(value, (dict, bool)) and key == "json_schema":
        return json.dumps(value)
    if not isinstance(value, str):
        raise ValueError(f"SamplingParams.{key}: expected a string, got {type(value).__name__}")
    return value


def structured_from_sampling(d: MutableMapping[str, Any]) -> StructuredSpec | None:
    """Pop SGLang's constraint keys (``json_schema``, ``regex``, ``ebnf``) and specdial's
    ``structured`` (a :class:`StructuredSpec`) out of a sampling dict ``d``; the one given, or
    None (``None`` values count as not given). Raises ``ValueError`` naming both keys when two
    are given, or naming the key for a bad value."""
    found: list[tuple[str, Any]] = [(k, d.pop(k)) for k in (*SGLANG_KEYS, "structured")
                                    if k in d]
    found = [(k, v) for k, v in found if v is not None]
    if len(found) > 1:
        raise ValueError(f"SamplingParams.{found[0][0]}: given together with "
                         f"{found[1][0]!r}; allowed: one output constraint per request")
    if not found:
        return None
    key, value = found[0]
    if key == "structured":
        if not isinstance(value, StructuredSpec):
            raise ValueError(f"SamplingParams.structured: expected a StructuredSpec, got "
                             f"{type(value).__name__}")
        return value
    try:
        return StructuredSpec(SGLANG_KEYS[key], _as_text(key, value), field=key)
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith("SamplingParams.") else
                         f"SamplingParams.{msg}") from None
