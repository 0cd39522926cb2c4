"""OpenAI request parsing for the server: which fields are supported, and the error JSON.

Validation order for a request body (each failure is an :class:`APIError`, answered with
``{"error": {"message", "type", "param", "code"}}`` as OpenAI does):

1. the body is JSON (else 400, ``param`` null) and a JSON object;
2. every key is a field of the endpoint: a known OpenAI field that this server does not
   implement is 400 "not supported" unless it has its neutral value (``best_of: 1`` or equal
   to ``n``, null or empty for the others: see :data:`UNSUPPORTED_COMPLETION_FIELDS` /
   :data:`UNSUPPORTED_CHAT_FIELDS`); any other key is 400 "Unrecognized request argument
   supplied" (extra="forbid" semantics). An ``extra_body`` object (what the OpenAI SDK's
   ``extra_body=`` argument carries, sent nested by some clients) is merged into the top level
   first; a key given in both places with different values is 400 naming it;
3. types and ranges through the strict pydantic models below (no string-to-number coercion, no
   NaN or infinity; ``max_tokens`` >= 1, ``temperature`` in [0, float32's largest value],
   ``top_p`` in (0, 1]; ``seed`` in [0, 2**64 - 1]; ``n`` in 1..:data:`MAX_N`; the sampling extras that vLLM accepts at
   the top level: ``top_k`` (-1 or 0 off, or >= 1), ``min_p`` in [0, 1],
   ``repetition_penalty`` in [1e-4, 1e4], ``presence_penalty`` / ``frequency_penalty`` in
   [-2, 2] (OpenAI's), ``min_tokens`` >= 0 (and <= the completion's max tokens, checked by the
   engine), ``stop_token_ids`` (ids >= 0; the engine bounds them, and ``top_k``, by the
   vocabulary: :mod:`specdial.engine.bounds`), ``include_stop_str_in_output`` and
   ``skip_special_tokens`` (bools), ``ignore_eos``; completions ``logprobs`` an int in 0..20
   (the alternatives per token) and ``echo`` a bool; chat ``logprobs`` a bool and ``top_logprobs`` 0..20, which needs
   ``logprobs: true``; ``prompt`` a string, a list of strings, a list of token ids or a list
   of such lists; null means "default" for every optional field); the ``param`` of the error
   is the offending field;
4. text (``prompt``, message contents, ``stop``) must be valid Unicode: a lone surrogate
   (``"\\ud800"`` in the JSON) is 400 ``invalid_value`` naming the field (``prompt`` for every
   item of a prompt list, the message naming ``prompt[i]``; ``messages[i].content``).

``rid`` (SGLang's extension of the OpenAI requests; a non-empty string, one per request,
shared by its prompts and choices) names the request for ``POST /abort_request``
(:mod:`specdial.server.ops_api`). ``user`` is accepted and ignored: it is an informational end-user id in the OpenAI API with no
effect on generation. ``model`` may be omitted (the served model is used); a different name is
404 ``model_not_found``, as OpenAI answers for an unknown model.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

__all__ = ["APIError", "error_field", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "MAX_N",
           "MAX_TEMPERATURE", "SAMPLING_EXTRAS", "UNSUPPORTED_CHAT_FIELDS",
           "UNSUPPORTED_COMPLETION_FIELDS", "choice_seed", "parse_request", "send_api_error"]

#: Most choices per prompt (``n``).
MAX_N = 128
#: Most alternatives per token (``logprobs`` of completions, ``top_logprobs`` of chat; vLLM's
#: default ``max_logprobs``).
MAX_LOGPROBS = 20

_MASK64 = (1 << 64) - 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` (0..n-1) of a request with ``seed`` and ``n > 1``.

    Choice 0 keeps ``seed`` (so ``n: 1`` and the first of ``n`` choices agree); choice ``i > 0``
    uses SplitMix64's output function (Steele, Lea, Flood 2014) applied to
    ``seed + i * 0x9E3779B97F4A7C15`` mod 2**64: distinct, well-mixed 64-bit seeds, a pure
    function of ``(seed, i)``, so each choice is reproducible on its own."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class APIError(Exception):
    """An error answered as OpenAI-style JSON with HTTP ``status``.

    ``type``: ``invalid_request_error`` (400/404), ``server_overloaded`` (503 on a full queue),
    ``service_unavailable`` (503 while shutting down) or ``internal_error`` (500). ``param``:
    the offending request field or None. ``code``: a short machine-readable code or None.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


# Known OpenAI fields this server does not implement -> the values that mean "off" and are
# therefore accepted. Anything else for these keys is 400 "not supported".
_COMMON_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "service_tier": (None,),
}

#: ``/v1/completions`` fields that are known but not implemented (key -> accepted neutral values).
UNSUPPORTED_COMPLETION_FIELDS: dict[str, tuple[Any, ...]] = {
    **_COMMON_UNSUPPORTED,
    "suffix": (None,),
}

#: ``/v1/chat/completions`` fields that are known but not implemented.
UNSUPPORTED_CHAT_FIELDS: dict[str, tuple[Any, ...]] = {
    **_COMMON_UNSUPPORTED,
    "tools": (None,),
    "tool_choice": (None,),
    "parallel_tool_calls": (None,),
    "functions": (None,),
    "function_call": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "store": (None, False),
    "metadata": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
}


_OMIT = "omit it: this server has no such feature"
_NO_TOOLS = "describe the tools in the messages and parse the reply text"
#: What to use instead of each unsupported field (in its 400 message).
INSTEAD: dict[str, str] = {
    "suffix": "no fill-in-the-middle: send the prefix as 'prompt'",
    "service_tier": _OMIT, "tools": _NO_TOOLS, "tool_choice": _NO_TOOLS,
    "parallel_tool_calls": _NO_TOOLS, "functions": _NO_TOOLS, "function_call": _NO_TOOLS,
    "audio": "text only", "modalities": "text only ([\"text\"])",
    "prediction": "omit it: speculative decoding is built in",
    "reasoning_effort": _OMIT, "store": _OMIT, "metadata": _OMIT,
    "web_search_options": _OMIT, "verbosity": _OMIT, "prompt_cache_key": _OMIT,
    "safety_identifier": "omit it, or use 'user'",
}

#: Largest ``temperature`` accepted: float32's largest finite value (the engine's
#: ``specdial.worker.sampling.MAX_TEMPERATURE``; temperatures are float32 tensors there).
MAX_TEMPERATURE = 3.4028234663852886e38
#: ``repetition_penalty`` range (the engine's ``MIN_REPETITION_PENALTY`` /
#: ``MAX_REPETITION_PENALTY``).
REPETITION_PENALTY_RANGE = (1e-4, 1e4)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    """``stream_options``: only ``include_usage`` (a final chunk with the usage)."""

    include_usage: bool = False


class _CommonRequest(_Strict):
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=_MASK64)  # the engine's seed range
    # extension field of vLLM and SGLang (not OpenAI's): keep generating past EOS / stop
    # token ids until max_tokens; `stop` strings still apply
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # informational only (see the module docstring)
    # SGLang's extension: the id POST /abort_request ends this request (all its choices) by
    rid: str | None = Field(None, min_length=1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    # OpenAI's penalties (generated tokens only)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    # vLLM's sampling extras (top level, or in `extra_body`); null = the engine's default
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0],
                                             le=REPETITION_PENALTY_RANGE[1])
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # OpenAI's token id (a decimal string) -> bias in [-100, 100]; the engine checks the entries
    # (specdial.worker.logit_bias) and the ids against the vocabulary
    logit_bias: dict[str, Any] | None = None
    # structured outputs (OpenAI's, and vLLM's extras): specdial.server.structured checks them
    response_format: Any = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: Any = None
    # validated as neutral by _check_fields; here so that extra="forbid" lets them through
    service_tier: Any = None


class CompletionRequest(_CommonRequest):
    """``POST /v1/completions`` body (supported fields; see the module docstring).

    ``prompt``: text, texts, token ids, or lists of token ids (lm-evaluation-harness sends
    token ids). ``logprobs``: alternatives per token (0..20; 0 = only the chosen token's);
    ``echo``: the prompt is prepended to the text, and to the logprobs when asked for.
    ``best_of``: only null or equal to ``n`` (no server-side ranking: use ``n`` and rank the
    choices by their ``logprobs``)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: Any = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per prompt of the request (texts or token-id lists)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(_Strict):
    """One chat message: ``role``, text ``content`` (a string, or a list of
    ``{"type": "text", "text": ...}`` parts, concatenated) and OpenAI's optional participant
    ``name`` (1-64 characters of letters, digits, ``_`` and ``-``, OpenAI's rule; clients such as
    AutoGen send it). The name reaches the chat template as the message's ``name`` key (as vLLM
    passes it); the simple template writes it into the role marker (:mod:`.chat`)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")

    def text(self, index: int) -> str:
        """The content as one string. Raises :class:`APIError` 400 for a non-text part."""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str) or (
                    set(part) - {"type", "text"}):
                raise bad_request("only text content parts ({\"type\": \"text\", \"text\": "
                                  "...}) are supported", f"messages[{index}].content[{j}]",
                                  "unsupported_content")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_CommonRequest):
    """``POST /v1/chat/completions`` body (supported fields; see the module docstring)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    store: Any = None
    metadata: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None


#: The request fields that become engine sampling params of the same name when not null.
SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "min_tokens", "stop_token_ids",
                   "include_stop_str_in_output", "skip_special_tokens", "logit_bias")


def _merge_extra_body(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with a nested ``extra_body`` object merged into the top level (see the module
    docstring). Raises :class:`APIError` 400 for a non-object ``extra_body`` or a key given at
    both levels with different values."""
    if "extra_body" not in body:
        return body
    extra = body["extra_body"]
    if extra is None:
        return {k: v for k, v in body.items() if k != "extra_body"}
    if not isinstance(extra, dict):
        raise bad_request("'extra_body' must be an object of request fields", "extra_body",
                          "invalid_type")
    out = {k: v for k, v in body.items() if k != "extra_body"}
    for key, value in extra.items():
        if key in out and out[key] != value:
            raise bad_request(f"'{key}' is given both at the top level and in 'extra_body', with "
                              "different values; give it once", key, "invalid_value")
        out[key] = value
    return out


def _check_fields(body: dict[str, Any], model: type[BaseModel],
                  unsupported: dict[str, tuple[Any, ...]]) -> None:
    for key, value in body.items():
        if key in unsupported:
            neutral = unsupported[key]
            # bool is an int in Python: `n: true` must not pass as `n: 1`
            if not any(value == v and type(value) is type(v) or value is v for v in neutral):
                got = '' if value is None else f' (got {json.dumps(value)})'
                raise bad_request(f"'{key}' is not supported by this server{got}; "
                                  f"{INSTEAD.get(key, _OMIT)}", key, "unsupported_parameter")
        elif key not in model.model_fields:
            raise bad_request(f"Unrecognized request argument supplied: {key}", key,
                              "unrecognized_parameter")


#: A step of a pydantic error location that names a union member, not a field: ``str``,
#: ``list[int]``, ``dict[str,any]``, ``function-after[...]`` (pydantic adds one per member it
#: tried, e.g. ``('rid', 'str')`` for ``rid: str | list[str]``).
_UNION_TAG = re.compile(r"str|int|float|bool|bytes|none|[\w-]+\[.*\]")


def error_field(err: ValidationError) -> tuple[list[str], str]:
    """The first error of ``err`` as ``(location, message)``: the location without pydantic's
    union-member steps (a client named ``rid``, not ``rid.str``), and for a field whose value
    fits no member of its union, each member's complaint once, joined by "; or "."""
    errors = err.errors()
    loc = [str(p) for p in errors[0]["loc"] if not (isinstance(p, str)
                                                     and _UNION_TAG.fullmatch(p))]
    msgs: list[str] = []
    for e in errors:
        here = [str(p) for p in e["loc"] if not (isinstance(p, str) and _UNION_TAG.fullmatch(p))]
        same = here[:len(loc)] == loc or loc[:len(here)] == here  # a member of the same union
        if same and e["msg"] not in msgs:
            msgs.append(e["msg"])
    return loc, "; or ".join(msgs)


def _pydantic_error(err: ValidationError) -> APIError:
    first = err.errors()[0]
    loc, msg = error_field(err)
    first = {**first, "msg": msg}
    top = loc[0] if loc else None
    if top == "messages" and len(loc) > 1 and loc[1].isdigit():
        where = f"messages[{loc[1]}]" + "".join(f".{p}" for p in loc[2:3])
        if first["type"] == "missing":
            return bad_request(f"Missing required parameter: '{where}'", where,
                               "missing_required_parameter")
        return bad_request(f"Invalid value for '{where}': {first['msg']}", where,
                           "invalid_value")
    if first["type"] == "missing":
        return bad_request(f"Missing required parameter: '{'.'.join(loc)}'", top,
                           "missing_required_parameter")
    if top == "prompt":
        return bad_request("'prompt' must be a string, a list of strings, a list of token ids "
                           "or a list of lists of token ids", "prompt", "invalid_type")
    if top == "stop":
        return bad_request("'stop' must be a string or a list of strings", "stop",
                           "invalid_type")
    return bad_request(f"Invalid value for '{'.'.join(loc)}': {first['msg']}", top,
                       "invalid_value")


def _check_text(text: str, where: str, param: str) -> None:
    """400 ``invalid_value`` (``param``; ``where`` names the item in the message) for text that
    is not valid Unicode: JSON ``\\ud800``-style escapes can carry lone surrogates, which no
    tokenizer can encode (``str.encode("utf-8")`` raises)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"Invalid value for '{where}': not valid Unicode text (a lone "
                          f"surrogate {text[e.start]!r} at character {e.start})", param,
                          "invalid_value") from None


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body parsed as a JSON object. Raises :class:`APIError` 400 ``invalid_json``
    when it is not JSON (or not UTF-8) or not an object."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object", None, "invalid_json")
    return body


def parse_request(raw: bytes, kind: Literal["completion", "chat"]) -> CompletionRequest | ChatCompletionRequest:
    """Parse and validate a request body for ``/v1/completions`` (``kind="completion"``) or
    ``/v1/chat/completions`` (``"chat"``). Raises :class:`APIError` (400) naming the field."""
    body = json_object(raw)
    model_cls: type[CompletionRequest] | type[ChatCompletionRequest]
    if kind == "completion":
        model_cls, unsupported = CompletionRequest, UNSUPPORTED_COMPLETION_FIELDS
    else:
        model_cls, unsupported = ChatCompletionRequest, UNSUPPORTED_CHAT_FIELDS
    body = _merge_extra_body(body)
    _check_fields(body, model_cls, unsupported)
    try:
        req = model_cls.model_validate(body)
    except ValidationError as e:
        raise _pydantic_error(e) from None
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true",
                          "stream_options", "invalid_value")
    if isinstance(req, CompletionRequest):
        if isinstance(req.prompt, list) and not req.prompt:
            raise bad_request("'prompt' must not be an empty list", "prompt", "invalid_value")
        prompts = req.prompts()
        for i, p in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(p, str):
                _check_text(p, where, "prompt")
            elif not p or min(p) < 0:
                raise bad_request(f"'{where}' must be a non-empty list of token ids >= 0",
                                  "prompt", "invalid_value")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise bad_request(f"'best_of' ({req.best_of}) different from 'n' ({req.n or 1}) is "
                              "not supported: the server does not rank candidates; request "
                              "'n' choices with 'logprobs' and rank them yourself", "best_of",
                              "unsupported_parameter")
    else:
        for i, m in enumerate(req.messages):
            if isinstance(m.content, str):
                _check_text(m.content, f"messages[{i}].content", f"messages[{i}].content")
            else:
                for j, part in enumerate(m.content):
                    if isinstance(part.get("text"), str):
                        where = f"messages[{i}].content[{j}]"
                        _check_text(part["text"], where, where)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs",
                              "invalid_value")
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if any(s == "" for s in stop):
        raise bad_request("'stop' strings must not be empty", "stop", "invalid_value")
    for s in stop:
        _check_text(s, "stop", "stop")
    if isinstance(req, ChatCompletionRequest):
        if (req.max_tokens is not None and req.max_completion_tokens is not None
                and req.max_tokens != req.max_completion_tokens):
            raise bad_request("'max_tokens' and 'max_completion_tokens' disagree; send one",
                              "max_completion_tokens", "invalid_value")
    return req


async def send_api_error(scope: Scope, receive: Receive, send: Send, error: APIError,
                         headers: dict[str, str] | None = None) -> None:
    """Answer an ASGI request with ``error`` as its JSON body (for middleware, which runs
    outside the app's exception handlers)."""
    await JSONResponse(error.body(), status_code=error.status, headers=headers)(
        scope, receive, send)
