"""``specdial policy simulate``: the adaptive strategies against every fixed steps value and a
clairvoyant oracle, in the Rust policy simulator (:func:`specdial._core.simulate`).

Named regimes (``--regime``, default all) are synthetic workloads: steady code, prose and weak
drafter phases, a load ramp, contexts that grow, bursts. Cost curves (``--curve``, default all
named ones) are rooflines of named accelerators and models, a CPU-like linear curve, or a cost
table measured by the engine (a JSON file, see :class:`specdial._core.CostTable`). The policies
see noisy measured seconds (``--noise``); they are scored by expected tokens of their choices
over noise-free seconds, as a ratio to the oracle, which knows every request's true acceptance
and the noise-free cost and maximises tokens / seconds over the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from specdial._core import AdaptiveConfig, simulate, simulation_catalog


def build_spec(*, regimes: Sequence[str] | None, curves: Sequence[str] | None,
               policies: Sequence[tuple[str, AdaptiveConfig]] | None, segments: int,
               seed: int, noise: float, spikes: float, interference: float = 0.0,
               skip_zero_step_draft_extend: bool = False) -> dict[str, Any]:
    """The spec JSON object of :func:`specdial._core.simulate`. A curve that names an existing
    file is read as a cost table. Raises ``OSError`` for an unreadable table file."""
    curve_specs: list[Any] | None = None
    if curves:
        curve_specs = []
        for c in curves:
            path = Path(c)
            if path.suffix == ".json" or path.exists():
                curve_specs.append({"name": path.stem, "table": path.read_text(encoding="utf-8")})
            else:
                curve_specs.append(c)
    return {
        "regimes": list(regimes) if regimes else None,
        "curves": curve_specs,
        "policies": None if policies is None else [[n, c.to_json()] for n, c in policies],
        "segments": segments, "seed": seed, "noise_sigma": noise, "spike_probability": spikes,
        "interference": interference,
        "skip_zero_step_draft_extend": skip_zero_step_draft_extend,
    }


def run_simulation(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Runs :func:`specdial._core.simulate` on ``spec`` and adds, per case, ``ratios``
    (each contender's goodput over the oracle's) and ``best_fixed`` (name of the best fixed
    steps value). Where a contender decides per request (``goodput-per-request``, issue 28) the
    per-request oracle (true per-request rates, a verify length each) and the confidence oracle
    (this iteration's acceptance probabilities per draft position, the ceiling of a confidence
    stop) join the contenders, so their ratios to the batch-level oracle show the headroom
    there. Raises ``ValueError`` / ``specdial.ConfigError`` for a bad spec."""
    cases: list[dict[str, Any]] = json.loads(simulate(json.dumps(spec)))
    for case in cases:
        for key in ("oracle_per_request", "oracle_confidence"):
            if case.get(key):
                fixed_at = next(i for i, r in enumerate(case["results"])
                                if r["name"].startswith("fixed-"))
                case["results"].insert(fixed_at, case[key])
        oracle = case["oracle"]["goodput"]
        case["ratios"] = {r["name"]: r["goodput"] / oracle for r in case["results"]}
        fixed = [r for r in case["results"] if r["name"].startswith("fixed-")]
        case["best_fixed"] = max(fixed, key=lambda r: r["goodput"])["name"]
    return cases


def format_table(cases: list[dict[str, Any]]) -> str:
    """One row per (regime, curve): every adaptive contender's goodput / oracle, the best fixed
    steps value's, and the steps changes and probes of the first adaptive contender."""
    adaptive = [r["name"] for r in cases[0]["results"] if not r["name"].startswith("fixed-")]
    head = (f"{'regime':16} {'curve':18} " + " ".join(f"{n[:16]:>16}" for n in adaptive)
            + f" {'best fixed':>16} {'changes':>8} {'probes':>7}")
    lines = ["goodput / oracle goodput (tokens per second of each contender over the oracle's)",
             head]
    sums = {n: 0.0 for n in adaptive}
    for c in cases:
        first = next(r for r in c["results"] if r["name"] == adaptive[0]) if adaptive else None
        best = c["best_fixed"]
        lines.append(
            f"{c['regime']:16} {c['curve']:18} "
            + " ".join(f"{c['ratios'][n]:16.3f}" for n in adaptive)
            + f" {c['ratios'][best]:9.3f} ({best[6:]:>4})"
            + (f" {first['steps_changes']:8d} {first['probes']:7d}" if first else ""))
        for n in adaptive:
            sums[n] += c["ratios"][n]
    lines.append(f"{'mean':35} " + " ".join(f"{sums[n] / len(cases):16.3f}" for n in adaptive))
    return "\n".join(lines)


def catalog() -> str:
    """The regimes and curves, for ``--help``."""
    regimes, curves = simulation_catalog()
    return ("regimes: " + "; ".join(f"{n} ({d}{', steady' if s else ''})" for n, d, s in regimes)
            + ". curves: " + ", ".join(curves) + ", or a cost-table JSON file")
