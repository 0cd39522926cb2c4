"""Size and time limits of ``specdial serve``, checked before any expensive work.

- :class:`ServerLimits`: the limits (each a ``specdial serve`` option, :class:`ServeConfig`).
- :class:`BodyLimitMiddleware` (ASGI): reads every request body itself, before the routes run:
  a ``Content-Length`` above ``max_body_bytes`` is refused at once (413, nothing read); a body
  without one (chunked) is counted as it arrives and refused (413) as soon as it passes the
  limit; a body not complete ``body_read_timeout_s`` seconds after the request started is
  refused (408, the connection closed); JSON nested deeper than ``max_json_depth`` is refused
  (400) without parsing it. A client that disconnects during the upload is logged once at INFO
  with the request id, and nothing else happens. The routes then read the buffered body.
  Each request gets an id (``scope["state"]["request_id"]``, 32 hex digits) that the routes
  use in their response ids and log lines.
- :func:`check_prompt_chars`, :func:`check_stop`, :func:`check_prompt_count`: per-request limits
  the routes apply to parsed requests before rendering templates or tokenizing.
- :func:`check_tokenize_chars`, :func:`check_detokenize_tokens`: the ``/tokenize`` character
  and ``/detokenize`` token-count limits (:func:`tokenize_char_limit`).
- :func:`prompt_char_limit`: the automatic bound on prompt characters, ``context_length`` x the
  characters of the tokenizer's longest token: text longer than that cannot fit the context
  (each token covers at most that many characters), so it is refused before tokenizing. The
  bound assumes the tokenizer does not delete characters (a normalizer stripping accents or
  control characters could); ``--max-prompt-chars`` replaces it.

Why (issue 12): a 12 MB body once stalled ``/health`` for 16 s and another client's stream for
18 s while it was parsed and tokenized on the event loop, and 200,000 stop strings halved
another client's decoding speed. Limits in the style of vLLM's and SGLang's servers (which
have no body limit of their own) and of reverse proxies (nginx ``client_max_body_size``,
``client_body_timeout``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdial.server.defaults import (DEFAULT_BODY_READ_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES,
                                      DEFAULT_MAX_DETOKENIZE_TOKENS, DEFAULT_MAX_JSON_DEPTH,
                                      DEFAULT_MAX_PROMPTS,
                                      DEFAULT_MAX_STOP_CHARS, DEFAULT_MAX_STOP_STRINGS)
from specdial.server.protocol import APIError, bad_request, send_api_error

__all__ = ["BodyLimitMiddleware", "ServerLimits", "check_prompt_chars", "check_prompt_count",
           "check_detokenize_tokens", "check_stop", "check_tokenize_chars", "json_depth", "longest_token_chars", "prompt_char_limit",
           "request_id", "tokenize_char_limit"]

logger = logging.getLogger("specdial.server")

#: Deepest ``max_json_depth`` allowed: well below Python's recursion limit, which the JSON
#: parser and validation would otherwise hit (a RecursionError, i.e. a 500).
MAX_JSON_DEPTH_LIMIT = 256

# A JSON string literal (possessive: linear time on any input).
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_BRACKETS = np.zeros(256, np.int8)
_BRACKETS[[ord("["), ord("{")]] = 1
_BRACKETS[[ord("]"), ord("}")]] = -1
# bodies above this are scanned in a worker thread, not on the event loop
_INLINE_SCAN_BYTES = 64 * 1024


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits of the HTTP server (units in the names; see the module docstring).

    - ``max_body_bytes``: request body size (default 4 MiB); 413 above it.
    - ``body_read_timeout_s``: seconds from the request's start to its complete body (default
      30); 408 after it.
    - ``max_json_depth``: nesting of arrays/objects in a JSON body (default 32, at most
      :data:`MAX_JSON_DEPTH_LIMIT`); 400 above it.
    - ``max_prompts``: prompts in one ``/v1/completions`` request (default 128); 400 above it.
    - ``max_stop_strings`` / ``max_stop_chars``: stop strings per request (default 16) and
      characters per stop string (default 256); 400 above them.
    - ``max_prompt_chars``: characters of one prompt (completions) or of the rendered chat
      (chat); None (default): :func:`prompt_char_limit`'s automatic bound; 400 above it.
    - ``max_tokenize_chars``: characters of one ``/tokenize`` request (its texts together, or
      the rendered chat); None (default): the
      prompt's limit (:func:`tokenize_char_limit`); 400 above it.
    - ``max_detokenize_tokens``: token ids in one ``/detokenize`` request, all lists together
      (default 131072); 400 above it.
    """

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_prompts: int = DEFAULT_MAX_PROMPTS
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_chars: int = DEFAULT_MAX_STOP_CHARS
    max_prompt_chars: int | None = None
    max_tokenize_chars: int | None = None
    max_detokenize_tokens: int = DEFAULT_MAX_DETOKENIZE_TOKENS

    def __post_init__(self) -> None:
        """Raises ``ValueError`` naming the ``specdial serve`` option for a bad value."""
        for name in ("max_body_bytes", "max_prompts", "max_stop_strings", "max_stop_chars",
                     "max_prompt_chars", "max_tokenize_chars", "max_detokenize_tokens"):
            v = getattr(self, name)
            if v is None and name in ("max_prompt_chars", "max_tokenize_chars"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        d = self.max_json_depth
        if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= MAX_JSON_DEPTH_LIMIT:
            raise ValueError(f"--max-json-depth must be an integer in 1..{MAX_JSON_DEPTH_LIMIT}, "
                             f"got {d!r}")
        t = self.body_read_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (
                t > 0 and math.isfinite(t)):
            raise ValueError(f"--body-read-timeout must be a finite number of seconds > 0, "
                             f"got {t!r}")


# ---------------------------------------------------------------------------- the body
def json_depth(raw: bytes) -> int:
    """Deepest nesting of arrays and objects in the JSON text ``raw`` (0 for a scalar),
    counted outside string literals, in C-speed passes (a regex and numpy): no parsing, no
    recursion. For text that is not JSON the count is meaningless but bounded."""
    stripped = _JSON_STRING.sub(b'""', raw)
    steps = _BRACKETS[np.frombuffer(stripped, np.uint8)]
    steps = steps[steps != 0].astype(np.int32)
    return int(np.cumsum(steps).max()) if steps.size else 0


def request_id(scope: Scope) -> str:
    """The id :class:`BodyLimitMiddleware` gave this request (a fresh one if it did not)."""
    state = scope.setdefault("state", {})
    if "request_id" not in state:
        state["request_id"] = uuid.uuid4().hex
    return str(state["request_id"])


class _BodyRefused(Exception):
    def __init__(self, error: APIError, close: bool = False) -> None:
        super().__init__(error.message)
        self.error, self.close = error, close


class BodyLimitMiddleware:
    """The ASGI middleware of the module docstring (``limits``: a :class:`ServerLimits`)."""

    def __init__(self, app: ASGIApp, limits: ServerLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope)
        try:
            body = await self._read(scope, receive, rid)
        except _BodyRefused as refused:
            headers = {"Connection": "close"} if refused.close else None
            await send_api_error(scope, receive, send, refused.error, headers)
            return
        if body is None:  # the client went away during the upload
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: http.disconnect when the client leaves

        await self.app(scope, replay, send)

    async def _read(self, scope: Scope, receive: Receive, rid: str) -> bytes | None:
        limit = self.limits.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            raise _BodyRefused(_too_large(f"{declared} bytes (Content-Length)", limit))
        chunks: list[bytes] = []
        size, started = 0, time.monotonic()
        try:
            async with asyncio.timeout(self.limits.body_read_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        logger.info("request %s: the client disconnected during the body "
                                    "upload (%d bytes received)", rid, size)
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise _BodyRefused(_too_large(f"more than {limit} bytes", limit))
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            waited = time.monotonic() - started
            logger.info("request %s: body not complete after %.1f s (%d bytes); refused (408)",
                        rid, waited, size)
            raise _BodyRefused(APIError(
                408, f"The request body was not received within "
                f"{self.limits.body_read_timeout_s:g} s (--body-read-timeout)",
                code="body_read_timeout"), close=True) from None
        body = b"".join(chunks)
        if body:
            depth = (json_depth(body) if len(body) <= _INLINE_SCAN_BYTES
                     else await asyncio.to_thread(json_depth, body))
            if depth > self.limits.max_json_depth:
                raise _BodyRefused(bad_request(
                    f"The request body nests arrays/objects {depth} levels deep; at most "
                    f"{self.limits.max_json_depth} are allowed (--max-json-depth)", None,
                    "json_too_deep"))
        return body


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses malformed values before the app runs
    return None


def _too_large(what: str, limit: int) -> APIError:
    return APIError(413, f"The request body is too large: {what}; at most {limit} bytes are "
                    "allowed (--max-body-bytes)", code="request_too_large")


# ---------------------------------------------------------------------------- parsed requests
def longest_token_chars(tokenizer: Any) -> int | None:
    """Characters of the longest entry of ``tokenizer.get_vocab()`` (HF tokenizers and
    ``tokenizers.Tokenizer``), an upper bound on the characters one token covers in text
    (byte-level BPE writes each byte as one character, SentencePiece writes the space as one);
    None when the tokenizer has no vocabulary to read."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    vocab = get_vocab()
    return max((len(t) for t in vocab), default=0) or None


def prompt_char_limit(limits: ServerLimits, tokenizer: Any, context_length: int) -> int | None:
    """``limits.max_prompt_chars`` if set, else ``context_length`` x
    :func:`longest_token_chars` (None when the tokenizer cannot tell: no character limit)."""
    if limits.max_prompt_chars is not None:
        return limits.max_prompt_chars
    longest = longest_token_chars(tokenizer) if tokenizer is not None else None
    return None if longest is None else context_length * longest


def check_prompt_chars(text: str, limit: int | None, *, label: str, param: str,
                       context_length: int) -> None:
    """400 ``context_length_exceeded`` (``param``) when ``text`` has more than ``limit``
    characters (``label`` names it in the message)."""
    if limit is not None and len(text) > limit:
        raise bad_request(
            f"The {label} has {len(text)} characters, more than can fit this model's context of "
            f"{context_length} tokens (at most {limit} characters; --max-prompt-chars)", param,
            "context_length_exceeded")


def check_prompt_count(prompts: Sequence[Any], limits: ServerLimits) -> None:
    """400 (``prompt``) for more than ``limits.max_prompts`` prompts."""
    if len(prompts) > limits.max_prompts:
        raise bad_request(f"'prompt' has {len(prompts)} prompts; at most {limits.max_prompts} "
                          "are allowed per request (--max-prompts)", "prompt", "too_many_prompts")


def check_stop(stop: Sequence[str] | None, limits: ServerLimits) -> None:
    """400 (``stop``) for more than ``max_stop_strings`` stop strings or one longer than
    ``max_stop_chars`` characters."""
    stop = stop or ()
    if len(stop) > limits.max_stop_strings:
        raise bad_request(f"'stop' has {len(stop)} strings; at most {limits.max_stop_strings} "
                          "are allowed (--max-stop-strings)", "stop", "too_many_stop_strings")
    for i, s in enumerate(stop):
        if len(s) > limits.max_stop_chars:
            raise bad_request(f"'stop[{i}]' has {len(s)} characters; at most "
                              f"{limits.max_stop_chars} are allowed (--max-stop-chars)", "stop",
                              "stop_string_too_long")


def tokenize_char_limit(limits: ServerLimits, prompt_chars: int | None) -> int | None:
    """``limits.max_tokenize_chars`` if set, else ``prompt_chars`` (the prompt's limit, from
    :func:`prompt_char_limit`): text a prompt may not carry is not tokenized for
    ``/tokenize`` either (issue 25: a 3 MB text held the server's one tokenizer thread, which
    every completion waits for, 7 s)."""
    return limits.max_tokenize_chars if limits.max_tokenize_chars is not None else prompt_chars


def check_tokenize_chars(texts: Sequence[str], limit: int | None, *, param: str) -> None:
    """400 ``text_too_long`` (``param``) when ``texts`` have more than ``limit`` characters
    together (one request's texts share the one tokenizer thread)."""
    total = sum(len(t) for t in texts)
    if limit is not None and total > limit:
        raise bad_request(
            f"'{param}' has {total} characters; /tokenize takes at most {limit} per request "
            "(--max-tokenize-chars)", param, "text_too_long")


def check_detokenize_tokens(count: int, limits: ServerLimits) -> None:
    """400 ``too_many_tokens`` (``tokens``) when a ``/detokenize`` request carries more than
    ``limits.max_detokenize_tokens`` token ids."""
    if count > limits.max_detokenize_tokens:
        raise bad_request(
            f"'tokens' has {count} token ids; /detokenize takes at most "
            f"{limits.max_detokenize_tokens} per request (--max-detokenize-tokens)", "tokens",
            "too_many_tokens")
