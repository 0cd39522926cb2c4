"""``specdial policy replay``: run a recorded per-verify trace through the adaptive policy offline.

A trace is JSON Lines, one object per verify::

    {"batch_size": 4, "accepted": [3, 0, 7, 2], "steps": 7}

``batch_size`` (int >= 1) and ``accepted`` (accepted drafts per request, bonus token excluded, one
per request, so ``len(accepted) == batch_size``) are required; ``steps`` (the steps the recorded
run used) is optional, and other keys are kept for the user's own tools and ignored here.

With greedy chain drafting, a request that accepted ``a`` drafts out of ``K`` would have accepted
``min(a, k)`` out of ``k <= K``: the replay feeds the policy ``min(a, chosen steps)``. Traces
recorded at the largest candidate steps therefore replay exactly for every config; a value above
the recorded ``steps`` is an error. The summary counts how many observations were capped.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from specdial._core import AdaptiveConfig, AdaptiveSpeculativeParams


class TraceError(ValueError):
    """A malformed trace line; the message starts with ``FILE:LINE:``."""


@dataclass
class Verify:
    """One parsed trace line."""

    batch_size: int
    accepted: np.ndarray  # [batch_size] int64


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
    return Verify(bs, np.asarray(acc, dtype=np.int64))


@dataclass
class ReplaySummary:
    """What a replay observed: iterations per steps value per slot, switches, capped observations."""

    iterations: dict[int, Counter[int]] = field(default_factory=dict)  # slot bound -> steps -> count
    switches: list[tuple[int, int, int, int, int]] = field(default_factory=list)  # line, bound, bs, old, new
    emitted_tokens: int = 0
    verifies: int = 0
    capped: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "verifies": self.verifies,
            "emitted_tokens": self.emitted_tokens,
            "capped_observations": self.capped,
            "switches": [dict(zip(("line", "slot", "batch_size", "old_steps", "new_steps"), s)) for s in self.switches],
            "iterations_per_steps": {str(b): {str(k): v for k, v in sorted(c.items())} for b, c in self.iterations.items()},
        }


def replay(
    config: AdaptiveConfig,
    trace_path: str | Path,
    *,
    initial_steps: int | None = None,
    cuda_graph_bs: list[int] | None = None,
    out: IO[str] | None = None,
) -> ReplaySummary:
    """Replays ``trace_path`` through a fresh policy built from ``config``.

    ``initial_steps`` defaults to the middle of the candidates' union (as the Engine does).
    Writes one line per step switch to ``out`` when given. Raises TraceError (bad line, with its
    number) and OSError (unreadable file).
    """
    union = config.candidate_steps
    params = AdaptiveSpeculativeParams(union[len(union) // 2] if initial_steps is None else initial_steps, config)
    params.set_cuda_graph_bs(cuda_graph_bs)
    bounds = config.slot_lower_bounds
    summary = ReplaySummary(iterations={b: Counter() for b in bounds})
    with open(trace_path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, start=1):
            v = parse_line(text, f"{trace_path}:{lineno}")
            if v is None:
                continue
            decision = params.decide(v.batch_size)
            steps, bound = decision.steps, bounds[decision.slot]
            observed = np.minimum(v.accepted, steps)
            summary.capped += int(np.count_nonzero(observed != v.accepted))
            summary.iterations[bound][steps] += 1
            summary.verifies += 1
            summary.emitted_tokens += int(observed.sum()) + v.batch_size
            new = params.on_verify_complete(observed, v.batch_size)
            if new is not None:
                summary.switches.append((lineno, bound, v.batch_size, steps, new))
                if out is not None:
                    ema = params.slot_states()[decision.slot][2]
                    out.write(
                        f"line {lineno}: slot {bound} (batch size {v.batch_size}): steps {steps} -> {new} "
                        f"(ema of accepted drafts {ema:.3f})\n"
                    )
    return summary


def format_summary(s: ReplaySummary) -> str:
    """A human-readable table of iterations per steps value per slot."""
    lines = [
        f"{s.verifies} verifies, {len(s.switches)} step switches, "
        f"{s.emitted_tokens} tokens emitted, {s.capped} observations capped at the chosen steps",
        "slot  iterations per steps",
    ]
    for bound, counts in s.iterations.items():
        per = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "(no verifies)"
        lines.append(f"{bound:>4}  {per}")
    return "\n".join(lines)
