"""``specdial generate`` and ``specdial serve``.

- ``specdial generate "PROMPT" [engine options] [--max-new-tokens --temperature --top-p --top-k
  --seed --compare-no-spec --json]`` loads the engine, generates one completion and prints the
  prompt with it, the policy and its bounds, the speculation statistics, start-up and
  generation time apart, optionally the same generation without speculation, and why runs
  differ (:mod:`specdial.generate_cmd`).
- ``specdial serve [engine options] [--host --port --served-model-name --shutdown-timeout]
  [--api-key --allowed-hosts --allowed-origins] [limits]`` starts the OpenAI-compatible server
  (:mod:`specdial.server.app`) and runs until SIGTERM or SIGINT (:mod:`specdial.server.launch`).
  ``SPECDIAL_API_KEY`` is read here, at startup, when ``--api-key`` is not given.

The options are the fields of :class:`specdial.server.config.GenerateConfig` and
:class:`~specdial.server.config.ServeConfig`. Exit status: 0 on success, 2 on bad options,
models that fail to load or a rejected prompt, 1 when the server cannot start.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import Any

from specdial.cli_common import cli_error, setup_logging
from specdial.server.config import (GenerateConfig, ServeConfig, add_dataclass_arguments,
                                    config_from_args)
from specdial.server.flags import add_compat_flags, resolve_compat

__all__ = ["add_subcommands", "run_generate", "run_serve", "run_subcommand"]

SUBCOMMANDS = ("generate", "serve")

_LOAD_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError,
                                                 NotImplementedError, OSError)


def add_subcommands(sub: Any) -> None:
    """Register ``generate`` and ``serve`` on the ``add_subparsers()`` object ``sub``."""
    gen = sub.add_parser(
        "generate", help="generate one completion and print the speculation statistics",
        description="Generate one completion with the engine and print it, then the "
        "speculation statistics (verify count, acceptance length, steps histogram, tokens/s).")
    add_dataclass_arguments(gen, GenerateConfig)
    add_compat_flags(gen)
    serve = sub.add_parser(
        "serve", help="start the OpenAI-compatible HTTP server",
        description="Serve /v1/completions, /v1/chat/completions (SSE streaming or not), "
        "/v1/models, /health and /metrics (Prometheus) with adaptive speculative decoding. "
        "Access: with --api-key (or $SPECDIAL_API_KEY) every route except /health and /metrics "
        "needs 'Authorization: Bearer KEY'; the Host header must be one of --allowed-hosts "
        "(loopback names by default on a loopback address); CORS only for --allowed-origins; "
        "request bodies must be application/json. Limits, checked before parsing or "
        "tokenizing: --max-body-bytes (413), --body-read-timeout (408), --max-json-depth, "
        "--max-prompts, --max-stop-strings, --max-stop-chars, --max-prompt-chars (400). "
        "A request with a seed gets the tokens plain decoding samples with that seed, whatever "
        "its batch, the steps, the drafter or whether speculation is on. "
        "On SIGTERM or SIGINT the server closes its listening socket (new connections are "
        "refused; requests arriving on already-open connections get 503), lets running "
        "requests finish for --shutdown-timeout seconds, aborts the rest (streams end with a "
        "finish_reason 'abort' event) and exits with status 0.")
    add_dataclass_arguments(serve, ServeConfig)
    add_compat_flags(serve, positional_model=True)


def run_subcommand(args: argparse.Namespace) -> int:
    """Run ``args.command`` (``generate`` or ``serve``); returns the exit status (2 for a bad
    SGLang/vLLM-style flag, :mod:`specdial.server.flags`)."""
    try:
        resolve_compat(args, _defaults(GenerateConfig if args.command == "generate"
                                       else ServeConfig))
    except ValueError as e:
        return cli_error(e)
    names = dict(getattr(args, "_flag_names", {}))
    if args.command == "generate":
        cfg: Any = config_from_args(GenerateConfig, args)
        cfg.flag_names = names
        return run_generate(cfg)
    if args.command == "serve":
        cfg = config_from_args(ServeConfig, args)
        cfg.flag_names = names
        return run_serve(cfg)
    raise ValueError(f"not a serving subcommand: {args.command!r}")


def _defaults(cls: type) -> argparse.ArgumentParser:
    """A parser holding ``cls``'s option defaults (what an alias may override)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_dataclass_arguments(parser, cls)
    return parser


def _load_engine(cfg: Any) -> Any:
    try:
        return cfg.build_engine()
    except _LOAD_ERRORS as e:
        cli_error(f"cannot start the engine: {e}")
        return None


def run_generate(cfg: GenerateConfig) -> int:
    """``specdial generate``: returns 0, or 2 (message on stderr) for bad options (checked
    before the engine loads), or when the engine cannot be built or rejects the
    prompt/sampling options. The output: :mod:`specdial.generate_cmd`."""
    from specdial.generate_cmd import format_generation, run_generation

    setup_logging(cfg.log_level)
    try:
        cfg.check()
    except (ValueError, OSError) as e:  # bad options, an unreadable config file
        return cli_error(e)
    start = time.perf_counter()
    engine = _load_engine(cfg)
    if engine is None:
        return 2
    try:
        report = run_generation(engine, cfg, time.perf_counter() - start)
    except ValueError as e:  # RequestError is a ValueError
        return cli_error(e)
    print(json.dumps(report) if cfg.json else format_generation(report))
    return 0


def run_serve(cfg: ServeConfig) -> int:
    """``specdial serve``: runs until SIGTERM/SIGINT; returns 0 after a graceful shutdown, 2
    for bad options (checked before the engine loads) or when the engine cannot be built, 1
    when the server cannot start."""
    setup_logging(cfg.log_level)
    try:
        cfg.check()  # the server's options too, before the (slow) engine load
        limits, security = cfg.server_limits(), cfg.security_config(os.environ)
        connection_limits = cfg.connection_limits()
        parallel = cfg.parallel_options()
    except (ValueError, OSError) as e:  # bad options, an unreadable config file
        return cli_error(e)
    log = logging.getLogger("specdial.server")
    if parallel.node_rank > 0:  # SGLang's layout: only node 0 serves
        from specdial.launch.rank import device_problem
        from specdial.launch.tp_engine import start_worker_node
        from specdial.engine.resolve import resolve_device_name

        device = str(resolve_device_name(cfg.device)).split(":")[0]
        per_node = parallel.tp_size // parallel.nnodes
        problem = device_problem(device, per_node - 1)
        if problem is not None:
            return cli_error(f"node {parallel.node_rank}: {problem}")

        log.info("node %d of %d: running tensor-parallel ranks for %s", parallel.node_rank,
                 parallel.nnodes, parallel.dist_init_addr)
        return start_worker_node(parallel, device)
    log.info("loading the engine (%s)", cfg.model_path or "built-in models")
    engine = _load_engine(cfg)
    if engine is None:
        return 2
    from specdial.server.app import create_app
    from specdial.server.launch import make_server, serve_forever

    import dataclasses

    # /server_info reports the options; never the key itself
    server_args = {**dataclasses.asdict(cfg), "api_key": "<set>" if security.api_key else None}
    app = create_app(engine, served_model_name=cfg.model_name(), server_args=server_args,
                     limits=limits, security=security)
    log.info("API key: %s; allowed hosts: %s; CORS origins: %s",
             "required" if security.api_key else "none",
             ", ".join(security.allowed_hosts) if security.allowed_hosts else "any",
             ", ".join(security.allowed_origins) or "none")
    server = make_server(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                         shutdown_timeout=cfg.shutdown_timeout,
                         connection_limits=connection_limits)
    log.info("serving %r on http://%s:%s", cfg.model_name(), cfg.host,
             cfg.port or "<a free port: see uvicorn's 'running on' line>")
    return serve_forever(server)
