"""Defaults of the server's limits: the options of ``specdial serve``
(:class:`~specdial.server.config.ServeConfig`) and the checks that apply them
(:class:`~specdial.server.limits.ServerLimits`,
:class:`~specdial.server.connections.ConnectionLimits`). Their own module so that the checks
and the options both read them without importing each other (the options build the checks)."""

from __future__ import annotations

__all__ = ["DEFAULT_BODY_READ_TIMEOUT_S", "DEFAULT_HEADER_READ_TIMEOUT_S",
           "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_CONNECTIONS", "DEFAULT_MAX_DETOKENIZE_TOKENS",
           "DEFAULT_MAX_JSON_DEPTH", "DEFAULT_MAX_PROMPTS", "DEFAULT_MAX_STOP_CHARS",
           "DEFAULT_MAX_STOP_STRINGS"]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_BODY_READ_TIMEOUT_S = 30.0
DEFAULT_MAX_JSON_DEPTH = 32
DEFAULT_MAX_PROMPTS = 128
DEFAULT_MAX_STOP_STRINGS = 16
DEFAULT_MAX_STOP_CHARS = 256
DEFAULT_MAX_DETOKENIZE_TOKENS = 131072
DEFAULT_HEADER_READ_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 1000
