"""What the engine loop shows: the :class:`~specdial.engine.api.EngineStats` snapshot built from
a report's (or the scheduler's) stats and slot states, and the periodic progress log line."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from specdial.engine.api import EngineStats

logger = logging.getLogger("specdial.engine")


class VerifyLengths:
    """A per-request histogram of decode iterations, one ``np.bincount`` per iteration, no
    per-request Python. The engine keeps two, never mixed (their units differ): the chain
    verify lengths (issue 28): ``counts[v]`` = request decode iterations of a chain whose verify
    budget was ``v`` drafts (``steps_per_request``, or what a confidence stop left; 0 is a plain
    decode through verify); and the draft trees' verified nodes (issue 29): ``counts[n]`` =
    request decode iterations of a tree that verified ``n`` nodes (its kept nodes under a node
    budget, else the tree's ``N``; 0 is a plain decode through verify). A tree's node count is
    no verify length: ``N`` nodes of depth ``D`` verify at most ``D`` drafts on one path."""

    def __init__(self) -> None:
        self.counts = np.zeros(1, np.int64)

    def add(self, budgets: Any) -> None:
        """Count one decode iteration's per-request values (``[B]`` non-negative ints)."""
        got = np.bincount(np.asarray(budgets, np.int64).reshape(-1))
        if len(got) > len(self.counts):
            self.counts = np.concatenate([self.counts, np.zeros(len(got) - len(self.counts),
                                                                np.int64)])
        self.counts[:len(got)] += got

    def as_dict(self) -> dict[int, int]:
        """``{value: request-iterations}``, the values seen so far (ascending)."""
        return {int(v): int(n) for v, n in enumerate(self.counts) if n}

    def snapshot(self) -> "VerifyLengths":
        """A copy that later :meth:`add` calls leave alone (the engine loop's stats snapshot,
        read by other threads)."""
        out = VerifyLengths()
        out.counts = self.counts.copy()
        return out


def engine_stats(s: Any, slot_states: Any, *, fixed_steps: int | None, prompt_tokens: int,
                 last_decode: tuple[int, int] | None, policy: str | None,
                 goodput: dict[str, Any] | None,
                 verify_lengths: "dict[int, int] | VerifyLengths | None" = None,
                 tree_nodes: "dict[int, int] | VerifyLengths | None" = None) -> EngineStats:
    """The snapshot of scheduler stats ``s`` (``specdial._core.SchedulerStats``) and
    ``slot_states`` (``(lower bound, steps, accepted estimate, verifies)`` per slot).
    ``fixed_steps``: shown as the one slot ``{1: steps}`` when the policy has no slots;
    ``last_decode``: ``(steps, padded batch size)`` of the latest decode iteration;
    ``verify_lengths`` (chains) and ``tree_nodes`` (draft trees): the two histograms, as
    :class:`VerifyLengths` or as their :meth:`VerifyLengths.as_dict`."""
    def as_dict(h: "dict[int, int] | VerifyLengths | None") -> dict[int, int]:
        return h.as_dict() if isinstance(h, VerifyLengths) else dict(h or {})

    states = [{"lower_bound": int(lb), "steps": int(k), "ema_accept_len": float(ema),
               "verify_count": int(n)} for lb, k, ema, n in slot_states]
    slots = {int(st["lower_bound"]): int(st["steps"]) for st in states}
    if not slots and fixed_steps is not None:
        slots = {1: int(fixed_steps)}
    return EngineStats(
        running=s.running + s.prefilling, queued=s.queued, kv_pages_used=s.kv_pages_used,
        kv_pages_total=s.kv_pages_total, steps_per_slot=slots, num_drafts=s.spec_num_drafts,
        draft_tokens_proposed=s.spec_num_draft_tokens,
        num_accepted_tokens=s.spec_num_accepted_tokens,
        accepted_per_pos=list(s.spec_accepted_per_pos), step_switches=s.step_switches,
        preemptions=s.preemptions, requests_finished=s.requests_finished,
        prompt_tokens=prompt_tokens, cached_tokens=s.cached_tokens,
        cached_pages=s.cached_pages, generation_tokens=s.tokens_generated,
        slot_states=states,
        last_decode_steps=None if last_decode is None else last_decode[0],
        last_decode_batch_size=None if last_decode is None else last_decode[1],
        policy=policy, goodput=goodput, verify_length_histogram=as_dict(verify_lengths),
        tree_node_histogram=as_dict(tree_nodes))


def log_progress(s: EngineStats, seconds: float, tokens: int, verifies: int,
                 verify_tokens: int) -> None:
    """One INFO line: the gauges of ``s``, and over the last ``seconds``: ``tokens`` generated
    per second and the acceptance length (``verify_tokens`` emitted over ``verifies``
    request-verifies)."""
    logger.info("running %d, queued %d, KV cache %.1f%% (%d/%d pages), %.1f tokens/s, "
                "accept length %.2f, steps per slot %s%s", s.running, s.queued,
                100.0 * s.kv_pages_used / max(s.kv_pages_total, 1), s.kv_pages_used,
                s.kv_pages_total, tokens / seconds,
                verify_tokens / verifies if verifies else 0.0, s.steps_per_slot,
                goodput_summary(s.goodput))


def goodput_summary(g: dict[str, Any] | None) -> str:
    """The goodput strategy's part of the log line ("" without it)."""
    if not g or not g.get("last_decision"):
        return ""
    d = g["last_decision"]
    ms = ", ".join(f"{k}: {1e3 * t:.1f}" for k, t in sorted(d["predicted_seconds"].items()))
    acc = ", ".join(f"{a:.2f}" for a in g["acceptance"][:8])
    return (f"; goodput at batch {d['batch_size']}: predicted ms per steps {{{ms}}}, "
            f"acceptance per position [{acc}], {g['probes']} probes")
