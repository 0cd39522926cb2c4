"""``specdial policy simulate``: the adaptive strategies against every fixed steps value and a
clairvoyant oracle, in the Rust policy simulator (:func:`specdial._core.simulate`).

Named regimes (``--regime``, default all) are synthetic workloads: steady code, prose and weak
drafter phases, a load ramp, contexts that grow, bursts. Cost curves (``--curve``, default all
named ones) are rooflines of named accelerators and models, a CPU-like linear curve, or a cost
table measured by the engine (a JSON file, see :class:`specdial._core.CostTable`). The policies
see noisy measured seconds (``--noise``); they are scored by expected tokens of their choices
over noise-free seconds, as a ratio to the oracle, which knows every request's true acceptance
and the noise-free cost and maximises tokens / seconds over the run.

With tree bounds (``--speculative-eagle-topk`` and ``--speculative-num-draft-tokens``, or a
``--config`` whose goodput config has a ``tree`` key) the report is issue 29's: the mixed
request classes at concurrency 1, 4, 16, 64, 256 (``--concurrency``), adaptive trees against
the best fixed shape (every chain and every tree shape within the bounds, in hindsight) and
against the same config drafting chains only (:func:`run_tree_simulation`; the tree model:
``rust/core/src/sim/tree.rs``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from specdial._core import (AdaptiveConfig, ConfigError, simulate, simulate_trees,
                            simulation_catalog)


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


# ------------------------------------------------------------------ draft trees (issue 29)
#: concurrencies of the tree simulation (the mixed request classes at each)
TREE_CONCURRENCY = (1, 4, 16, 64, 256)


def tree_policy(config: AdaptiveConfig | None, topk: int | None,
                num_draft_tokens: int | None) -> AdaptiveConfig | None:
    """The ``goodput`` config whose trees the simulation runs, or None (chains only).

    ``topk`` / ``num_draft_tokens``: SGLang's ``--speculative-eagle-topk`` /
    ``--speculative-num-draft-tokens`` (root included; the config's ``max_num_draft_tokens``
    excludes it), the upper bounds of the trees the policy chooses, set on ``config`` (default:
    the built-in goodput config); both or neither. Without them, ``config`` when it has a
    ``tree`` key. Raises :class:`specdial.ConfigError` naming the option (one bound without the
    other, another strategy, a config whose own ``tree`` differs, bounds out of range)."""
    from specdial.engine.policy_setup import with_tree_bounds

    if topk is None and num_draft_tokens is None:
        if config is not None and json.loads(config.to_json()).get("tree") is not None:
            return config
        return None
    if topk is None or num_draft_tokens is None:
        raise ConfigError("speculative_eagle_topk and speculative_num_draft_tokens bound the "
                          "simulated trees together: give both (e.g. 8 and 65), got "
                          f"speculative_eagle_topk={topk}, "
                          f"speculative_num_draft_tokens={num_draft_tokens}")
    if topk < 2:
        raise ConfigError(f"speculative_eagle_topk={topk}: a tree needs top-k >= 2 "
                          "(top-k 1 is a chain: the simulation without the option)")
    return with_tree_bounds(config or AdaptiveConfig.default(), topk, num_draft_tokens)


def run_tree_simulation(config: AdaptiveConfig, *, curves: Sequence[str] | None,
                        concurrency: Sequence[int] | None, segments: int,
                        seed: int) -> list[dict[str, Any]]:
    """:func:`specdial._core.simulate_trees` for ``config`` (a goodput config with a ``tree``
    key, :func:`tree_policy`): per (curve, concurrency) the cases with ``trees`` (the config),
    ``chains`` (the same config drafting chains only), ``best_fixed`` (the best fixed plan
    among chains 0..7 and every tree shape within the bounds, in hindsight) and
    ``best_fixed_chain``, each with ``goodput`` (tokens/s over noise-free seconds),
    ``iterations``, ``tree_iterations``, ``most_run`` and ``plans``. Curves as
    :func:`build_spec`'s (names or cost-table files). Raises ``ValueError`` /
    ``specdial.ConfigError`` naming a bad field, ``OSError`` for an unreadable table."""
    spec = build_spec(regimes=None, curves=curves, policies=None, segments=segments, seed=seed,
                      noise=0.1, spikes=0.01)
    tree_spec: dict[str, Any] = {"policy": ["goodput-trees", config.to_json()],
                                 "curves": spec["curves"], "segments": segments, "seed": seed}
    if concurrency:
        tree_spec["concurrency"] = list(concurrency)
    return json.loads(simulate_trees(json.dumps(tree_spec)))


def format_tree_table(cases: list[dict[str, Any]]) -> str:
    """One row per (curve, concurrency): goodput (tokens/s) of adaptive trees, the best fixed
    shape and adaptive chains, their ratios, the best fixed plan's name and the plan the
    adaptive trees ran most; then the mean and worst of trees / best fixed."""
    lines = ["goodput (tokens/s): adaptive trees, best fixed shape (hindsight, chains and trees), "
             "adaptive chains",
             f"{'curve':18} {'conc':>4} {'trees':>10} {'best fixed':>10} {'chains':>10} "
             f"{'trees/fixed':>11} {'trees/chains':>12} {'tree it %':>9}  best fixed shape "
             "/ trees ran most"]
    ratios = []
    for c in cases:
        t, f, ch = c["trees"], c["best_fixed"], c["chains"]
        ratios.append(t["goodput"] / f["goodput"])
        share = 100.0 * t["tree_iterations"] / max(t["iterations"], 1)
        lines.append(f"{c['curve']:18} {c['concurrency']:4d} {t['goodput']:10.1f} "
                     f"{f['goodput']:10.1f} {ch['goodput']:10.1f} {ratios[-1]:11.3f} "
                     f"{t['goodput'] / ch['goodput']:12.3f} {share:9.0f}  {f['name']} / "
                     f"{t['most_run']}")
    if ratios:
        lines.append(f"trees / best fixed: mean {sum(ratios) / len(ratios):.3f}, "
                     f"worst {min(ratios):.3f} over {len(ratios)} cases")
    return "\n".join(lines)
