"""The ``specdial`` command line.

Subcommands: ``specdial policy replay`` (tune an adaptive config offline on a recorded trace),
``specdial policy simulate`` (the strategies against fixed steps and an oracle, :mod:`specdial.policy_sim`),
``specdial generate`` and ``specdial serve`` (:mod:`specdial.cli_serve`), ``specdial bench`` and
``specdial bench compare`` (:mod:`specdial.bench.cli`).
"""

from __future__ import annotations

import argparse
import json
import sys

from specdial.cli_common import StrictParser, cli_error
from specdial.engine.args import ExtendInts, int_list
from specdial._core import AdaptiveConfig, ConfigError, CostTable
from specdial.bench.cli import add_bench_subcommand, run_bench_command
from specdial.cli_serve import SUBCOMMANDS, add_subcommands, run_subcommand
from specdial.replay import TraceError, format_summary, replay


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= x <= 2.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 2], got {text!r}")
    return x


def _positive_int(text: str) -> int:
    try:
        x = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if x < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return x


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="specdial", description="Adaptive speculative-decoding engine.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=StrictParser)
    policy = sub.add_parser("policy", help="inspect and tune the adaptive steps policy")
    psub = policy.add_subparsers(dest="policy_command", required=True)
    rp = psub.add_parser(
        "replay",
        help="replay a per-verify trace (JSONL) through the policy and print step switches and a summary",
        description="Replay a recorded trace through the adaptive policy. Trace lines: "
        '{"batch_size": N, "accepted": [per-request accepted drafts], "steps": K, '
        '"context_tokens": C, "seconds": S} (the last three optional).',
    )
    rp.add_argument("--config", help="adaptive config JSON file (SGLang format); default: the built-in config")
    rp.add_argument("--trace", required=True, help="trace file, one JSON object per verify")
    rp.add_argument("--initial-steps", type=int, default=None, help="starting steps (default: middle of the candidates)")
    rp.add_argument("--cuda-graph-bs", type=int_list, nargs="+", action=ExtendInts, default=None,
                    metavar="N", help="graph batch sizes (space- or comma-separated, as in serve): "
                    "1 2 4 8 or 1,2,4,8")
    rp.add_argument("--cost-table", metavar="FILE",
                    help="seconds per verify from a cost table (the JSON `policy simulate --curve` reads): "
                    "the goodput strategy learns from them and the summary gives tokens/s")
    rp.add_argument("--quiet", action="store_true", help="print only the summary, not each switch")
    rp.add_argument("--json", action="store_true", help="print the summary as JSON")
    from specdial.policy_sim import catalog

    sm = psub.add_parser(
        "simulate",
        help="the adaptive strategies vs every fixed steps value and a clairvoyant oracle, in simulation",
        description="Simulate goodput (tokens/s) of the adaptive strategies, every fixed steps value "
        "and an oracle over named regimes and cost curves, with noisy measured seconds. " + catalog() + ".",
    )
    sm.add_argument("--regime", action="append", metavar="NAME", help="a regime (repeatable; default all)")
    sm.add_argument("--curve", action="append", metavar="NAME|FILE",
                    help="a cost curve or a cost-table JSON file (repeatable; default every named curve)")
    sm.add_argument("--config", action="append", metavar="NAME=FILE",
                    help="an adaptive config to simulate as NAME (repeatable; default: goodput with the "
                    "built-in config, ema with SGLang's default, throughput_aware with SGLang's example)")
    sm.add_argument("--segments", type=_positive_int, default=None,
                    help="work per regime, tokens per request (default 16000; with trees 3000 "
                    "per concurrency)")
    sm.add_argument("--speculative-eagle-topk", type=int, default=None, metavar="K",
                    help="draft trees (issue 29): the most children per node the goodput policy "
                    "may expand (SGLang's flag; with --speculative-num-draft-tokens). The report "
                    "is then adaptive trees vs the best fixed shape vs adaptive chains")
    sm.add_argument("--speculative-num-draft-tokens", type=int, default=None, metavar="N",
                    help="draft trees: the most tokens verified per request, root included "
                    "(SGLang's flag; with --speculative-eagle-topk)")
    sm.add_argument("--concurrency", type=int, action="append", metavar="C",
                    help="with trees: a concurrency of the mixed request classes, one of 1 4 16 "
                    "64 256 (repeatable; default all)")
    sm.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    sm.add_argument("--noise", type=_positive_float, default=0.1,
                    help="lognormal sigma of the measured seconds (default 0.1)")
    sm.add_argument("--spikes", type=float, default=0.01, help="probability of a 1.5-3x stall (default 0.01)")
    sm.add_argument("--interference", type=float, default=0.0,
                    help="share of the run slowed 2-4x in windows of ~50-150 iterations by other work "
                    "on the machine, in [0, 1] (default 0)")
    sm.add_argument("--skip-zero-step-draft-extend", action=argparse.BooleanOptionalAction,
                    default=True,
                    help="steps 0 skip the drafter extend (catch-up cost when drafting resumes), "
                    "as the engine does by default; --no-skip-zero-step-draft-extend charges "
                    "the extend every iteration (default: on)")
    sm.add_argument("--json", action="store_true", help="print every case as JSON")
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
    if args.command == "policy" and args.policy_command == "simulate":
        return _simulate(args)
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
                cost_table=_cost_table(args.cost_table),
                out=None if (args.quiet or args.json) else sys.stdout,
            )
        except (ConfigError, TraceError, OSError, ValueError) as e:
            return cli_error(e)
        print(json.dumps(summary.to_dict(), indent=2) if args.json else format_summary(summary))
        return 0
    return 2


def _cost_table(path: str | None) -> CostTable | None:
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return CostTable.from_json(f.read())


def _simulate(args: argparse.Namespace) -> int:
    from specdial.policy_sim import build_spec, format_table, run_simulation

    try:
        policies = None
        if args.config:
            policies = []
            for item in args.config:
                name, sep, path = item.partition("=")
                if not sep or not name or not path:
                    raise ValueError(f"--config expects NAME=FILE, got {item!r}")
                policies.append((name, AdaptiveConfig.from_file(path)))
        if not 0.0 <= args.spikes <= 1.0:
            raise ValueError(f"--spikes must be in [0, 1], got {args.spikes}")
        trees = _simulate_trees(args, policies)
        if trees is not None:
            print(trees)
            return 0
        if args.concurrency:
            raise ValueError("--concurrency is for the tree simulation: give "
                             "--speculative-eagle-topk and --speculative-num-draft-tokens, or a "
                             "--config with a \"tree\" key")
        spec = build_spec(regimes=args.regime, curves=args.curve, policies=policies,
                          segments=args.segments or 16000, seed=args.seed, noise=args.noise,
                          spikes=args.spikes, interference=args.interference,
                          skip_zero_step_draft_extend=args.skip_zero_step_draft_extend)
        cases = run_simulation(spec)
    except (ConfigError, OSError, ValueError) as e:
        return cli_error(e)
    print(json.dumps(cases, indent=1) if args.json else format_table(cases))
    return 0


def _simulate_trees(args: argparse.Namespace,
                    policies: list[tuple[str, AdaptiveConfig]] | None) -> str | None:
    """The tree report of ``policy simulate`` (None: no tree bounds, the chains report).
    Raises ``ValueError`` / ``ConfigError`` naming the option that does not apply to trees."""
    from specdial.policy_sim import format_tree_table, run_tree_simulation, tree_policy

    with_tree = [(n, c) for n, c in policies or [] if json.loads(c.to_json()).get("tree")]
    flags = args.speculative_eagle_topk is not None or args.speculative_num_draft_tokens is not None
    if not flags and not with_tree:
        return None
    if len(policies or []) > 1:
        raise ValueError("the tree simulation runs one config (its trees, its chains, the fixed "
                         f"shapes): give one --config, got {len(policies or [])}")
    base = policies[0][1] if policies else None
    config = tree_policy(base, args.speculative_eagle_topk, args.speculative_num_draft_tokens)
    assert config is not None  # flags or a tree key, checked above
    for flag, value, default in (("--regime", args.regime, None), ("--noise", args.noise, 0.1),
                                 ("--spikes", args.spikes, 0.01),
                                 ("--interference", args.interference, 0.0)):
        if value != default:
            raise ValueError(f"{flag} does not apply to the tree simulation (the mixed request "
                             "classes at each --concurrency, lognormal noise sigma 0.1 and 1 % "
                             "stalls)")
    cases = run_tree_simulation(config, curves=args.curve, concurrency=args.concurrency,
                                segments=args.segments or 3000, seed=args.seed)
    return json.dumps(cases, indent=1) if args.json else format_tree_table(cases)


if __name__ == "__main__":
    sys.exit(main())
