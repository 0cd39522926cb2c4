"""The engine's options are defined once (specdial.engine.args) and bench reads them without
importing the HTTP server; the server's config re-exports them under their old path."""

from __future__ import annotations

import subprocess
import sys
from timeouts import scaled


def test_bench_gets_the_engine_options_without_the_server():
    code = ("import sys, specdial.bench.cli, specdial.bench.cost_table\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('specdial.server'))\n"
            "assert not loaded, loaded\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=scaled(120))
    assert proc.returncode == 0, proc.stderr


def test_the_server_config_re_exports_the_engine_options():
    from specdial.engine import args as engine_args
    from specdial.server import config

    assert config.EngineArgs is engine_args.EngineArgs
    assert issubclass(config.ServeConfig, engine_args.EngineArgs)
    assert config.config_from_args is engine_args.config_from_args
