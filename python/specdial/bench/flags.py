"""SGLang's ``bench_serving`` and vLLM's ``vllm bench serve`` flag names on ``specdial bench``.

Same meaning, so they set the specdial option (the option's own name given too: the last one
on the command line wins, as for any repeated argparse option):

=========================== ============================= =========================================
flag (origin)               specdial option               note
=========================== ============================= =========================================
``--max-concurrency``       ``--concurrency``             both: the most requests in flight
``--dataset-name``          ``--dataset``                 both: ``sharegpt``, ``random``,
                                                          ``generated-shared-prefix``, ...
``--warmup-requests``       ``--warmup-prompts``          SGLang: requests sent before measuring
``--disable-ignore-eos``    ``--no-ignore-eos``           SGLang
=========================== ============================= =========================================

The server's engine-option aliases (:data:`specdial.server.flags.ALIASES`: ``--max-num-seqs``,
``--max-model-len``, ...) set the same engine options here, ``--model`` excepted (SGLang's
``bench_serving --model`` names the served model, not a checkpoint). Flags whose meaning differs
are errors naming specdial's equivalent (:data:`DIFFERENT`, :data:`HINTS`), and so are the server's
(:data:`specdial.server.flags.DIFFERENT`: ``--mem-fraction-static`` ...).
Without them an SGLang user's ``specdial bench --max-concurrency 4`` was refused as
``argument {compare,cost-table}: invalid choice: '4'``: argparse set the unknown flag aside and
took its value for the subcommand. :class:`specdial.cli_common.StrictParser` names any
other unknown option.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from specdial.cli_common import StrictParser
from specdial.engine.compat_names import ALIASES as SERVER_ALIASES
from specdial.engine.compat_names import DIFFERENT as SERVER_DIFFERENT

__all__ = ["ALIASES", "DIFFERENT", "HINTS", "add_bench_compat_flags", "check_bench_values"]

#: alias flag -> the destination of the specdial option it sets
ALIASES: dict[str, str] = {
    "--max-concurrency": "concurrency",
    "--dataset-name": "dataset",
    "--warmup-requests": "warmup_prompts",
    **{flag: dest for flag, dest in SERVER_ALIASES.items() if flag != "--model"},
}

#: flag whose meaning differs -> what to use instead (registered as options that refuse)
DIFFERENT: dict[str, str] = {
    "--save-result": "use --output-json FILE",
    "--result-filename": "use --output-json FILE",
    "--host": "name the server with --base-url http://HOST:PORT (and --backend http)",
    "--port": "name the server with --base-url http://HOST:PORT (and --backend http)",
    **SERVER_DIFFERENT,
}


#: flags refused through :attr:`~specdial.cli_common.StrictParser.hints` rather than as
#: options: registered, ``--output-file`` would make ``bench cost-table --out`` an ambiguous
#: abbreviation (argparse matches prefixes against ``bench``'s options before the subcommand's)
HINTS: dict[str, str] = {
    "--output-file": "SGLang's appends one JSON line per run; use --output-json FILE (one "
                     "JSON document: summary, config and timeline)",
}


class _Refused(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string}: {DIFFERENT[str(option_string)]}")


def add_bench_compat_flags(parser: argparse.ArgumentParser) -> None:
    """Register :data:`ALIASES`, ``--disable-ignore-eos``, the refusals of :data:`DIFFERENT` and
    (on a :class:`~specdial.cli_common.StrictParser`) the :data:`HINTS` on a ``bench`` parser built by :func:`~specdial.engine.args.add_dataclass_arguments` (the
    aliases take the type of the option they stand for)."""
    types = {a.dest: a.type for a in parser._actions}
    for flag, dest in ALIASES.items():
        parser.add_argument(flag, dest=dest, type=types.get(dest), default=argparse.SUPPRESS,
                            metavar=dest.upper(), help=f"alias of --{dest.replace('_', '-')}")
    parser.add_argument("--disable-ignore-eos", dest="ignore_eos", action="store_false",
                        default=argparse.SUPPRESS, help="alias of --no-ignore-eos (SGLang)")
    for flag, instead in DIFFERENT.items():
        parser.add_argument(flag, action=_Refused, nargs="?", help=f"refused: {instead}")
    if isinstance(parser, StrictParser):
        parser.hints = {**parser.hints, **HINTS}


def check_bench_values(temperature: float) -> str | None:
    """The message for a ``--temperature`` no request can be sampled at (NaN, infinite or
    negative; :class:`~specdial.worker.sampling.SamplingParams` sets the full rule), else
    None: checked before the engine loads, not once per request of the run."""
    if not (math.isfinite(temperature) and temperature >= 0):
        return f"--temperature must be a finite number >= 0 (0: greedy), got {temperature}"
    return None
