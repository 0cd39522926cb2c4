"""specdial's OpenAI-compatible HTTP server (FastAPI + uvicorn) and its typed options.

- :mod:`specdial.server.config`: :class:`EngineArgs`, :class:`ServeConfig`,
  :class:`GenerateConfig` (every option of ``specdial serve`` / ``specdial generate``);
- :mod:`specdial.server.app`: :func:`create_app` (wiring: middleware and the routers of
  :mod:`~specdial.server.openai_api`, :mod:`~specdial.server.sglang_api` and
  :mod:`~specdial.server.ops_api`, sharing :class:`~specdial.server.state.ServerState`);
- :mod:`specdial.server.protocol`: request validation and the OpenAI error JSON;
- :mod:`specdial.server.chat`: chat templates;
- :mod:`specdial.server.metrics`: ``/metrics``;
- :mod:`specdial.server.launch`: uvicorn with graceful SIGTERM handling.

The names below are imported lazily so that the CLI's ``--help`` and ``policy replay`` do not
import FastAPI.
"""

from __future__ import annotations

from typing import Any

from specdial.server.config import BUILTIN_MODEL_NAME, EngineArgs, GenerateConfig, ServeConfig

__all__ = ["BUILTIN_MODEL_NAME", "EngineArgs", "GenerateConfig", "ServeConfig", "create_app",
           "make_server", "serve_forever"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from specdial.server.app import create_app

        return create_app
    if name in ("make_server", "serve_forever"):
        from specdial.server import launch

        return getattr(launch, name)
    raise AttributeError(f"module 'specdial.server' has no attribute {name!r}")
