"""The ``specdial`` command line.

Subcommands: ``specdial policy replay`` (tune an adaptive config offline on a recorded trace),
``specdial generate`` and ``specdial serve`` (:mod:`specdial.cli_serve`), ``specdial bench`` and
``specdial bench compare`` (:mod:`specdial.bench.cli`).
"""

from __future__ import annotations

import argparse
import json
import sys

from specdial._core import AdaptiveConfig, ConfigError
from specdial.bench.cli import add_bench_subcommand, run_bench_command
from specdial.cli_serve import SUBCOMMANDS, add_subcommands, run_subcommand
from specdial.replay import TraceError, format_summary, replay


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="specdial", description="Adaptive speculative-decoding engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    policy = sub.add_parser("policy", help="inspect and tune the adaptive steps policy")
    psub = policy.add_subparsers(dest="policy_command", required=True)
    rp = psub.add_parser(
        "replay",
        help="replay a per-verify trace (JSONL) through the policy and print step switches and a summary",
        description="Replay a recorded trace through the adaptive policy. Trace lines: "
        '{"batch_size": N, "accepted": [per-request accepted drafts], "steps": K (optional)}.',
    )
    rp.add_argument("--config", help="adaptive config JSON file (SGLang format); default: the built-in config")
    rp.add_argument("--trace", required=True, help="trace file, one JSON object per verify")
    rp.add_argument("--initial-steps", type=int, default=None, help="starting steps (default: middle of the candidates)")
    rp.add_argument("--cuda-graph-bs", type=_int_list, default=None, help="graph batch sizes, e.g. 1,2,4,8,16")
    rp.add_argument("--quiet", action="store_true", help="print only the summary, not each switch")
    rp.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_subcommands(sub)
    add_bench_subcommand(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``specdial`` script. Returns the exit status (2 on bad input)."""
    args = build_parser().parse_args(argv)
    if args.command in SUBCOMMANDS:
        return run_subcommand(args)
    if args.command == "bench":
        return run_bench_command(args, argv)
    if args.command == "policy" and args.policy_command == "replay":
        try:
            config = AdaptiveConfig.from_file(args.config) if args.config else AdaptiveConfig.default()
            if args.initial_steps is not None:
                from specdial._core import validate_initial_steps

                validate_initial_steps(config, args.initial_steps)
            summary = replay(
                config,
                args.trace,
                initial_steps=args.initial_steps,
                cuda_graph_bs=args.cuda_graph_bs,
                out=None if (args.quiet or args.json) else sys.stdout,
            )
        except (ConfigError, TraceError, OSError, ValueError) as e:
            print(f"specdial: error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(summary.to_dict(), indent=2) if args.json else format_summary(summary))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
