"""``specdial bench`` and ``specdial bench compare``.

- ``specdial bench [engine options] [--backend engine|http --base-url URL] [--dataset
  code|prose|hard|mixed|PATH --num-prompts N --max-new-tokens N] [--concurrency N |
  --request-rate R]`` runs one benchmark and prints output tokens/s, request throughput, TTFT,
  TPOT, ITL (mean, p50, p99), the mean acceptance length and the steps histogram;
  ``--output-json FILE`` saves everything (``--json`` prints it).
- ``specdial bench compare [engine options] [--configs ...] [--workloads code,hard,mixed]
  [--concurrency 1,4,16,64] [--adaptive-config FILE] [--output-dir DIR]`` runs the
  configurations of :mod:`specdial.bench.compare` side by side and writes ``compare.json``,
  ``compare.md`` and the PNG plots.

The engine options are those of ``specdial serve`` (:class:`specdial.engine.args.EngineArgs`);
in ``compare`` the speculation options (``--speculative-num-steps``,
``--speculative-adaptive``) are set by each configuration and ``--speculative-adaptive-config``
is an alias of ``--adaptive-config``. Exit status: 0, or 2 on bad options, a dataset that
cannot be used or an engine that cannot be built.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdial.cli_common import cli_error, setup_logging
from specdial.bench.datasets import DatasetError, build_requests
from specdial.bench.flags import add_bench_compat_flags, check_bench_values
from specdial.bench.prefix_workloads import (PREFIX_DATASETS, PrefixWorkloadOptions,
                                             prefix_cache_rows, prefix_workload_requests)
from specdial.engine.args import EngineArgs, add_dataclass_arguments, config_from_args
from specdial.engine.cache_flags import add_prefix_cache_flags, resolve_prefix_cache_flags
from specdial.config import EngineConfig
from specdial.engine.sampling_defaults import BENCH_TEMPERATURE
from specdial.engine.resolve import resolve_device_name

__all__ = ["BenchConfig", "CompareConfig", "add_bench_subcommand", "format_result",
           "run_bench", "run_bench_command", "run_compare"]

logger = logging.getLogger("specdial.bench")

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _opt(help: str, default: Any = None, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class _BenchCommon(EngineArgs):
    """Options shared by ``bench`` and ``bench compare`` (besides the engine options)."""

    log_level: str = _opt("log level of specdial", default="warning", choices=_LOG_LEVELS)
    max_running_requests: int | None = _opt(  # type: ignore[assignment]
        "most requests decoded together; default: the (peak) --concurrency, else the "
        f"engine's ({EngineConfig.max_running_requests})", metavar="N")
    prompts_dir: str | None = _opt(
        "directory of code.jsonl, prose.jsonl and hard.jsonl; default: the package's prompt "
        "sets", metavar="DIR")
    max_new_tokens: int = _opt("output tokens per request (fixed with --ignore-eos)",
                               default=128, metavar="N")
    ignore_eos: bool = _opt("keep generating past EOS so every request has max_new_tokens "
                            "tokens", default=True)
    temperature: float = _opt(
        "sampling temperature of every request; 0 = greedy (the default here, as SGLang's "
        "bench_serving and vllm bench serve send; specdial.Engine, specdial generate and the "
        "server routes default to 1.0, or the model's generation_config.json)",
        default=BENCH_TEMPERATURE)
    mix_every: int = _opt("mixed workload: switch between code and hard prompts every N "
                          "requests", default=8, metavar="N")
    arrival_seed: int = _opt(
        "seed of the prompt shuffle, the random dataset and the Poisson arrivals (SGLang's "
        "bench_serving calls it --seed; here --seed is the engine's sampling seed, as in "
        "serve and generate)", default=0, metavar="N")
    sample_interval: float = _opt("seconds between engine statistics samples", default=0.25,
                                  metavar="SECONDS")
    progress: bool = _opt("show a progress bar on stderr", default=True)


@dataclass
class BenchConfig(_BenchCommon, PrefixWorkloadOptions):
    """Options of ``specdial bench`` (the prefix-cache workloads':
    :mod:`specdial.bench.prefix_workloads`)."""

    backend: str = _opt("engine: an in-process Engine built from the engine options; http: a "
                        "running OpenAI-compatible server at --base-url", default="engine",
                        choices=("engine", "http"))
    base_url: str = _opt("server URL for --backend http", default="http://127.0.0.1:30000")
    served_model_name: str | None = _opt(
        "--backend http: the request's model; default: the first of /v1/models", metavar="NAME")
    dataset: str = _opt("code, prose, hard, mixed, mixed-batch (greedy code and "
                        "temperature-1.0 prose interleaved), sharegpt (--dataset-path), random "
                        "(--random-*), multiturn (--multiturn-*), generated-shared-prefix "
                        "(--gsp-*), or a JSONL file (field 'prompt', or 'input_ids')",
                        default="code", metavar="NAME|PATH")
    dataset_path: str | None = _opt("--dataset sharegpt: the ShareGPT JSON file",
                                    metavar="FILE")
    sharegpt_output_len: int | None = _opt(
        "--dataset sharegpt: output tokens per request; default: the reply's length",
        metavar="N")
    random_input_len: int = _opt("--dataset random: mean prompt tokens", default=128,
                                 metavar="N")
    random_output_len: int = _opt("--dataset random: mean output tokens", default=128,
                                  metavar="N")
    random_range_ratio: float = _opt(
        "--dataset random: lengths drawn uniformly in [len * (1 - r), len * (1 + r)]",
        default=0.0, metavar="R")
    random_vocab_size: int | None = _opt(
        "--dataset random: token ids in [0, V); default: the engine's vocabulary (required "
        "with --backend http)", metavar="V")
    num_prompts: int = _opt("requests to send (multiturn: conversations)", default=32,
                            metavar="N")
    concurrency: int | None = _opt(
        "most requests in flight; default: no limit (all at once unless --request-rate). "
        "--backend engine: also the default of --max-running-requests", metavar="N")
    request_rate: float | None = _opt(
        "Poisson arrivals at R requests/s (seeded); default: all at once", metavar="R")
    warmup_prompts: int = _opt("requests sent before measuring", default=1, metavar="N")
    output_json: str | None = _opt("write the result (summary, timeline) to this JSON file",
                                   metavar="FILE")
    json: bool = _opt("print the result as JSON instead of a table", default=False)


@dataclass
class CompareConfig(_BenchCommon):
    """Options of ``specdial bench compare``."""

    configs: str | None = _opt(
        "comma-separated configurations: no-spec, fixed-K, adaptive, adaptive-user; a +noskip "
        "suffix (fixed-0+noskip) runs that one with --no-skip-zero-step-draft-extend (the "
        "drafter's extend every iteration), +skip with --skip-zero-step-draft-extend; default: "
        "no-spec,fixed-1,fixed-3,fixed-5,fixed-7,adaptive (+adaptive-user with "
        "--adaptive-config)", metavar="LIST")
    adaptive_config: str | None = _opt(
        "adaptive config JSON (SGLang format) of the adaptive-user configuration",
        metavar="FILE")
    workloads: str = _opt("comma-separated datasets: code, prose, hard, mixed or JSONL paths",
                          default="code,hard,mixed", metavar="LIST")
    concurrency: str = _opt("comma-separated concurrencies; ramp-N: arrivals rise from one "
                            "at a time to N concurrent and fall back within one run",
                            default="1,4,16,64", metavar="LIST")
    num_prompts: int | None = _opt(
        "requests per workload and concurrency; default: max(2 x concurrency, 16)",
        metavar="N")
    repetitions: int = _opt("round-robin repetitions of every configuration", default=2,
                            metavar="N")
    warmup_prompts: int = _opt("requests per engine and workload before measuring", default=2,
                               metavar="N")
    output_dir: str = _opt("where compare.json, compare.md and the plots go",
                           default="bench-results", metavar="DIR")
    plots: bool = _opt("write PNG plots (matplotlib)", default=True)


def add_bench_subcommand(sub: Any) -> None:
    """Register ``bench`` (and its ``compare`` subcommand) on the ``add_subparsers()`` object
    ``sub``."""
    bench = sub.add_parser(
        "bench", help="benchmark the engine or a server (tokens/s, TTFT, TPOT, ITL, acceptance)",
        description="Benchmark an in-process engine or a running server: output tokens/s, "
        "request throughput, TTFT, TPOT and inter-token latency (mean, p50, p99), mean "
        "acceptance length and steps per decode iteration. `specdial bench compare` compares "
        "no speculation, fixed steps and the adaptive policy side by side.")
    add_dataclass_arguments(bench, BenchConfig)
    add_prefix_cache_flags(bench)
    add_bench_compat_flags(bench)  # SGLang's bench_serving names (specdial.bench.flags)
    bsub = bench.add_subparsers(dest="bench_command", required=False,
                                metavar="{compare,cost-table}",
                                help="compare: no-spec, fixed steps and adaptive configurations "
                                "side by side; cost-table: measure this machine's cost surface")
    compare = bsub.add_parser(
        "compare", help="compare no-spec, fixed steps and adaptive configurations",
        description="Run several engine configurations in one process over the same prompts, "
        "round-robin per repetition, at several concurrencies and workloads; write JSON, a "
        "markdown table with ratios, and PNG plots.")
    add_dataclass_arguments(compare, CompareConfig)
    add_prefix_cache_flags(compare)
    from specdial.bench.cost_table import CostTableConfig

    table = bsub.add_parser(
        "cost-table", help="measure decode-iteration seconds per (steps, batch size, context) "
        "and save the cost table that `policy simulate` and `policy replay` read",
        description="Time decode iterations on the engine's real path for every steps value, "
        "batch size and context length given, and write the cost-table JSON.")
    add_dataclass_arguments(table, CostTableConfig)
    add_prefix_cache_flags(table)


def run_bench_command(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Dispatch ``specdial bench [compare]``; returns the exit status. ``argv`` (default
    ``sys.argv[1:]``) is recorded as the command of a comparison. Contradicting prefix-cache
    switches (:mod:`specdial.engine.cache_flags`) exit with status 2."""
    try:
        resolve_prefix_cache_flags(args)
    except ValueError as e:
        return cli_error(e)
    if getattr(args, "bench_command", None) == "cost-table":
        from specdial.bench.cost_table import CostTableConfig, run_cost_table

        cfg = config_from_args(CostTableConfig, args)
        try:
            table = run_cost_table(cfg)
        except _LOAD_ERRORS as e:
            return cli_error(e)
        print(f"{len(table['entries'])} entries written to {cfg.out}")
        return 0
    if getattr(args, "bench_command", None) == "compare":
        return run_compare(config_from_args(CompareConfig, args),
                           argv=sys.argv[1:] if argv is None else list(argv))
    return run_bench(config_from_args(BenchConfig, args))


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{what}: expected integers >= 1, got {text!r}")
    return values


_LOAD_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError,
                                                 NotImplementedError, OSError, TypeError)


# ---------------------------------------------------------------------------- single run
def format_result(result: dict[str, Any]) -> str:
    """The table ``specdial bench`` prints (latencies in milliseconds)."""
    s, run = result["summary"], result["run"]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1e3 * x:.2f}"

    def num(x: float | None, fmt: str = "{:.2f}") -> str:
        return "-" if x is None else fmt.format(x)

    rows = [
        ("Backend", run["backend"]), ("Dataset", run["dataset"]),
        ("Concurrency", run["concurrency"] or "unlimited"),
        ("Request rate (req/s)", run["request_rate"] or "inf"),
        ("Successful requests", f"{s['completed']} / {s['completed'] + s['failed']}"),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input tokens", s["input_tokens"]), ("Total output tokens", s["output_tokens"]),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
    ]
    for title, key in (("Time to First Token", "ttft_s"), ("Time per Output Token (excl. 1st "
                       "token)", "tpot_s"), ("Inter-token Latency (per chunk)", "itl_s"),
                       ("End-to-end Latency", "e2e_latency_s")):
        rows.append((f"-- {title} (ms) --", ""))
        for stat in ("mean", "p50", "p99"):
            rows.append((f"{stat.capitalize()}", ms(s[key][stat])))
    rows += prefix_cache_rows(s)
    hist = s["steps_histogram"]
    total = sum(hist.values())
    rows += [("-- Speculative decoding --", ""),
             ("Mean acceptance length", num(s["mean_accept_length"])),
             ("Draft acceptance rate", num(s["draft_acceptance_rate"])),
             ("Tokens per decode iteration (steps 0 included)", num(s["tokens_per_verify"])),
             ("Steps (request-iterations)", ", ".join(
                 f"{k}: {v} ({100 * v / total:.0f}%)" for k, v in hist.items()) or "-"),
             ("Steps (time share)", ", ".join(
                 f"{k}: {100 * v:.0f}%" for k, v in s["steps_time_share"].items()) or "-"),
             ("Step switches", num(s["step_switches"], "{}"))]
    if s["engine_iterations_per_steps"]:
        rows.append(("Steps (engine iterations)", ", ".join(
            f"{k}: {v}" for k, v in s["engine_iterations_per_steps"].items())))
    vl = s.get("verify_length_histogram")
    if vl:
        n_vl = sum(vl.values())
        rows.append(("Verify lengths (request-iterations)", ", ".join(
            f"{k}: {v} ({100 * v / n_vl:.0f}%)" for k, v in vl.items())))
    tn = s.get("tree_node_histogram")
    if tn:
        n_tn = sum(tn.values())
        rows.append(("Tree nodes verified (request-iterations)", ", ".join(
            f"{k}: {v} ({100 * v / n_tn:.0f}%)" for k, v in tn.items())))
    width = 42
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=width + 20, c="=")]
    for k, v in rows:
        if str(k).startswith("--"):
            lines.append("{s:{c}^{n}}".format(s=f" {k.strip('- ')} ", n=width + 20, c="-"))
        else:
            lines.append(f"{k:<{width}}{v!s:>20}")
    if not s["streaming"]:
        lines.append("(no streaming: requests ran in generate() batches, so TTFT/TPOT/ITL "
                     "are unavailable)")
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    lines.append("=" * (width + 20))
    return "\n".join(lines)


async def _bench_async(driver: Any, requests: list[Any], warm: list[Any],
                       cfg: BenchConfig, params: dict[str, Any], runner: Any = None) -> Any:
    """Warm up, then the measured run; for the prefix-cache workloads the cache is flushed
    after the warm-up so that its prompts do not make the run's first requests hits."""
    from specdial.bench.driver import run_benchmark

    await driver.start()
    try:
        if warm:
            await run_benchmark(driver, warm, sampling_params=params, concurrency=len(warm),
                                progress=False, sample_interval=cfg.sample_interval)
            if cfg.dataset in PREFIX_DATASETS:
                await driver.flush_cache()
        return await run_benchmark(driver, requests, sampling_params=params,
                                   concurrency=cfg.concurrency, request_rate=cfg.request_rate,
                                   seed=cfg.arrival_seed, sample_interval=cfg.sample_interval,
                                   progress=cfg.progress, desc=f"bench {cfg.dataset}",
                                   runner=runner)
    finally:
        await driver.close()


def missing_extra(module: str, what: str) -> str | None:
    """None when ``module`` imports, else the message naming the ``bench`` extra."""
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        return None
    return (f"{what} needs {module}, which is not installed: pip install 'specdial[bench]' "
            f"(or pip install {module})")


def _output_lengths(requests: list[Any], default: int) -> dict[str, Any]:
    """The run's output lengths for the JSON report: ``max_new_tokens`` the one length every
    request had (a dataset's own lengths, e.g. ``--random-output-len``, rule over
    ``--max-new-tokens``), or None when they differ; ``max_new_tokens_range`` ``[min, max]``."""
    lengths = [r.max_new_tokens or default for r in requests] or [default]
    lo, hi = min(lengths), max(lengths)
    return {"max_new_tokens": lo if lo == hi else None, "max_new_tokens_range": [lo, hi]}


def _requests(cfg: BenchConfig, driver: Any, engine: Any) -> list[Any]:
    """The run's requests (:mod:`specdial.bench.datasets` or, for ``sharegpt`` / ``random``,
    :mod:`specdial.bench.serving_datasets`). Raises :class:`DatasetError`."""
    from specdial.bench.serving_datasets import random_requests, sharegpt_requests

    if cfg.dataset == "random":
        vocab = cfg.random_vocab_size or (engine.vocab_size
                                          if engine is not None else None)
        if vocab is None:
            raise DatasetError("--dataset random with --backend http needs --random-vocab-size")
        reqs = random_requests(cfg.num_prompts, vocab_size=vocab,
                               input_len=cfg.random_input_len,
                               output_len=cfg.random_output_len,
                               range_ratio=cfg.random_range_ratio, seed=cfg.arrival_seed)
        kept = [r for r in (driver.prepare(x, x.max_new_tokens) for x in reqs) if r is not None]
        if len(kept) != len(reqs):
            raise DatasetError(f"--dataset random: {len(reqs) - len(kept)} requests do not fit "
                               "the context; lower --random-input-len/--random-output-len")
        return kept
    if cfg.dataset == "sharegpt":
        if cfg.dataset_path is None:
            raise DatasetError("--dataset sharegpt needs --dataset-path FILE (a ShareGPT JSON)")
        return sharegpt_requests(cfg.dataset_path, cfg.num_prompts, encode=driver.encode,
                                 seed=cfg.arrival_seed, output_len=cfg.sharegpt_output_len,
                                 fits=driver.fits)
    return build_requests(cfg.dataset, cfg.num_prompts, seed=cfg.arrival_seed,
                          mix_every=cfg.mix_every, directory=cfg.prompts_dir,
                          keep=lambda r: driver.prepare(r, cfg.max_new_tokens))


def run_bench(cfg: BenchConfig) -> int:
    """``specdial bench``: returns 0, or 2 (message on stderr) for bad options or a missing
    extra (checked before anything runs)."""
    import asyncio

    setup_logging(cfg.log_level)
    if cfg.backend == "http" and (msg := missing_extra("httpx", "--backend http")):
        return cli_error(msg)
    from specdial.bench.driver import EngineDriver, HttpDriver
    from specdial.bench.metrics import summarize, timeline_series

    try:
        cfg.configure_process()
    except (ValueError, OSError) as e:  # bad options, an unreadable config file
        return cli_error(str(e))
    if cfg.concurrency is not None and cfg.concurrency < 1:
        return cli_error(f"--concurrency must be >= 1, got {cfg.concurrency}")
    if cfg.request_rate is not None and not (cfg.request_rate > 0):
        return cli_error(f"--request-rate must be > 0, got {cfg.request_rate}")
    if (msg := check_bench_values(cfg.temperature)) is not None:
        return cli_error(msg)
    engine = None
    if cfg.backend == "http":
        driver: Any = HttpDriver(cfg.base_url, model=cfg.served_model_name,
                                 ignore_eos=cfg.ignore_eos)
    else:
        if cfg.max_running_requests is None and cfg.concurrency is not None:
            cfg = dataclasses.replace(cfg, max_running_requests=cfg.concurrency)
        try:
            engine = cfg.build_engine()
        except _LOAD_ERRORS as e:
            return cli_error(f"cannot start the engine: {e}")
        driver = EngineDriver(engine)
    params = {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
              "ignore_eos": cfg.ignore_eos}
    try:
        runner = None
        try:
            if cfg.dataset in PREFIX_DATASETS:
                requests, runner = prefix_workload_requests(cfg, driver, engine)
            else:
                requests = _requests(cfg, driver, engine)
        except DatasetError as e:
            return cli_error(e)
        warm = requests[:max(cfg.warmup_prompts, 0)]
        run = asyncio.run(_bench_async(driver, requests, warm, cfg, params, runner))
    finally:
        if engine is not None:
            engine.shutdown()
    summary = summarize([run])
    conf = {k: v for k, v in dataclasses.asdict(cfg).items()
            if k not in ("json", "output_json", "progress")}
    result = {
        "run": {"backend": cfg.backend, "dataset": cfg.dataset, "num_prompts": len(requests),
                "concurrency": cfg.concurrency,
                "request_rate": None if cfg.request_rate is None or math.isinf(cfg.request_rate)
                else cfg.request_rate,
                **_output_lengths(requests, cfg.max_new_tokens),
                "speculative_algorithm": getattr(engine, "speculative_algorithm", None),
                "warnings": list(getattr(driver, "warnings", []))},
        "summary": summary, "config": conf,
        "timeline": timeline_series(run.timeline) if run.timeline else None}
    if cfg.output_json:
        Path(cfg.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.output_json).write_text(json.dumps(result, indent=1, default=str),
                                         encoding="utf-8")
    print(json.dumps(result, default=str) if cfg.json else format_result(result))
    return 0


# ---------------------------------------------------------------------------- compare
def run_compare(cfg: CompareConfig, argv: list[str] | None = None) -> int:
    """``specdial bench compare``: returns 0, or 2 (message on stderr)."""
    from specdial.bench.compare import (EngineFactory, parse_concurrency, parse_configurations,
                                        peak_of, run_comparison)
    from specdial.bench.compare import write_outputs

    setup_logging(cfg.log_level)
    if cfg.plots and (msg := missing_extra("matplotlib", "--plots (the PNG plots)")):
        return cli_error(f"{msg}; or pass --no-plots")
    try:
        cfg.configure_process()
    except (ValueError, OSError) as e:  # bad options, an unreadable config file
        return cli_error(str(e))
    user_config = cfg.adaptive_config or cfg.speculative_adaptive_config
    if (cfg.adaptive_config and cfg.speculative_adaptive_config
            and cfg.adaptive_config != cfg.speculative_adaptive_config):
        return cli_error("--adaptive-config and --speculative-adaptive-config differ; give one")
    try:
        configs = parse_configurations(cfg.configs, user_config)
        concurrencies = [parse_concurrency(c) for c in cfg.concurrency.split(",") if c.strip()]
        if not concurrencies:
            raise ValueError("--concurrency is empty")
        if cfg.repetitions < 1:
            raise ValueError(f"--repetitions must be >= 1, got {cfg.repetitions}")
        if cfg.num_prompts is not None and cfg.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {cfg.num_prompts}")
    except ValueError as e:
        return cli_error(e)
    workloads = [w.strip() for w in cfg.workloads.split(",") if w.strip()]
    if not workloads:
        return cli_error("--workloads is empty")
    if cfg.record_trace:
        logger.warning("--record-trace is ignored by `bench compare`")
    factory = EngineFactory(cfg, default_max_running=max(peak_of(c) for c in concurrencies))
    meta = {"command": "specdial " + shlex.join(argv) if argv else None,
            "model_path": cfg.model_path or "built-in", "draft_model_path":
            cfg.draft_model_path, "speculative_algorithm": cfg.speculative_algorithm,
            "device": resolve_device_name(cfg.device), "dtype": cfg.dtype,
            "skip_zero_step_draft_extend": cfg.skip_zero_step_draft_extend}
    try:
        result = run_comparison(
            factory.build, configs, workloads, concurrencies, num_prompts=cfg.num_prompts,
            max_new_tokens=cfg.max_new_tokens, mix_every=cfg.mix_every, seed=cfg.arrival_seed,
            repetitions=cfg.repetitions, prompts_dir=cfg.prompts_dir,
            warmup_prompts=cfg.warmup_prompts, sample_interval=cfg.sample_interval,
            temperature=cfg.temperature, ignore_eos=cfg.ignore_eos, progress=cfg.progress,
            meta=meta)
    except DatasetError as e:
        return cli_error(e)
    except _LOAD_ERRORS as e:
        return cli_error(f"cannot run the comparison: {e}")
    files = write_outputs(result, cfg.output_dir, plots=cfg.plots)
    from specdial.bench.compare import format_markdown

    print(format_markdown(result))
    print("wrote " + ", ".join(files.values()), file=sys.stderr)
    return 0
