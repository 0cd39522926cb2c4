"""The prefix cache's command-line switches, SGLang's and vLLM's names, on every command that
builds an engine (``serve``, ``generate``, ``bench``, ``bench compare``, ``bench cost-table``).

=============================== =========== ==============================================
flag                             origin      effect
=============================== =========== ==============================================
``--enable-prefix-caching``      vLLM        the cache on (the default, as in vLLM and SGLang)
``--no-enable-prefix-caching``   vLLM        the cache off
``--disable-radix-cache``        SGLang      the cache off
=============================== =========== ==============================================

The first two are generated from :attr:`specdial.config.EngineConfig.enable_prefix_caching` by
:func:`specdial.engine.args.add_dataclass_arguments`; :func:`add_prefix_cache_flags` adds
SGLang's. Flags that contradict each other (``--disable-radix-cache`` with
``--enable-prefix-caching``, or ``--enable-prefix-caching`` with ``--no-enable-prefix-caching``)
are refused by :func:`resolve_prefix_cache_flags` with a ``ValueError`` naming both, instead of
the last one winning silently; flags that agree (``--disable-radix-cache
--no-enable-prefix-caching``) are accepted.
"""

from __future__ import annotations

import argparse

from specdial.engine.args import BOOL_FLAGS_GIVEN, BoolFlag

__all__ = ["DISABLE_RADIX_CACHE", "FIELD", "add_prefix_cache_flags",
           "resolve_prefix_cache_flags"]

#: SGLang's switch.
DISABLE_RADIX_CACHE = "--disable-radix-cache"
#: The engine option the switches set.
FIELD = "enable_prefix_caching"
_DEST = "compat_disable_radix_cache"


def add_prefix_cache_flags(parser: argparse.ArgumentParser) -> None:
    """Register ``--disable-radix-cache`` on ``parser`` (one built by
    :func:`~specdial.engine.args.add_dataclass_arguments` from a config with the
    ``enable_prefix_caching`` field), and have its ``--[no-]enable-prefix-caching`` record
    which were given (:class:`~specdial.engine.args.BoolFlag`)."""
    for action in parser._actions:
        if action.dest == FIELD and isinstance(action, BoolFlag):
            action.record_given = True
    parser.add_argument(DISABLE_RADIX_CACHE, dest=_DEST, action="store_true", default=False,
                        help="SGLang's name for --no-enable-prefix-caching: no prefix cache, "
                        "every prompt is prefilled in full")


def resolve_prefix_cache_flags(args: argparse.Namespace) -> argparse.Namespace:
    """Fold ``--disable-radix-cache`` into ``args.enable_prefix_caching`` (in place; returned)
    and refuse contradicting switches (module docstring) with a ``ValueError`` naming them.
    ``args`` without the option (a parser that has none) is returned unchanged."""
    record = getattr(args, BOOL_FLAGS_GIVEN, None) or {}
    if hasattr(args, BOOL_FLAGS_GIVEN):
        delattr(args, BOOL_FLAGS_GIVEN)  # read once; vars(args) stays the options
    given = record.get(FIELD, [])
    disable = bool(getattr(args, _DEST, False))
    values = {flag: not flag.startswith("--no-") for flag in given}
    if disable:
        values[DISABLE_RADIX_CACHE] = False
    if len(set(values.values())) > 1:
        on = [f for f, v in values.items() if v]
        off = [f for f, v in values.items() if not v]
        raise ValueError(f"{' '.join(on)} turns the prefix cache on and {' '.join(off)} turns "
                         "it off; give one of them")
    if disable:
        setattr(args, FIELD, False)
        names = getattr(args, "_flag_names", None)
        if names is None:
            names = {}
            setattr(args, "_flag_names", names)
        names[FIELD] = DISABLE_RADIX_CACHE
    return args
