"""Benchmark measurements: per-request timings, engine statistics snapshots, and the summary.

Definitions (as ``sglang.bench_serving`` and ``vllm bench serve``; times in seconds, measured
with :func:`time.perf_counter` from the start of the run):

- TTFT (time to first token): first chunk carrying tokens - the moment the request was sent.
- TPOT (time per output token): ``(last chunk - first chunk) / (completion tokens - 1)``, per
  request with 2+ tokens; the mean/p50/p99 are over requests.
- ITL (inter-token latency): the gaps between consecutive chunks of a request, pooled over all
  requests. With speculative decoding one chunk carries all the tokens of one verify (the
  acceptance length), so an ITL is the time between two decode iterations as seen by the
  request, not a per-token figure; TPOT is the per-token figure.
- E2E latency: last chunk (or the response) - sent.
- Output throughput: completion tokens of successful requests / run duration (tokens/s);
  request throughput: successful requests / duration (requests/s).
- Mean acceptance length: tokens emitted per verify that carried drafts, bonus included:
  ``1 + accepted draft tokens / drafts`` from the engine's cumulative counters
  (:class:`specdial.engine.api.EngineStats`, or ``/metrics`` over HTTP), the difference between
  the end and the start of the run; the same definition as ``meta_info``'s
  ``spec_accept_length`` and ``specdial generate``'s. ``tokens_per_verify`` is another figure,
  printed as "Tokens per decode iteration": completion tokens after the first per decode
  iteration a request took part in, trivial verifies at ``steps = 0`` (plain decodes, one token
  each) included, so it is lower than the acceptance length whenever the policy ran steps 0
  (issue 26: 1.67 against 1.77).
- ``steps_histogram``: ``{steps: request-iterations}``: the per-request ``spec_steps_histogram``
  summed over requests (an iteration at batch size ``b`` counts ``b`` times).
  ``engine_iterations_per_steps`` is the engine's own count when its stats expose one
  (``iterations_per_steps``); ``steps_time_share`` is the share of the run's sampled time
  spent at each steps value of the slot in use (from the stats timeline).

Without streaming (an engine with only ``generate``) requests run in batches: TTFT, TPOT and
ITL are then unavailable (None) and E2E is the batch's wall time.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["RequestRecord", "RunData", "active_steps", "latency_summary", "percentile",
           "snapshot", "summarize", "timeline_series"]

#: Cumulative counters of :class:`specdial.engine.api.EngineStats` kept in snapshots.
COUNTERS = ("num_drafts", "draft_tokens_proposed", "num_accepted_tokens", "step_switches",
            "preemptions", "requests_finished", "prompt_tokens", "generation_tokens",
            "cached_tokens")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default); None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_summary(values: Sequence[float]) -> dict[str, float | None]:
    """``{"mean", "p50", "p99", "count"}`` of ``values`` (same unit as the values, seconds
    here); the statistics are None without values."""
    n = len(values)
    return {"mean": sum(values) / n if n else None, "p50": percentile(values, 50),
            "p99": percentile(values, 99), "count": n}


@dataclass
class RequestRecord:
    """What one request did. Times in seconds since the start of the run.

    ``chunk_times`` / ``chunk_tokens``: arrival of each chunk that carried output and its token
    count (None when unknown, e.g. over HTTP, where the total comes from ``usage``).
    ``verify_ct`` / ``steps_histogram``: from the engine's ``meta_info`` when available;
    ``cached_tokens``: prompt tokens the prefix cache served (``meta_info``, or the usage's
    ``prompt_tokens_details`` over HTTP; None when not reported). ``turn``: the 1-based turn of
    a multi-turn conversation (None otherwise); ``output_ids`` / ``output_text``: the answer,
    kept for the conversation's next turn (ids in process, text over HTTP).
    """

    index: int
    workload: str
    arrival_time: float = 0.0
    send_time: float = 0.0
    end_time: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int | None] = field(default_factory=list)
    success: bool = False
    error: str | None = None
    finish_reason: str | None = None
    streamed: bool = True
    verify_ct: int | None = None
    accept_length: float | None = None
    steps_histogram: dict[int, int] = field(default_factory=dict)
    cached_tokens: int | None = None
    turn: int | None = None
    output_ids: list[int] = field(default_factory=list)
    output_text: str = ""

    def add_chunk(self, t: float, tokens: int | None) -> None:
        """Record a chunk arriving at ``t`` with ``tokens`` output tokens (None = unknown)."""
        self.chunk_times.append(t)
        self.chunk_tokens.append(tokens)
        if tokens:
            self.completion_tokens += tokens

    def set_meta(self, meta: Mapping[str, Any]) -> None:
        """Take the engine's cumulative ``meta_info`` (completion/prompt tokens, verifies,
        acceptance length, steps histogram)."""
        if "completion_tokens" in meta:
            self.completion_tokens = int(meta["completion_tokens"])
        if "prompt_tokens" in meta:
            self.prompt_tokens = int(meta["prompt_tokens"])
        if meta.get("cached_tokens") is not None:
            self.cached_tokens = int(meta["cached_tokens"])
        if meta.get("spec_verify_ct") is not None:
            self.verify_ct = int(meta["spec_verify_ct"])
        if meta.get("spec_accept_length") is not None:
            self.accept_length = float(meta["spec_accept_length"])
        hist = meta.get("spec_steps_histogram")
        if hist:
            self.steps_histogram = {int(k): int(v) for k, v in hist.items()}

    @property
    def ttft(self) -> float | None:
        """Seconds from sending to the first chunk; None without streaming or chunks."""
        if not self.streamed or not self.chunk_times:
            return None
        return self.chunk_times[0] - self.send_time

    @property
    def e2e(self) -> float | None:
        """Seconds from sending to the end of the request."""
        return None if self.end_time is None else self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first; None with fewer than 2 tokens."""
        if not self.streamed or len(self.chunk_times) < 1 or self.completion_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.completion_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive chunks, seconds (empty without streaming)."""
        if not self.streamed:
            return []
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


def snapshot(stats: Any, t: float) -> dict[str, Any]:
    """A plain dict of an :class:`~specdial.engine.api.EngineStats` (or a mapping with its
    field names) taken at ``t`` seconds: ``t``, ``running``, ``queued``, ``steps_per_slot``
    (``{slot lower batch size: steps}``), the cumulative :data:`COUNTERS`, and
    ``iterations_per_steps`` when the stats have it."""
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        data: Mapping[str, Any] = {f.name: getattr(stats, f.name)
                                   for f in dataclasses.fields(stats)}
        extra = getattr(stats, "iterations_per_steps", None)
        if extra is not None:
            data = {**data, "iterations_per_steps": extra}
    else:
        data = stats
    snap: dict[str, Any] = {"t": t, "running": int(data.get("running", 0) or 0),
                            "queued": int(data.get("queued", 0) or 0),
                            "steps_per_slot": {int(k): int(v) for k, v in
                                               (data.get("steps_per_slot") or {}).items()}}
    for name in COUNTERS:
        snap[name] = int(data.get(name, 0) or 0)
    if data.get("iterations_per_steps") is not None:
        snap["iterations_per_steps"] = {int(k): int(v)
                                        for k, v in data["iterations_per_steps"].items()}
    for name in ("verify_length_histogram", "tree_node_histogram"):
        if data.get(name) is not None:
            snap[name] = {int(k): int(v) for k, v in data[name].items()}
    return snap


def active_steps(snap: Mapping[str, Any]) -> int | None:
    """The steps of the slot covering the current batch size: the slot with the largest lower
    bound <= ``max(running, 1)``; None when the engine reports no slot."""
    slots = snap.get("steps_per_slot") or {}
    if not slots:
        return None
    bs = max(int(snap.get("running", 0)), 1)
    eligible = [k for k in slots if k <= bs] or [min(slots)]
    return int(slots[max(eligible)])


def timeline_series(snaps: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Per-sample series of a run's stats timeline: ``t`` (seconds), ``running``, ``steps``
    (:func:`active_steps`), ``accept_length`` over the interval ending at the sample
    (``1 + d accepted / d drafts``; None when no draft was verified in it) and
    ``output_tokens_per_s`` over that interval. The first sample has no interval (None)."""
    out: dict[str, list[Any]] = {"t": [], "running": [], "steps": [], "accept_length": [],
                                 "output_tokens_per_s": []}
    prev: Mapping[str, Any] | None = None
    for s in snaps:
        out["t"].append(s["t"])
        out["running"].append(s["running"])
        out["steps"].append(active_steps(s))
        if prev is None:
            out["accept_length"].append(None)
            out["output_tokens_per_s"].append(None)
        else:
            drafts = s["num_drafts"] - prev["num_drafts"]
            acc = s["num_accepted_tokens"] - prev["num_accepted_tokens"]
            dt = s["t"] - prev["t"]
            out["accept_length"].append(1 + acc / drafts if drafts > 0 else None)
            gen = s["generation_tokens"] - prev["generation_tokens"]
            out["output_tokens_per_s"].append(gen / dt if dt > 0 else None)
        prev = s
    return out


@dataclass
class RunData:
    """One benchmark run: its requests, wall ``duration_s`` (seconds, first send to last
    finish), the stats ``timeline`` (snapshots; the first at the start, the last at the end,
    empty when the engine has no ``stats()``) and whether requests were streamed."""

    records: list[RequestRecord]
    duration_s: float
    timeline: list[dict[str, Any]] = field(default_factory=list)
    streaming: bool = True


def _delta(runs: Iterable[RunData], name: str) -> int | None:
    total, seen = 0, False
    for r in runs:
        if len(r.timeline) >= 2:
            total += r.timeline[-1][name] - r.timeline[0][name]
            seen = True
    return total if seen else None


def _hist_delta(runs: Iterable[RunData], name: str) -> dict[int, int] | None:
    """The growth of a cumulative ``{key: count}`` snapshot entry over each run, summed (None
    when no run has two snapshots with it)."""
    total: dict[int, int] | None = None
    for r in runs:
        if len(r.timeline) >= 2 and name in r.timeline[-1]:
            first, last = r.timeline[0].get(name, {}), r.timeline[-1][name]
            total = total or {}
            for k, v in last.items():
                if v - first.get(k, 0):
                    total[k] = total.get(k, 0) + v - first.get(k, 0)
    return None if total is None else dict(sorted(total.items()))


def _steps_time_share(runs: Iterable[RunData]) -> dict[int, float]:
    weights: dict[int, float] = {}
    for r in runs:
        for a, b in zip(r.timeline, r.timeline[1:]):
            k = active_steps(b)
            if k is not None and b["running"] > 0:
                weights[k] = weights.get(k, 0.0) + (b["t"] - a["t"])
    total = sum(weights.values())
    return {k: v / total for k, v in sorted(weights.items())} if total > 0 else {}


def summarize(runs: Sequence[RunData]) -> dict[str, Any]:
    """The figures of one or more runs of the same configuration, pooled (the module docstring
    defines them). Keys: ``completed``, ``failed``, ``duration_s``, ``input_tokens``,
    ``output_tokens``, ``request_throughput`` (requests/s), ``output_throughput`` (tokens/s),
    ``total_token_throughput`` (prompt + output tokens/s), ``ttft_s`` / ``tpot_s`` / ``itl_s``
    / ``e2e_latency_s`` (each ``{"mean", "p50", "p99", "count"}``, seconds),
    ``mean_accept_length``, ``draft_acceptance_rate``, ``tokens_per_verify``,
    ``steps_histogram``, ``engine_iterations_per_steps``, ``steps_time_share``,
    ``verify_length_histogram`` (``{drafts verified: request-iterations}`` of chain
    iterations, each request at its own verify budget; from the engine's stats timeline, None
    without one), ``tree_node_histogram`` (``{tree nodes verified: request-iterations}`` of
    draft-tree iterations, kept apart: a node count is no verify length; None likewise),
    ``step_switches``, ``streaming``, ``errors`` (up to 5 messages), ``cached_tokens`` (prompt
    tokens the prefix cache served, summed over the requests that reported it; None when none
    did), ``prefix_cache_hit_rate`` (those over their prompt tokens) and ``ttft_per_turn_s``
    (``{turn: {"mean", "p50", "p99", "count"}}`` for multi-turn runs, else empty)."""
    records = [rec for r in runs for rec in r.records]
    ok = [rec for rec in records if rec.success]
    errors = [rec.error for rec in records if rec.error][:5]
    return {**_run_figures(runs, ok, records, errors), **_prefix_cache_figures(ok)}


def _prefix_cache_figures(ok: Sequence[RequestRecord]) -> dict[str, Any]:
    """The prefix cache's part of :func:`summarize`: cached tokens, hit rate, TTFT per turn."""
    cached = [rec for rec in ok if rec.cached_tokens is not None]
    prompt = sum(rec.prompt_tokens or 0 for rec in cached)
    hits = sum(rec.cached_tokens or 0 for rec in cached)
    turns = sorted({rec.turn for rec in ok if rec.turn is not None})
    return {"cached_tokens": hits if cached else None,
            "prefix_cache_hit_rate": hits / prompt if cached and prompt else None,
            "ttft_per_turn_s": {t: latency_summary([x for rec in ok if rec.turn == t
                                                   for x in [rec.ttft] if x is not None])
                                for t in turns}}


def _run_figures(runs: Sequence[RunData], ok: Sequence[RequestRecord],
                 records: Sequence[RequestRecord], errors: list[str | None]) -> dict[str, Any]:
    """Everything else of :func:`summarize` (its docstring)."""
    duration = sum(r.duration_s for r in runs)
    out_tokens = sum(rec.completion_tokens for rec in ok)
    in_tokens = sum(rec.prompt_tokens or 0 for rec in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    hist: dict[int, int] = {}
    for rec in ok:
        for k, v in rec.steps_histogram.items():
            hist[k] = hist.get(k, 0) + v
    verifies = [rec for rec in ok if rec.verify_ct]
    tokens_per_verify = (sum(rec.completion_tokens - 1 for rec in verifies)
                         / sum(rec.verify_ct or 0 for rec in verifies)) if verifies else None
    drafts, accepted = _delta(runs, "num_drafts"), _delta(runs, "num_accepted_tokens")
    draft_tokens = _delta(runs, "draft_tokens_proposed")
    engine_iters: dict[int, int] | None = None
    for r in runs:
        if len(r.timeline) >= 2 and "iterations_per_steps" in r.timeline[-1]:
            first, last = r.timeline[0].get("iterations_per_steps", {}), r.timeline[-1][
                "iterations_per_steps"]
            engine_iters = engine_iters or {}
            for k, v in last.items():
                engine_iters[k] = engine_iters.get(k, 0) + v - first.get(k, 0)
    return {
        "verify_length_histogram": _hist_delta(runs, "verify_length_histogram"),
        "tree_node_histogram": _hist_delta(runs, "tree_node_histogram"),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(out_tokens + in_tokens),
        "ttft_s": latency_summary([x for x in (rec.ttft for rec in ok) if x is not None]),
        "tpot_s": latency_summary([x for x in (rec.tpot for rec in ok) if x is not None]),
        "itl_s": latency_summary([x for rec in ok for x in rec.itls]),
        "e2e_latency_s": latency_summary([x for x in (rec.e2e for rec in ok) if x is not None]),
        "mean_accept_length": (1 + accepted / drafts) if drafts and accepted is not None
        else None,
        "draft_acceptance_rate": (accepted / draft_tokens) if draft_tokens and accepted is not None
        else None,
        "tokens_per_verify": tokens_per_verify,
        "steps_histogram": dict(sorted(hist.items())),
        "engine_iterations_per_steps": None if engine_iters is None
        else dict(sorted(engine_iters.items())),
        "steps_time_share": _steps_time_share(runs),
        "step_switches": _delta(runs, "step_switches"),
        "streaming": all(r.streaming for r in runs),
        "errors": errors,
    }
