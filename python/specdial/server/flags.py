"""SGLang's and vLLM's command-line names on ``specdial serve`` / ``generate`` (``bench``:
:mod:`specdial.bench.flags`, which reuses these aliases and refusals).

Aliases (same meaning, so they set the specdial option; giving both with different values is
an error):

=================================== ============================ ===================================
flag (origin)                        specdial option              note
=================================== ============================ ===================================
``--model`` (both), ``serve MODEL``  ``--model-path``             positional: vLLM's ``vllm serve``
``--speculative-draft-model-path``   ``--draft-model-path``       SGLang
``--max-num-seqs`` (vLLM)            ``--max-running-requests``
``--max-model-len`` (vLLM)           ``--context-length``
``--max-total-tokens`` (SGLang)      ``--kv-cache-tokens``
``--tensor-parallel-size`` (vLLM)    ``--tp-size``
``--data-parallel-size`` (vLLM)      ``--dp-size``
``--cuda-graph-max-bs`` (SGLang)     ``--cuda-graph-bs``          SGLang's sizes up to N
``--speculative-config`` (vLLM)      the speculation options     JSON: ``method``, ``model``,
                                                                   ``num_speculative_tokens``
``--disable-radix-cache`` (SGLang)   ``--no-enable-prefix-cach``  vLLM's ``--[no-]enable-prefix-
                                     ``ing``                      caching`` are the option itself
=================================== ============================ ===================================

The prefix cache's switches and their conflicts: :mod:`specdial.engine.cache_flags`.
SGLang's ``--speculative-eagle-topk`` and ``--speculative-num-draft-tokens`` are options of
their own with SGLang's meaning (:class:`~specdial.config.EngineConfig`, issue 29), not aliases.

``--chunked-prefill-size`` (one request's prefill chunk) and ``--max-prefill-tokens`` (the
prefill batch's budget) are separate options with SGLang's meanings, not aliases.
``--speculative-algorithm STANDALONE`` (SGLang's name for a separate draft model) is ``DRAFT``.
Flags whose meaning differs from any specdial option are errors naming the equivalent:
``--mem-fraction-static`` / ``--gpu-memory-utilization`` (a fraction of GPU memory; specdial
sizes its KV cache in tokens: ``--kv-cache-tokens``) and ``--max-num-batched-tokens`` (vLLM's
budget includes decode tokens; specdial budgets prompt tokens: ``--max-prefill-tokens``).

:func:`add_compat_flags` registers them on a parser built by
:func:`~specdial.server.config.add_dataclass_arguments`; :func:`resolve_compat` folds them into
the canonical attributes (raising ``ValueError`` naming the flag) before the config object is
built.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from specdial.engine.cache_flags import add_prefix_cache_flags, resolve_prefix_cache_flags
from specdial.engine.compat_names import ALIASES, DIFFERENT

__all__ = ["ALIASES", "DIFFERENT", "add_compat_flags", "resolve_compat"]

#: vLLM ``--speculative-config`` ``method`` -> ``--speculative-algorithm``
_METHODS = {"eagle": "EAGLE", "draft_model": "DRAFT"}
_PREFIX = "compat_"


class _Different(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string}: {DIFFERENT[str(option_string)]}")


def add_compat_flags(parser: argparse.ArgumentParser, *, positional_model: bool = False) -> None:
    """Register the aliases and refusals of the module docstring on ``parser``;
    ``positional_model``: also vLLM's positional ``MODEL`` (``specdial serve MODEL``)."""
    types = {a.dest: a.type for a in parser._actions}
    for flag, dest in ALIASES.items():
        parser.add_argument(flag, dest=_PREFIX + dest, type=types.get(dest), default=None,
                            metavar=dest.upper(), help=f"alias of --{dest.replace('_', '-')}")
    if positional_model:
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                            help="model directory (vLLM's `vllm serve MODEL`): same as "
                            "--model-path")
    parser.add_argument("--cuda-graph-max-bs", dest=_PREFIX + "cuda_graph_max_bs", type=int,
                        default=None, metavar="N",
                        help="capture SGLang's default CUDA-graph batch sizes up to N")
    parser.add_argument("--speculative-config", dest=_PREFIX + "speculative_config",
                        default=None, metavar="JSON",
                        help="vLLM's speculation config: method (eagle, draft_model), model, "
                        "num_speculative_tokens")
    for flag, instead in DIFFERENT.items():
        parser.add_argument(flag, action=_Different, nargs="?", help=f"refused: {instead}")
    add_prefix_cache_flags(parser)


def _set(args: argparse.Namespace, dest: str, value: Any, flag: str,
         defaults: dict[str, Any]) -> None:
    current = getattr(args, dest, None)
    if current is not None and current != defaults.get(dest) and current != value:
        raise ValueError(f"{flag} {value} conflicts with --{dest.replace('_', '-')} {current}; "
                         "give one of them")
    setattr(args, dest, value)
    names = getattr(args, "_flag_names", None)
    if names is None:
        names = {}
        setattr(args, "_flag_names", names)
    names[dest] = flag


#: The specdial attribute of each ``--speculative-config`` key, reversed: errors name the key.
_SPEC_KEYS = {"speculative_algorithm": "method", "draft_model_path": "model",
              "speculative_num_steps": "num_speculative_tokens"}


def _speculative_config(text: str) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` JSON -> specdial attributes."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config: not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError("--speculative-config: expected a JSON object")
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        if key == "method":
            if value not in _METHODS:
                raise ValueError(f"--speculative-config: method {value!r} is not supported; "
                                 f"supported: {', '.join(_METHODS)}")
            out["speculative_algorithm"] = _METHODS[value]
        elif key == "model":
            out["draft_model_path"] = value
        elif key == "num_speculative_tokens":
            out["speculative_num_steps"] = value
        else:
            raise ValueError(f"--speculative-config: key {key!r} has no specdial equivalent; "
                             "supported keys: method, model, num_speculative_tokens (the most "
                             "steps: the steps adapt up to it unless --no-speculative-adaptive "
                             "fixes them; see --speculative-adaptive-config)")
    return out


def resolve_compat(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None
                   ) -> argparse.Namespace:
    """Fold the compat attributes of ``args`` into the canonical ones (in place; returned).
    ``parser`` gives the canonical defaults (a canonical option left at its default yields to
    an alias). Raises ``ValueError`` naming the flag for conflicts and bad values."""
    defaults = {a.dest: a.default for a in parser._actions} if parser is not None else {}
    for flag, dest in ALIASES.items():
        value = getattr(args, _PREFIX + dest, None)
        if value is not None:
            _set(args, dest, value, flag, defaults)
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        _set(args, "model_path", tag, "MODEL", defaults)
    spec = getattr(args, _PREFIX + "speculative_config", None)
    if spec is not None:
        for dest, value in _speculative_config(spec).items():  # named by its JSON key
            _set(args, dest, value, f"--speculative-config's {_SPEC_KEYS[dest]}", defaults)
    resolve_prefix_cache_flags(args)
    if getattr(args, "speculative_algorithm", None) == "STANDALONE":
        args.speculative_algorithm = "DRAFT"
    # SGLang's chain count alone sets the steps (the rules: EngineConfig, which checks them)
    n = getattr(args, "speculative_num_draft_tokens", None)
    if (n is not None and getattr(args, "speculative_num_steps", None) is None
            and getattr(args, "speculative_eagle_topk", 1) == 1):
        if n < 1:
            raise ValueError(f"--speculative-num-draft-tokens {n}: must be >= 1 (steps + 1)")
        args.speculative_num_steps = n - 1
    max_bs = getattr(args, _PREFIX + "cuda_graph_max_bs", None)
    if max_bs is not None:
        if getattr(args, "cuda_graph_bs", None) is not None:
            raise ValueError("--cuda-graph-max-bs and --cuda-graph-bs: give one of them")
        from specdial.config import default_cuda_graph_bs

        try:
            args.cuda_graph_bs = default_cuda_graph_bs(max_bs)
        except ValueError as e:
            raise ValueError(f"--cuda-graph-max-bs: {e}") from None
    return args
