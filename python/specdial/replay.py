"""``specdial policy replay``: run a recorded per-verify trace through the adaptive policy offline.

A trace is JSON Lines, one object per verify (what ``--record-trace`` writes)::

    {"batch_size": 4, "accepted": [3, 0, 7, 2], "steps": 7, "context_tokens": 5120, "seconds": 0.031}

``batch_size`` (int >= 1) and ``accepted`` (accepted drafts per request, bonus token excluded, one
per request, so ``len(accepted) == batch_size``) are required; ``steps`` (the steps the recorded
run used), ``context_tokens`` (the batch's KV tokens before the verify) and ``seconds`` (its
measured wall time) are optional, and other keys are kept for the user's own tools and ignored.

With greedy chain drafting, a request that accepted ``a`` drafts out of ``K`` would have accepted
``min(a, k)`` out of ``k <= K``: the replay feeds the policy ``min(a, chosen steps)``. Traces
recorded at the largest candidate steps therefore replay exactly for every config; a value above
the recorded ``steps`` is an error. The summary counts how many observations were capped.

Per-request decisions (issue 28): ``steps_per_request`` (each request's verify budget, recorded
when they differ from ``steps``), ``min_survival`` (the confidence stop's threshold) and
``verified`` (the drafts each request verified after the cut, recorded with ``min_survival``)
bound what the trace knows of each request: request ``r`` verified ``u_r`` drafts (``verified``,
else ``steps_per_request``, else ``steps``). A chosen ``k <= u_r``, or a request that rejected
within its ``u_r`` (``a_r < u_r``), replays exactly as ``min(a_r, k)``; a request that accepted
all its ``u_r`` drafts at a chosen ``k > u_r`` is *censored* (what it would have accepted beyond
``u_r`` is unknown): it emits its recorded ``a_r + 1`` tokens and is not fed to the policy, as
the live scheduler feeds the batch-level policy only the requests that verified the batch's
steps. The summary counts censored observations and the verifies recorded under a stop rule.

Draft trees (issue 29): a tree iteration's line also carries ``tree_topk`` (2..64) and
``tree_nodes`` (``N``, the tree's nodes per request without the root, ``steps <= N <= min(64,
topk + (steps - 1) * topk**2)``; the depth is ``steps``), both or neither. The replayed policy
chooses chain steps, so a tree line replays as a chain of its depth: ``min(a, k)`` of the
accepted path's ``a`` drafts. That is optimistic for a chain (the tree's path may leave the
drafter's top-1 chain, which a chain could not follow); the summary counts these verifies
(``tree_verifies``) so a replay says how much of its trace came from trees. Under per-request
node budgets (issue 29 item 5) a tree line carries ``min_survival`` and ``verified``: the nodes
each request kept (``0..tree_nodes``); they bound what is known as above (a request that
accepted all of its ``u_r`` kept nodes is censored at a chosen ``k > u_r``).

Seconds: with a cost table (``--cost-table``, the JSON of :class:`specdial._core.CostTable`, which
``specdial policy simulate`` also reads) every verify costs what the table says for the batch
size, the chosen steps and the context, and the summary reports the replayed tokens per second;
without one, a recorded ``seconds`` is passed on only when the chosen steps equal the recorded
ones (it is unknown otherwise). The ``goodput`` strategy learns its cost model from them.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from specdial._core import AdaptiveConfig, AdaptiveSpeculativeParams, CostTable


class TraceError(ValueError):
    """A malformed trace line; the message starts with ``FILE:LINE:``."""


@dataclass
class Verify:
    """One parsed trace line."""

    batch_size: int
    accepted: np.ndarray  # [batch_size] int64
    steps: int | None = None
    context_tokens: int | None = None
    seconds: float | None = None
    #: ``[batch_size]`` int64: the drafts each request verified (``verified``, else
    #: ``steps_per_request``), None when the record has neither
    verified: np.ndarray | None = None
    min_survival: float | None = None
    #: ``(tree_topk, tree_nodes)`` of a draft-tree iteration, None for a chain
    tree: tuple[int, int] | None = None


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_line(text: str, where: str) -> Verify | None:
    """Parses one trace line (None for a blank line). Raises TraceError naming ``where``."""
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON: {e.msg}") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    bs, acc, steps = obj.get("batch_size"), obj.get("accepted"), obj.get("steps")
    if not _int(bs) or bs < 1:
        raise TraceError(f"{where}: batch_size must be an integer >= 1, got {bs!r}")
    if not isinstance(acc, list) or not all(_int(a) and a >= 0 for a in acc):
        raise TraceError(f"{where}: accepted must be a list of integers >= 0, got {acc!r}")
    if len(acc) != bs:
        raise TraceError(f"{where}: accepted has {len(acc)} entries but batch_size is {bs}")
    if steps is not None:
        if not _int(steps) or steps < 0:
            raise TraceError(f"{where}: steps must be an integer >= 0, got {steps!r}")
        if any(a > steps for a in acc):
            raise TraceError(f"{where}: accepted {acc} exceeds the recorded steps {steps}")
    ctx, secs = obj.get("context_tokens"), obj.get("seconds")
    if ctx is not None and (not _int(ctx) or ctx < 0):
        raise TraceError(f"{where}: context_tokens must be an integer >= 0, got {ctx!r}")
    if secs is not None and (isinstance(secs, bool) or not isinstance(secs, (int, float))
                             or not math.isfinite(secs) or secs <= 0):
        raise TraceError(f"{where}: seconds must be a finite number > 0, got {secs!r}")
    tree = _tree(obj, steps, where)
    return Verify(bs, np.asarray(acc, dtype=np.int64), steps, ctx,
                  None if secs is None else float(secs),
                  *_per_request(obj, acc, steps, where, None if tree is None else tree[1]),
                  tree=tree)


def _tree(obj: dict, steps: int | None, where: str) -> tuple[int, int] | None:
    """A tree line's ``(tree_topk, tree_nodes)`` (checked against ``steps``, its depth), or
    None for a chain's."""
    topk, nodes = obj.get("tree_topk"), obj.get("tree_nodes")
    if topk is None and nodes is None:
        return None
    if topk is None or nodes is None:
        raise TraceError(f"{where}: tree_topk and tree_nodes come together, got tree_topk "
                         f"{topk!r} and tree_nodes {nodes!r}")
    if not _int(topk) or not 2 <= topk <= 64:
        raise TraceError(f"{where}: tree_topk must be an integer in 2..64, got {topk!r}")
    if not _int(steps) or steps < 1:
        raise TraceError(f"{where}: a tree line needs its depth as steps >= 1, got {steps!r}")
    top = min(64, topk + (steps - 1) * topk * topk)
    if not _int(nodes) or not steps <= nodes <= top:
        raise TraceError(f"{where}: tree_nodes must be an integer in {steps}..{top} (steps .. "
                         f"min(64, topk + (steps - 1) * topk**2)), got {nodes!r}")
    return topk, nodes


def _lengths(obj: dict, key: str, n: int, top: list[int] | int | None, where: str) -> list | None:
    """``obj[key]``: ``n`` integers in ``0..top`` (per entry when ``top`` is a list), or None."""
    v = obj.get(key)
    if v is None:
        return None
    tops = top if isinstance(top, list) else [top] * n
    if not isinstance(v, list) or len(v) != n or not all(_int(x) and x >= 0 for x in v):
        raise TraceError(f"{where}: {key} must be a list of {n} integers >= 0, got {v!r}")
    if any(t is not None and x > t for x, t in zip(v, tops)):
        raise TraceError(f"{where}: {key} {v} exceeds {top}")
    return v


def _per_request(obj: dict, acc: list[int], steps: int | None, where: str,
                 tree_nodes: int | None = None) -> tuple[np.ndarray | None, float | None]:
    """The record's per-request lengths (``verified`` or ``steps_per_request``, checked against
    ``steps`` and ``accepted``; a tree line's ``verified`` are kept nodes, checked against its
    ``tree_nodes``) and ``min_survival``."""
    spr = _lengths(obj, "steps_per_request", len(acc), steps, where)
    top = tree_nodes if tree_nodes is not None else spr if spr is not None else steps
    ver = _lengths(obj, "verified", len(acc), top, where)
    ms = obj.get("min_survival")
    if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, float))
                           or not 0 < ms < 1):
        raise TraceError(f"{where}: min_survival must be a number in (0, 1), got {ms!r}")
    lens = ver if ver is not None else spr
    if lens is not None and any(a > u for a, u in zip(acc, lens)):
        raise TraceError(f"{where}: accepted {acc} exceeds the verified lengths {lens}")
    return (None if lens is None else np.asarray(lens, np.int64),
            None if ms is None else float(ms))


@dataclass
class ReplaySummary:
    """What a replay observed: iterations per steps value per slot, switches, capped observations."""

    iterations: dict[int, Counter[int]] = field(default_factory=dict)  # slot bound -> steps -> count
    switches: list[tuple[int, int, int, int, int]] = field(default_factory=list)  # line, bound, bs, old, new
    emitted_tokens: int = 0
    verifies: int = 0
    capped: int = 0
    #: observations past a request's recorded verify length that accepted all of it (unknown:
    #: not fed to the policy)
    censored: int = 0
    #: verifies recorded under a confidence stop (``min_survival``)
    stopped: int = 0
    #: verifies recorded as draft trees (``tree_topk``), replayed as chains of their depth
    tree_verifies: int = 0
    #: Seconds of the replayed verifies (with a cost table; None without one).
    seconds: float | None = None
    strategy: str = "ema"
    probes: int = 0

    @property
    def tokens_per_second(self) -> float | None:
        return self.emitted_tokens / self.seconds if self.seconds else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "verifies": self.verifies,
            "emitted_tokens": self.emitted_tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "probes": self.probes,
            "capped_observations": self.capped,
            "censored_observations": self.censored,
            "confidence_stop_verifies": self.stopped,
            "tree_verifies": self.tree_verifies,
            "switches": [dict(zip(("line", "slot", "batch_size", "old_steps", "new_steps"), s)) for s in self.switches],
            "iterations_per_steps": {str(b): {str(k): v for k, v in sorted(c.items())} for b, c in self.iterations.items()},
        }


def replay(
    config: AdaptiveConfig,
    trace_path: str | Path,
    *,
    initial_steps: int | None = None,
    cuda_graph_bs: list[int] | None = None,
    cost_table: CostTable | None = None,
    out: IO[str] | None = None,
) -> ReplaySummary:
    """Replays ``trace_path`` through a fresh policy built from ``config``.

    ``initial_steps`` defaults to the middle of the candidates' union (as the Engine does).
    ``cost_table``: seconds per verify (module docstring). Writes one line per step switch to
    ``out`` when given. Raises TraceError (bad line, with its number) and OSError (unreadable
    file).
    """
    union = config.candidate_steps
    params = AdaptiveSpeculativeParams(union[len(union) // 2] if initial_steps is None else initial_steps, config)
    params.set_cuda_graph_bs(cuda_graph_bs)
    bounds = config.slot_lower_bounds
    summary = ReplaySummary(iterations={b: Counter() for b in bounds}, strategy=config.strategy,
                            seconds=None if cost_table is None else 0.0)
    with open(trace_path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, start=1):
            v = parse_line(text, f"{trace_path}:{lineno}")
            if v is None:
                continue
            before = params.get_steps_for_batch(v.batch_size)
            decision = params.decide(v.batch_size, v.context_tokens)
            steps, bound = decision.steps, bounds[decision.slot]
            observed = np.minimum(v.accepted, steps)
            summary.capped += int(np.count_nonzero(observed != v.accepted))
            known = np.ones(v.batch_size, bool)
            if v.verified is not None:  # a request that accepted its whole length < k
                known = (v.accepted < v.verified) | (steps <= v.verified)
                summary.censored += int(np.count_nonzero(~known))
            summary.stopped += v.min_survival is not None
            summary.tree_verifies += v.tree is not None
            summary.iterations[bound][steps] += 1
            summary.verifies += 1
            summary.emitted_tokens += int(observed.sum()) + v.batch_size
            observed = observed[known]
            seconds = v.seconds if v.steps == steps else None
            if cost_table is not None:
                seconds = cost_table.seconds(v.batch_size, steps, float(v.context_tokens or 0))
                summary.seconds = (summary.seconds or 0.0) + seconds
            new = params.on_verify_complete(observed, v.batch_size, seconds=seconds,
                                            context_tokens=v.context_tokens, steps=steps)
            if new is not None:
                summary.switches.append((lineno, bound, v.batch_size, before, new))
                if out is not None:
                    estimate = params.slot_states()[decision.slot][2]
                    label = "ema of accepted drafts" if config.strategy == "ema" else "expected accepted drafts"
                    out.write(
                        f"line {lineno}: slot {bound} (batch size {v.batch_size}): steps {before} -> {new} "
                        f"({label} {estimate:.3f})\n"
                    )
    state = params.goodput_state()
    summary.probes = int(state["probes"]) if state else 0
    return summary


def format_summary(s: ReplaySummary) -> str:
    """A human-readable table of iterations per steps value per slot."""
    lines = [
        f"{s.verifies} verifies, {len(s.switches)} step switches, "
        f"{s.emitted_tokens} tokens emitted, {s.capped} observations capped at the chosen steps",
    ]
    if s.strategy == "goodput":
        lines.append(f"{s.probes} probes (goodput strategy)")
    if s.censored or s.stopped:
        lines.append(f"{s.censored} observations censored at a request's recorded verify length, "
                     f"{s.stopped} verifies recorded under a confidence stop")
    if s.tree_verifies:
        lines.append(f"{s.tree_verifies} verifies recorded as draft trees, replayed as chains "
                     "of their depth")
    if s.seconds is not None:
        lines.append(f"{s.seconds:.3f} s by the cost table: {s.tokens_per_second:.1f} tokens/s")
    lines.append("slot  iterations per steps")
    for bound, counts in s.iterations.items():
        per = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "(no verifies)"
        lines.append(f"{bound:>4}  {per}")
    return "\n".join(lines)
