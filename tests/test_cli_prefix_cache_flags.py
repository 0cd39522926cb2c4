"""Issue 30: the prefix cache's switches on every command that builds an engine, SGLang's
``--disable-radix-cache`` and vLLM's ``--[no-]enable-prefix-caching``
(:mod:`specdial.engine.cache_flags`): each reaches the Engine's ``enable_prefix_caching``,
contradicting ones are refused naming both, agreeing ones are accepted."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specdial.bench.cli import BenchConfig, CompareConfig
from specdial.cli import build_parser
from specdial.cli_serve import _defaults
from specdial.engine.cache_flags import resolve_prefix_cache_flags
from specdial.server.config import GenerateConfig, ServeConfig, config_from_args
from specdial.server.flags import resolve_compat
from timeouts import scaled

COMMANDS = {"serve": (["serve"], ServeConfig), "generate": (["generate", "x"], GenerateConfig),
            "bench": (["bench"], BenchConfig), "compare": (["bench", "compare"], CompareConfig)}


def _config(command: str, *argv: str):
    prefix, cls = COMMANDS[command]
    args = build_parser().parse_args([*prefix, *argv])
    if command in ("serve", "generate"):
        resolve_compat(args, _defaults(cls))
    else:
        resolve_prefix_cache_flags(args)
    return config_from_args(cls, args)


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("argv, on", [
    ([], True),  # on by default, as in SGLang and vLLM
    (["--enable-prefix-caching"], True),
    (["--no-enable-prefix-caching"], False),
    (["--disable-radix-cache"], False),
    (["--disable-radix-cache", "--no-enable-prefix-caching"], False),  # they agree
])
def test_each_switch_reaches_the_engine(command, argv, on):
    cfg = _config(command, *argv)
    assert cfg.enable_prefix_caching is on
    assert cfg.engine_kwargs()["enable_prefix_caching"] is on


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("argv, names", [
    (["--disable-radix-cache", "--enable-prefix-caching"],
     ("--enable-prefix-caching", "--disable-radix-cache")),
    (["--enable-prefix-caching", "--no-enable-prefix-caching"],
     ("--enable-prefix-caching", "--no-enable-prefix-caching")),
])
def test_contradicting_switches_are_refused_naming_both(command, argv, names):
    with pytest.raises(ValueError, match="give one of them") as e:
        _config(command, *argv)
    assert all(n in str(e.value) for n in names)


def test_the_commands_exit_2_on_contradicting_switches_before_loading():
    for argv in (["serve", "--disable-radix-cache", "--enable-prefix-caching"],
                 ["bench", "--enable-prefix-caching", "--no-enable-prefix-caching"]):
        r = subprocess.run([sys.executable, "-m", "specdial.cli", *argv], capture_output=True,
                           text=True, timeout=scaled(120))
        assert r.returncode == 2 and "give one of them" in r.stderr, (argv, r.stderr)
        assert "loading the engine" not in r.stderr


def test_the_help_names_every_switch():
    for prefix in (["serve"], ["generate"], ["bench"]):
        text = subprocess.run([sys.executable, "-m", "specdial.cli", *prefix, "--help"],
                              capture_output=True, text=True, timeout=scaled(120)).stdout
        for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching",
                     "--disable-radix-cache"):
            assert flag in text, (prefix, flag)


def test_the_record_of_the_switches_given_does_not_outlive_the_check():
    """``vars(args)`` stays the options (``Config(**vars(args))`` keeps working): the record
    is kept only for the prefix-cache switch, and removed when it is read."""
    args = build_parser().parse_args(["serve", "--no-speculative-adaptive"])
    assert "bool_flags_given" not in vars(args)
    args = build_parser().parse_args(["serve", "--enable-prefix-caching"])
    resolve_prefix_cache_flags(args)
    assert "bool_flags_given" not in vars(args) and args.enable_prefix_caching is True
