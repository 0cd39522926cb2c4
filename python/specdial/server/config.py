"""Typed options of ``specdial serve`` and ``specdial generate``.

Every command-line option is a field of one dataclass: :class:`~specdial.engine.args.EngineArgs`
(the engine, defined in :mod:`specdial.engine.args` and re-exported here), extended by
:class:`ServeConfig` (HTTP server) and :class:`GenerateConfig` (one offline generation). The
argparse options are generated from the fields (:func:`add_dataclass_arguments`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from specdial.engine.args import (BUILTIN_MODEL_NAME, EngineArgs,
                                  add_dataclass_arguments, config_from_args)
from specdial.config import option as _opt
from specdial.server.defaults import (DEFAULT_BODY_READ_TIMEOUT_S, DEFAULT_HEADER_READ_TIMEOUT_S,
                                      DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONNECTIONS,
                                      DEFAULT_MAX_DETOKENIZE_TOKENS, DEFAULT_MAX_JSON_DEPTH,
                                      DEFAULT_MAX_PROMPTS, DEFAULT_MAX_STOP_CHARS,
                                      DEFAULT_MAX_STOP_STRINGS)

__all__ = ["BUILTIN_MODEL_NAME", "EngineArgs", "GenerateConfig", "ServeConfig",
           "add_dataclass_arguments", "config_from_args"]

#: Environment variable read by ``specdial serve`` at startup when ``--api-key`` is not given
#: (as vLLM reads ``VLLM_API_KEY``).
API_KEY_ENV = "SPECDIAL_API_KEY"



@dataclass
class ServeConfig(EngineArgs):
    """Options of ``specdial serve``: the engine options plus the HTTP server's."""

    host: str = _opt("address to listen on", default="127.0.0.1")
    port: int = _opt("TCP port; 0: a free port the OS picks, named by uvicorn's 'Uvicorn "
                     "running on' log line (for tests and scripts that must not race for one)",
                     default=30000)
    served_model_name: str | None = _opt(
        f"model name in the API (the `model` field, /v1/models); default: {BUILTIN_MODEL_NAME} "
        "for the built-in models, else --model-path", metavar="NAME")
    shutdown_timeout: float = _opt(
        "on SIGTERM/SIGINT, seconds to let running requests finish; then the rest are aborted "
        "(each open stream ends with a finish_reason 'abort' event and [DONE])",
        default=30.0, metavar="SECONDS")
    api_key: str | None = _opt(
        "require 'Authorization: Bearer KEY' on every route except /health and /metrics "
        f"(401 otherwise; compared in constant time); default: ${API_KEY_ENV} if set, else "
        "no key", metavar="KEY")
    allowed_hosts: str | None = _opt(
        "comma-separated host names the Host header may carry (else 400; against DNS "
        "rebinding), '*' for any; default: localhost, 127.0.0.1 and ::1 when --host is a "
        "loopback address, else any", metavar="NAMES")
    allowed_origins: str | None = _opt(
        "comma-separated (or a JSON list, as vLLM's) origins (scheme://host[:port]) allowed to "
        "call the server from a browser (CORS), '*' for any; default: none", metavar="ORIGINS")
    max_body_bytes: int = _opt(
        "largest request body in bytes; a larger Content-Length, or a chunked body passing it, "
        "is refused with 413 before the body is parsed", default=DEFAULT_MAX_BODY_BYTES,
        metavar="BYTES")
    body_read_timeout: float = _opt(
        "seconds from a request's start to its complete body; slower uploads are refused with "
        "408 and the connection closed", default=DEFAULT_BODY_READ_TIMEOUT_S, metavar="SECONDS")
    max_json_depth: int = _opt(
        "deepest nesting of JSON arrays/objects in a body (400 beyond)",
        default=DEFAULT_MAX_JSON_DEPTH, metavar="N")
    max_prompts: int = _opt("most prompts in one /v1/completions request (400 beyond)",
                            default=DEFAULT_MAX_PROMPTS, metavar="N")
    max_stop_strings: int = _opt("most stop strings per request (400 beyond)",
                                 default=DEFAULT_MAX_STOP_STRINGS, metavar="N")
    max_stop_chars: int = _opt("most characters per stop string (400 beyond)",
                               default=DEFAULT_MAX_STOP_CHARS, metavar="N")
    header_read_timeout: float = _opt(
        "seconds a connection has to send a request's complete headers (from its opening or its "
        "previous response); slower clients get 408 and the connection is closed",
        default=DEFAULT_HEADER_READ_TIMEOUT_S, metavar="SECONDS")
    max_connections: int = _opt(
        "most open connections (those still sending headers included); a request on a "
        "connection beyond it gets 503 at once, except /health and /metrics",
        default=DEFAULT_MAX_CONNECTIONS, metavar="N")
    max_tokenize_chars: int | None = _opt(
        "most characters in one /tokenize request (its prompts together, or the rendered chat), "
        "refused with "
        "400 before tokenizing; default: the prompt's character limit (--max-prompt-chars or "
        "its automatic bound)", metavar="N")
    max_detokenize_tokens: int = _opt(
        "most token ids in one /detokenize request (all lists together); 400 beyond",
        default=DEFAULT_MAX_DETOKENIZE_TOKENS, metavar="N")
    max_prompt_chars: int | None = _opt(
        "most characters in one prompt (or rendered chat), refused with 400 before tokenizing; "
        "default: the context length x the characters of the tokenizer's longest token (text "
        "that long cannot fit the context)", metavar="N")

    def check(self) -> None:
        """:meth:`EngineArgs.check`, plus ``port`` in 0..65535 (0: a free port the OS picks),
        ``served_model_name`` not empty when given, ``shutdown_timeout`` a finite number >= 0
        and the limits and access options (:meth:`server_limits`, :meth:`security_config`).
        Raises ``ValueError`` naming the option."""
        super().check()
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not (
                0 <= self.port <= 65535):
            raise ValueError(f"--port must be an integer in 0..65535 (0: a free port the OS "
                             f"picks), got {self.port}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("--served-model-name must be a non-empty name (the API's `model`), "
                             f"got {self.served_model_name!r}; leave it out for the default")
        if not (self.shutdown_timeout >= 0 and math.isfinite(self.shutdown_timeout)):
            raise ValueError(f"--shutdown-timeout must be a finite number of seconds >= 0, got "
                             f"{self.shutdown_timeout}")
        self.server_limits()
        self.connection_limits()
        self.security_config({})

    def server_limits(self) -> Any:
        """The :class:`specdial.server.limits.ServerLimits` of these options (``ValueError``
        naming the option for a bad value)."""
        from specdial.server.limits import ServerLimits

        return ServerLimits(max_body_bytes=self.max_body_bytes,
                            body_read_timeout_s=self.body_read_timeout,
                            max_json_depth=self.max_json_depth, max_prompts=self.max_prompts,
                            max_stop_strings=self.max_stop_strings,
                            max_stop_chars=self.max_stop_chars,
                            max_prompt_chars=self.max_prompt_chars,
                            max_tokenize_chars=self.max_tokenize_chars,
                            max_detokenize_tokens=self.max_detokenize_tokens)

    def connection_limits(self) -> Any:
        """The :class:`specdial.server.connections.ConnectionLimits` of these options
        (``ValueError`` naming the option for a bad value)."""
        from specdial.server.connections import ConnectionLimits

        return ConnectionLimits(header_read_timeout_s=self.header_read_timeout,
                                max_connections=self.max_connections)

    def security_config(self, environ: Mapping[str, str]) -> Any:
        """The :class:`specdial.server.security.SecurityConfig` of these options; ``environ``
        supplies ``SPECDIAL_API_KEY`` when ``--api-key`` is not given (an empty value counts as
        unset). ``ValueError`` naming the option for a bad value."""
        from specdial.server.security import (SecurityConfig, default_allowed_hosts,
                                              parse_name_list)

        key = self.api_key if self.api_key is not None else (environ.get(API_KEY_ENV) or None)
        try:
            hosts = parse_name_list(self.allowed_hosts)
        except ValueError as e:
            raise ValueError(f"--allowed-hosts: {e}") from None
        try:
            origins = parse_name_list(self.allowed_origins) or ()
        except ValueError as e:
            raise ValueError(f"--allowed-origins: {e}") from None
        return SecurityConfig(
            api_key=key,
            allowed_hosts=default_allowed_hosts(self.host) if hosts is None else hosts,
            allowed_origins=origins)

    def model_name(self) -> str:
        """``served_model_name`` if set, else :meth:`EngineArgs.default_model_name`."""
        return self.served_model_name or self.default_model_name()


@dataclass
class GenerateConfig(EngineArgs):
    """Options of ``specdial generate``: the prompt, sampling and the engine options."""

    log_level: str = _opt("log level of specdial", default="warning",
                          choices=("critical", "error", "warning", "info", "debug"))
    prompt: str = _opt("the prompt text", default="", positional=True)
    max_new_tokens: int = _opt("most tokens to generate", default=128, metavar="N")
    temperature: float | None = _opt(
        "sampling temperature; 0 = greedy (the output equals target-only greedy decoding). "
        "Default: the engine's sampling defaults, as for SGLang's Engine and every server "
        "route: the target's generation_config.json (--sampling-defaults model), else 1.0; "
        "specdial bench alone is greedy by default", metavar="T")
    top_p: float | None = _opt("nucleus sampling mass in (0, 1]; 1 = off; default: the "
                               "engine's sampling defaults (1 unless the model says)",
                               metavar="P")
    top_k: int | None = _opt("sample among the k most likely tokens; -1 = off; default: the "
                             "engine's sampling defaults (off unless the model says)",
                             metavar="K")
    seed: int | None = _opt(  # type: ignore[assignment]
        "sampling seed, vLLM's --seed: the engine's sampling seed, and this request's seed (its "
        "tokens are then those plain decoding samples with it, whatever the steps)",
        default=None, metavar="N")
    compare_no_spec: bool = _opt(
        "after the generation, run the same one without speculation on the loaded target and "
        "print its time and the speed-up", default=False)
    json: bool = _opt("print one JSON object (text, output_ids, meta_info, seconds) instead of "
                      "text and a statistics block", default=False)

    def sampling_params(self) -> dict[str, Any]:
        """The Engine ``sampling_params`` dict: the options given (the engine fills the others
        from its sampling defaults)."""
        params: dict[str, Any] = {"max_new_tokens": self.max_new_tokens}
        for name in ("temperature", "top_p", "top_k", "seed"):
            if getattr(self, name) is not None:
                params[name] = getattr(self, name)
        return params
