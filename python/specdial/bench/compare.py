"""``specdial bench compare``: several engine configurations side by side, in one process.

Configurations (``--configs``, comma-separated):

- ``no-spec``: no speculation (target only, plain decoding);
- ``fixed-K``: a fixed ``speculative_num_steps = K`` (``--no-speculative-adaptive``);
- ``adaptive``: the adaptive policy with the built-in config;
- ``adaptive-user``: the adaptive policy with ``--adaptive-config FILE`` (added to the default
  list when that option is given);
- any of them with the suffix ``+noskip`` (e.g. ``fixed-0+noskip``): the same with
  ``skip_zero_step_draft_extend=False`` (SGLang's drafter extend every iteration, the warm
  draft KV), so that ``no-spec,fixed-0,fixed-0+noskip`` measures steps 0 with the skip (the
  default) and with the drafter kept warm against plain decoding; ``+skip`` forces the skip
  on (it differs from no suffix only under ``--no-skip-zero-step-draft-extend``). Without a
  suffix a configuration uses ``--skip-zero-step-draft-extend`` as given.

Default: ``no-spec,fixed-1,fixed-3,fixed-5,fixed-7,adaptive`` (+ ``adaptive-user``).

Every configuration is one engine, built once and reused; the models are loaded once and
shared (``Engine.from_modules`` with the same target, drafter and tokenizer) when the Engine
offers it. For each workload (``code``, ``hard``, ``mixed`` ...) and each concurrency, every
repetition runs all configurations on the same request sequence, round-robin with the starting
configuration rotated per repetition, so that slow drifts of this shared machine spread over
all of them. Figures of the repetitions are pooled (tokens / total seconds) and each
repetition's own ratio is kept to show the noise.

Ratios (output tokens/s, same workload and concurrency): adaptive / best fixed configuration
(the best of ``no-spec`` and every ``fixed-K``: the oracle of a fixed choice), adaptive / each
fixed configuration, adaptive / no speculation.

Outputs in ``--output-dir``: ``compare.json`` (everything), ``compare.md`` (tables) and PNG
plots (:mod:`specdial.bench.plots`).

Notes: an engine keeps its adaptive state (EMA, current steps) from one run to the next, as a
server would; idle engines are assumed not to use the CPU while another one runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from specdial.bench.datasets import BenchRequest, build_requests
from specdial.bench.driver import EngineDriver, ramp_concurrency, run_benchmark
from specdial.bench.metrics import RunData, summarize, timeline_series
from specdial.engine.config import AUTO

__all__ = ["Configuration", "EngineFactory", "compute_ratios", "default_config_names",
           "format_markdown", "parse_configurations", "run_comparison", "write_outputs"]

logger = logging.getLogger("specdial.bench")

NO_SPEC = "no-spec"
ADAPTIVE = "adaptive"
ADAPTIVE_USER = "adaptive-user"
SKIP_SUFFIX = "+skip"
NOSKIP_SUFFIX = "+noskip"
DEFAULT_FIXED_STEPS = (1, 3, 5, 7)


@dataclass(frozen=True)
class Configuration:
    """One engine configuration of a comparison (see the module docstring)."""

    name: str
    kind: str  # "none", "fixed" or "adaptive"
    steps: int | None = None
    adaptive_config: str | None = None
    skip_zero_step_draft_extend: bool | None = None  # None: the engine option as given

    def engine_overrides(self) -> dict[str, Any]:
        """The speculation options of :class:`specdial.Engine` for this configuration
        (``speculative_algorithm=None`` for ``no-spec`` is handled by the factory)."""
        out: dict[str, Any] = {}
        if self.kind == "fixed":
            out = {"speculative_adaptive": False, "speculative_num_steps": self.steps}
        elif self.kind == "adaptive":
            out = {"speculative_adaptive": True, "speculative_num_steps": None,
                   "speculative_adaptive_config": self.adaptive_config}
        if self.skip_zero_step_draft_extend is not None:
            out["skip_zero_step_draft_extend"] = self.skip_zero_step_draft_extend
        return out


def default_config_names(adaptive_config: str | None = None) -> list[str]:
    """``no-spec``, ``fixed-1/3/5/7``, ``adaptive`` and, with a user config, ``adaptive-user``."""
    names = [NO_SPEC, *(f"fixed-{k}" for k in DEFAULT_FIXED_STEPS), ADAPTIVE]
    return names + ([ADAPTIVE_USER] if adaptive_config else [])


def parse_configurations(spec: str | None, adaptive_config: str | None = None
                         ) -> list[Configuration]:
    """The configurations named in ``spec`` (comma-separated; None = the default list).
    Raises ``ValueError`` for an unknown or repeated name, or ``adaptive-user`` without
    ``adaptive_config``."""
    names = default_config_names(adaptive_config) if not spec else [
        s.strip() for s in spec.split(",") if s.strip()]
    out: list[Configuration] = []
    for name in names:
        base, skip = name, None
        for suffix, value in ((SKIP_SUFFIX, True), (NOSKIP_SUFFIX, False)):
            if name.endswith(suffix):
                base, skip = name[:-len(suffix)], value
        m = re.fullmatch(r"fixed-(\d+)", base)
        if base == NO_SPEC and skip is None:
            out.append(Configuration(name, "none", 0))
        elif m:
            out.append(Configuration(name, "fixed", int(m.group(1)),
                                     skip_zero_step_draft_extend=skip))
        elif base == ADAPTIVE:
            out.append(Configuration(name, "adaptive", skip_zero_step_draft_extend=skip))
        elif base == ADAPTIVE_USER:
            if not adaptive_config:
                raise ValueError("configuration 'adaptive-user' needs --adaptive-config FILE")
            out.append(Configuration(name, "adaptive", adaptive_config=str(adaptive_config),
                                     skip_zero_step_draft_extend=skip))
        else:
            raise ValueError(f"unknown configuration {name!r}; use no-spec, fixed-K, adaptive "
                             f"or adaptive-user, the last three optionally with {SKIP_SUFFIX} or "
                             f"{NOSKIP_SUFFIX}")
    if len({c.name for c in out}) != len(out):
        raise ValueError(f"a configuration is repeated in {spec!r}")
    if not out:
        raise ValueError("no configuration to compare")
    return out


class EngineFactory:
    """Builds the engine of each configuration from the engine options ``args``
    (:class:`specdial.engine.args.EngineArgs`; the speculation options are replaced per
    configuration). The models are loaded once, on the first :meth:`build`, and shared through
    ``Engine.from_modules``; if that is not possible (no ``from_modules``, or the modules cannot
    be loaded here), each configuration builds its own ``Engine(...)`` (loading the models once
    per configuration, not per run). ``max_running_requests`` defaults to
    ``default_max_running`` (the largest concurrency)."""

    def __init__(self, args: Any, default_max_running: int | None = None) -> None:
        self.args = args
        self.default_max_running = default_max_running
        self._modules: tuple[Any, Any, Any] | None = None
        self._shared: bool | None = None

    def _algorithm(self) -> str | None:
        """The engine's ``speculative_algorithm`` (None, ``"auto"`` or a name)."""
        return self.args.engine_config().speculative_algorithm

    def _load_modules(self) -> tuple[Any, Any, Any]:
        from specdial.models import load_engine_modules, resolve_draft_algorithm
        from specdial.engine.loading import resolve_placement
        from specdial.engine.resolve import resolve_model_dir

        a = self.args
        algo = self._algorithm()
        draft_dir = (resolve_model_dir(a.draft_model_path, a.flag("draft_model_path"))
                     if a.draft_model_path else None)
        if a.model_path is None:
            from specdial.builtin import builtin_model_path

            model_dir = builtin_model_path("target")
            algo = algo if algo != AUTO else "EAGLE"
            if draft_dir is None and algo in ("EAGLE", "DRAFT"):
                draft_dir = builtin_model_path("eagle" if algo == "EAGLE" else "draft")
        else:
            model_dir = resolve_model_dir(a.model_path, a.flag("model_path"))
            if algo == AUTO:
                algo = None if draft_dir is None else resolve_draft_algorithm(draft_dir)
        device, dtype = resolve_placement(a.device, a.dtype, model_dir)
        return load_engine_modules(model_dir, draft_dir, algo, dtype=dtype, device=device)

    def _kwargs(self, conf: Configuration) -> dict[str, Any]:
        kw: dict[str, Any] = self.args.engine_kwargs()
        for k in ("speculative_num_steps", "speculative_adaptive", "speculative_adaptive_config",
                  "record_trace"):
            kw.pop(k, None)
        kw.update(conf.engine_overrides())
        if kw.get("speculative_adaptive_config") is None:
            kw.pop("speculative_adaptive_config", None)
        if self.args.max_running_requests is None and self.default_max_running:
            kw["max_running_requests"] = self.default_max_running
        return kw

    def build(self, conf: Configuration) -> Any:
        """The engine of ``conf``. Raises what the Engine raises for bad options, and
        ``ValueError`` when a speculative configuration has no drafter."""
        from specdial.engine import Engine

        kw = self._kwargs(conf)
        if self._shared is None:
            self._shared = hasattr(Engine, "from_modules")
            if self._shared:
                try:
                    self._modules = self._load_modules()
                except Exception as e:  # noqa: BLE001 - fall back to Engine(...) per config
                    logger.warning("cannot load the models once for all configurations (%s); "
                                   "each configuration loads its own", e)
                    self._shared = False
        if self._shared and self._modules is not None:
            target, drafter, tokenizer = self._modules
            if conf.kind != "none" and drafter is None:
                raise ValueError(f"configuration {conf.name!r} needs a drafter: pass "
                                 "--draft-model-path (or use the built-in models)")
            for k in ("model_path", "draft_model_path", "speculative_algorithm", "device",
                      "dtype"):
                kw.pop(k, None)
            return Engine.from_modules(target, None if conf.kind == "none" else drafter,
                                       tokenizer, **kw)
        if conf.kind == "none":
            kw["speculative_algorithm"] = None
            kw.pop("draft_model_path", None)
        return Engine(**kw)


# ---------------------------------------------------------------------------- running
Concurrency = int | str
"""A concurrency: a number of requests in flight, or ``"ramp-N"``: a load ramp whose arrivals
rise from one at a time to N concurrent and fall back within the run
(:func:`~specdial.bench.driver.ramp_concurrency`)."""


def parse_concurrency(text: str) -> Concurrency:
    """``"16"`` -> 16, ``"ramp-64"`` -> ``"ramp-64"``. Raises ``ValueError`` naming the
    allowed forms."""
    t = text.strip()
    peak = t[5:] if t.startswith("ramp-") else t
    if not peak.isdigit() or int(peak) < 1:
        raise ValueError(f"--concurrency: expected integers >= 1 or ramp-N (N >= 1), got {text!r}")
    return t if t.startswith("ramp-") else int(t)


def peak_of(conc: Concurrency) -> int:
    """The largest number of requests in flight at ``conc``."""
    return int(conc[5:]) if isinstance(conc, str) else conc


def _auto_num_prompts(concurrency: Concurrency) -> int:
    if isinstance(concurrency, str):  # a ramp: four requests per step of its peak
        return max(4 * peak_of(concurrency), 16)
    return max(2 * concurrency, 16)


def _share_grid(run: RunData, points: int = 200) -> list[float]:
    return [run.duration_s * i / (points - 1) for i in range(points)]


def _hard_share(run: RunData, times: Sequence[float], primary: str) -> list[float | None]:
    """At each of ``times`` (seconds): the share of in-flight requests whose workload is not
    ``primary`` (None when none is in flight)."""
    out: list[float | None] = []
    for t in times:
        live = [r for r in run.records if r.send_time <= t and (r.end_time is None
                                                                  or r.end_time > t)]
        out.append(sum(r.workload != primary for r in live) / len(live) if live else None)
    return out


async def _compare_async(engines: Mapping[str, Any], configs: Sequence[Configuration],
                         workloads: Sequence[str], concurrencies: Sequence[Concurrency], *,
                         num_prompts: int | None, max_new_tokens: int, mix_every: int,
                         seed: int, repetitions: int, prompts_dir: str | None,
                         warmup_prompts: int, sample_interval: float, temperature: float,
                         ignore_eos: bool, progress: bool) -> list[dict[str, Any]]:
    drivers = {c.name: EngineDriver(engines[c.name], c.name) for c in configs}
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature,
              "ignore_eos": ignore_eos}
    first = drivers[configs[0].name]
    results: list[dict[str, Any]] = []
    total_runs = len(workloads) * len(concurrencies) * repetitions * len(configs)
    done_runs = 0
    from tqdm.auto import tqdm

    # every run, with the time left estimated from the runs so far (each run also has its own
    # bar of requests below it)
    overall = tqdm(total=total_runs, desc="bench compare", unit="run", disable=not progress,
                   file=sys.stderr)

    def report(line: str) -> None:
        if progress:
            from tqdm.auto import tqdm

            tqdm.write(line, file=sys.stderr)
        else:
            logger.info(line)

    for workload in workloads:
        need = max(num_prompts or _auto_num_prompts(c) for c in concurrencies)
        requests = build_requests(workload, need, seed=seed, mix_every=mix_every,
                                  directory=prompts_dir,
                                  keep=lambda r: first.prepare(r, max_new_tokens))
        if warmup_prompts > 0:
            warm = requests[:warmup_prompts]
            for c in configs:
                await run_benchmark(drivers[c.name], warm, sampling_params=params,
                                    concurrency=len(warm), progress=False,
                                    sample_interval=sample_interval)
        for conc in concurrencies:
            n = num_prompts or _auto_num_prompts(conc)
            reqs: list[BenchRequest] = requests[:n]
            runs: dict[str, list[RunData]] = {c.name: [] for c in configs}
            for rep in range(repetitions):
                order = [configs[(rep + i) % len(configs)] for i in range(len(configs))]
                for c in order:
                    done_runs += 1
                    tag = f"[{done_runs}/{total_runs}] {workload} c={conc} {c.name} #{rep + 1}"
                    ramp = (ramp_concurrency(len(reqs), peak_of(conc))
                            if isinstance(conc, str) else None)
                    run = await run_benchmark(
                        drivers[c.name], reqs, sampling_params=params,
                        concurrency=peak_of(conc), concurrency_schedule=ramp, seed=seed,
                        sample_interval=sample_interval, progress=progress, leave=False,
                        desc=tag)
                    runs[c.name].append(run)
                    overall.update(1)
                    s = summarize([run])
                    acc = s["mean_accept_length"]  # one definition; None without drafts
                    report(f"{tag}: {s['output_throughput']:.1f} tokens/s, "
                           f"{s['completed']}/{len(reqs)} ok, accept length "
                           f"{'-' if acc is None else f'{acc:.2f}'}")
            for c in configs:
                entry: dict[str, Any] = {
                    "workload": workload, "concurrency": conc, "config": c.name,
                    "kind": c.kind, "steps": c.steps, "num_prompts": len(reqs),
                    "summary": summarize(runs[c.name]),
                    "repetitions": [summarize([r]) for r in runs[c.name]]}
                if c.kind == "adaptive" and runs[c.name] and runs[c.name][0].timeline:
                    run0 = runs[c.name][0]
                    series = timeline_series(run0.timeline)
                    primary = reqs[0].workload if reqs else workload
                    grid = _share_grid(run0)
                    series["share_t"] = grid
                    series["other_workload_share"] = _hard_share(run0, grid, primary)
                    entry["timeline"] = series
                results.append(entry)
    overall.close()
    return results


def run_comparison(build_engine: Callable[[Configuration], Any],
                   configs: Sequence[Configuration], workloads: Sequence[str],
                   concurrencies: Sequence[Concurrency], *, num_prompts: int | None = None,
                   max_new_tokens: int = 128, mix_every: int = 8, seed: int = 0,
                   repetitions: int = 2, prompts_dir: str | None = None,
                   warmup_prompts: int = 2, sample_interval: float = 0.25,
                   temperature: float = 0.0, ignore_eos: bool = True, progress: bool = True,
                   meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Build one engine per configuration with ``build_engine`` and run the comparison (module
    docstring). ``num_prompts`` per (workload, concurrency): None = ``max(2 * concurrency,
    16)``; ``max_new_tokens`` tokens per request; ``mix_every``: phase length of ``mixed`` in
    requests; ``warmup_prompts`` requests per engine and workload before measuring;
    ``sample_interval`` seconds between stats samples. Returns the JSON-ready result:
    ``meta``, ``configs``, ``results`` (one entry per workload x concurrency x configuration,
    with ``summary``, per-repetition summaries and, for adaptive configurations whose engine
    has ``stats()``, the ``timeline`` of the first repetition:
    :func:`~specdial.bench.metrics.timeline_series` plus ``other_workload_share`` sampled at
    ``share_t`` (seconds), the share of in-flight requests not from the first request's prompt
    set, e.g. ``hard`` in ``mixed``) and ``ratios``
    (:func:`compute_ratios`). The engines are shut down at the end."""
    if repetitions < 1:
        raise ValueError(f"repetitions must be >= 1, got {repetitions}")
    engines: dict[str, Any] = {}
    started = time.time()
    try:
        for c in configs:
            logger.info("building the engine of %s", c.name)
            engines[c.name] = build_engine(c)
        results = asyncio.run(_compare_async(
            engines, configs, workloads, concurrencies, num_prompts=num_prompts,
            max_new_tokens=max_new_tokens, mix_every=mix_every, seed=seed,
            repetitions=repetitions, prompts_dir=prompts_dir, warmup_prompts=warmup_prompts,
            sample_interval=sample_interval, temperature=temperature, ignore_eos=ignore_eos,
            progress=progress))
    finally:
        for engine in engines.values():
            shutdown = getattr(engine, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except Exception:  # noqa: BLE001 - best effort at exit
                    logger.debug("engine shutdown failed", exc_info=True)
    info = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "wall_s": time.time() - started, "python": sys.version.split()[0],
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "workloads": list(workloads), "concurrencies": list(concurrencies),
        "num_prompts": num_prompts, "max_new_tokens": max_new_tokens, "mix_every": mix_every,
        "seed": seed, "repetitions": repetitions, "temperature": temperature,
        "ignore_eos": ignore_eos}
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None:
        info["torch"] = getattr(torch_mod, "__version__", None)
        info["torch_threads"] = torch_mod.get_num_threads()
    info.update(meta or {})
    out = {"meta": info,
           "configs": [{"name": c.name, "kind": c.kind, "steps": c.steps,
                        "adaptive_config": c.adaptive_config,
                        "skip_zero_step_draft_extend": c.skip_zero_step_draft_extend}
                       for c in configs],
           "results": results}
    out["ratios"] = compute_ratios(out)
    return out


# ---------------------------------------------------------------------------- ratios
def _safe_ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compute_ratios(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """For each workload, concurrency and adaptive configuration: ``best_fixed`` (the fixed
    configuration, ``no-spec`` included, with the highest output tokens/s), ``vs_best_fixed``,
    ``vs_no_spec``, ``vs_fixed`` (``{name: ratio}``) and ``vs_best_fixed_per_rep`` (the same
    ratio within each repetition), all ratios of output tokens/s."""
    table: dict[tuple[str, int], dict[str, Mapping[str, Any]]] = {}
    for e in result["results"]:
        table.setdefault((e["workload"], e["concurrency"]), {})[e["config"]] = e
    out: list[dict[str, Any]] = []
    for (workload, conc), entries in table.items():
        tps = {name: e["summary"]["output_throughput"] for name, e in entries.items()}
        fixed = {n: v for n, v in tps.items() if entries[n]["kind"] in ("none", "fixed")}
        best = max(fixed, key=lambda n: fixed[n]) if fixed else None
        for name, e in entries.items():
            if e["kind"] != "adaptive":
                continue
            per_rep = []
            if best is not None:
                for ra, rb in zip(e["repetitions"], entries[best]["repetitions"]):
                    per_rep.append(_safe_ratio(ra["output_throughput"], rb["output_throughput"]))
            out.append({
                "workload": workload, "concurrency": conc, "adaptive": name,
                "output_throughput": tps[name], "best_fixed": best,
                "best_fixed_throughput": fixed.get(best) if best else None,
                "vs_best_fixed": _safe_ratio(tps[name], fixed.get(best) if best else None),
                "vs_no_spec": _safe_ratio(tps[name], tps.get(NO_SPEC)),
                "vs_fixed": {n: _safe_ratio(tps[name], v) for n, v in fixed.items()},
                "vs_best_fixed_per_rep": per_rep})
    return out


# ---------------------------------------------------------------------------- outputs
def _f(x: float | None, fmt: str = "{:.1f}", scale: float = 1.0) -> str:
    return "-" if x is None else fmt.format(x * scale)


def _hist(h: Mapping[Any, Any]) -> str:
    total = sum(h.values())
    if not total:
        return "-"
    return " ".join(f"{k}:{100 * v / total:.0f}%" for k, v in sorted(h.items(),
                                                                      key=lambda kv: int(kv[0])))


def format_markdown(result: Mapping[str, Any]) -> str:
    """The markdown report: throughput per workload (configurations x concurrencies), the
    ratios, and per-run latency and speculation figures (milliseconds in the tables)."""
    meta = result["meta"]
    configs = [c["name"] for c in result["configs"]]
    concs = meta["concurrencies"]
    by = {(e["workload"], e["concurrency"], e["config"]): e for e in result["results"]}
    lines = ["# specdial bench compare", ""]
    cmd = meta.get("command")
    if cmd:
        lines += ["```", cmd, "```", ""]
    lines += [f"{meta['started']}, {meta['platform']}, {meta['cpu_count']} CPUs, Python "
              f"{meta['python']}, torch {meta.get('torch', '-')} "
              f"({meta.get('torch_threads', '?')} threads); max_new_tokens "
              f"{meta['max_new_tokens']}, {meta['repetitions']} repetition(s) round-robin, "
              f"temperature {meta['temperature']}, mix every {meta['mix_every']} requests; "
              f"wall {meta['wall_s']:.0f} s.", ""]
    lines += ["## Output throughput (tokens/s)", "",
              "In brackets: the ratio to no-spec at the same workload and concurrency.", ""]
    for w in meta["workloads"]:
        lines += [f"### {w}", "", "| configuration | " + " | ".join(f"c={c}" for c in concs)
                  + " |", "|---|" + "---:|" * len(concs)]
        for name in configs:
            cells = []
            for c in concs:
                if (w, c, name) not in by:
                    cells.append("-")
                    continue
                tps = by[(w, c, name)]["summary"]["output_throughput"]
                base = by.get((w, c, NO_SPEC))
                ratio = _safe_ratio(tps, base["summary"]["output_throughput"]) if base else None
                cells.append(_f(tps) + ("" if ratio is None or name == NO_SPEC
                                        else f" ({ratio:.2f}x)"))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    ratios = result.get("ratios") or []
    if ratios:
        fixed_names = [n for n in configs if n.startswith("fixed-")]
        lines += ["## Ratios of output tokens/s", "",
                  "adaptive / best fixed (the best of no-spec and fixed-K at that workload and "
                  "concurrency; per-repetition ratios in brackets), adaptive / no-spec, adaptive "
                  "/ each fixed configuration.", "",
                  "| workload | c | adaptive | best fixed | adaptive / best fixed | adaptive / "
                  "no-spec | " + " | ".join(f"/ {n}" for n in fixed_names) + " |",
                  "|---|---:|---|---|---:|---:|" + "---:|" * len(fixed_names)]
        for r in ratios:
            reps = ", ".join(_f(x, "{:.2f}") for x in r["vs_best_fixed_per_rep"])
            cells = [_f(r["vs_fixed"].get(n), "{:.2f}") for n in fixed_names]
            lines.append(f"| {r['workload']} | {r['concurrency']} | {r['adaptive']} | "
                         f"{r['best_fixed'] or '-'} | {_f(r['vs_best_fixed'], '{:.2f}')} "
                         f"[{reps}] | {_f(r['vs_no_spec'], '{:.2f}')} | "
                         + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Latency and speculation per run", "",
              "TTFT, TPOT and ITL in milliseconds (p50 / p99); accept length: tokens per verify "
              "with drafts (engine counters); steps: share of request-iterations per steps "
              "value.", "",
              "| workload | c | configuration | tokens/s | req/s | TTFT p50 / p99 | TPOT p50 / "
              "p99 | ITL p50 / p99 | accept length | steps | failed |",
              "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for e in result["results"]:
        s = e["summary"]
        lat = [f"{_f(s[k]['p50'], scale=1e3)} / {_f(s[k]['p99'], scale=1e3)}"
               for k in ("ttft_s", "tpot_s", "itl_s")]
        acc = s["mean_accept_length"]  # the acceptance length; "-" without drafts
        lines.append(f"| {e['workload']} | {e['concurrency']} | {e['config']} | "
                     f"{_f(s['output_throughput'])} | {_f(s['request_throughput'], '{:.2f}')} | "
                     + " | ".join(lat) + f" | {_f(acc, '{:.2f}')} | "
                     f"{_hist(s['steps_histogram'])} | {s['failed']} |")
    lines.append("")
    if not any(e["summary"]["streaming"] for e in result["results"]):
        lines += ["The engine has no `async_stream`: requests ran in `generate` batches, so "
                  "TTFT, TPOT and ITL (which need streaming) are not available.", ""]
    return "\n".join(lines)


def write_outputs(result: dict[str, Any], output_dir: str | Path, *, plots: bool = True
                  ) -> dict[str, str]:
    """Write ``compare.json`` and ``compare.md`` into ``output_dir`` (created), then
    (``plots``) the PNG plots, and the two files again listing them: the results are on disk
    before any plotting starts, so a plotting failure loses nothing. Returns ``{kind: path}``;
    the JSON records the file list too."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "compare.md", out / "compare.json"
    files: dict[str, str] = {}

    def write() -> None:
        result["files"] = {**files, "markdown": str(md), "json": str(js)}
        md.write_text(format_markdown(result) + _plot_links(files), encoding="utf-8")
        js.write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")

    write()
    if plots:
        from specdial.bench.plots import plot_comparison

        files.update(plot_comparison(result, out))
        write()
    return {**files, "markdown": str(md), "json": str(js)}


def _plot_links(files: Mapping[str, str]) -> str:
    pngs = [(k, Path(v).name) for k, v in files.items() if v.endswith(".png")]
    if not pngs:
        return ""
    return "\n## Plots\n\n" + "\n".join(f"![{k}]({name})" for k, name in pngs) + "\n"
