"""The engine loop: one background thread that owns the Rust scheduler and the worker.

Every :class:`specdial._core.Scheduler` call happens on this thread. Other threads talk to it
through :meth:`EngineLoop.post` (a FIFO inbox of typed messages: :class:`Submit`,
:class:`Cancel`, :class:`Abort`, :class:`Shutdown`) and get their results through each request's
*sink* (a callable the loop calls, from its thread, with :class:`Submitted`, an exception, or a
:class:`~specdial.engine.api.StreamChunk`). Each turn of the loop:

1. handles the inbox (:mod:`specdial.engine.inbox`): submissions (``add_request``; the sink
   gets ``Submitted(id)``, or :class:`~specdial.engine.api.RequestError` /
   :class:`~specdial.engine.api.QueueFullError`; a request whose grammar compiles is held
   until it is ready), aborts, cancellations of streams, shutdown; it blocks there while
   nothing is live; it stops after a shutdown once nothing is live and no request is held;
2. runs one iteration (:meth:`EngineLoop.step`): ``plan = schedule()`` ->
   ``worker.prefill/decode(plan)`` -> the stop strings checked on the emitted tokens
   (:mod:`specdial.engine.stops`) -> ``report(..., stop_strings=...)``, which decides every
   finish (the plan carries each request's worker row, which the scheduler assigns at
   admission and frees at finish / abort / preemption, and whether the drafter's prefill runs
   now); a decode iteration is timed from just before ``schedule()`` to just after the passes
   return (the worker's one host sync) and reported as ``seconds``, which the adaptive
   policy's cost model learns from: wall seconds, except on the CPU with one torch thread,
   where the loop thread's CPU seconds (all of the iteration's work runs on it, and they leave
   out the time spent waiting for a core while other processes load the machine);
3. post-processes the report: appends tokens, detokenizes (reusing the stop-string check's
   text), appends the per-verify trace (``record_trace``), refreshes the :class:`EngineStats`
   snapshot from the stats the report returned, logs every ``log_interval_s`` while decoding,
   and only then hands the chunks to the sinks (so a caller that saw its last chunk sees the
   freed pages in ``stats()``).

``stream_interval`` (SGLang's ``--stream-interval``, default 1: a chunk per iteration that
emitted tokens): a request's first chunk with tokens is sent at once (its time to first token;
SGLang sends at ``len(output_ids) % interval == 1``, the first token included), later ones are
held (:attr:`LiveRequest.held`, joined by :func:`~specdial.engine.live.join_chunks`) until at
least ``stream_interval`` tokens wait, and the final chunk always goes with whatever is held.
SGLang counts the interval on the output length, which a verify that emits several tokens can
step over; counting the tokens waiting keeps every sent chunk between the first and the final at
``>= stream_interval`` tokens. A held chunk's text is not detokenized until it is sent (the
whole output is decoded then, once), unless a stop-string check computed it already. The
joined text, token ids, logprobs and ``meta_info`` a consumer sees are those of interval 1. It
applies to every request: a non-streamed one (``whole=True``) joins its chunks at its end
anyway, so it only gets fewer of them.

A steady decode iteration makes two scheduler calls: ``schedule()`` and ``report()``.

An exception while running a plan fails the plan's requests (``abandon_plan()`` aborts them;
finish reason ``error`` with the message, :mod:`specdial.engine.ends`), is logged with its
traceback, and the loop keeps serving. A request whose sampling options cannot be built into
its batch fails alone (:mod:`specdial.engine.isolation`); nothing a request carries stops the
loop. Aborts happen between iterations, never while a plan is in flight (except a request
failed alone while its batch is built); stop-string finishes happen in the report.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from specdial.detokenize import IncrementalText
from specdial.engine.api import POLICY_REFRESH_S, EngineStats
from specdial.engine.ends import failed, finished
from specdial.engine.grammar_gate import attach_grammar, grammar_end_error
from specdial.engine.inbox import LoopInbox
from specdial.engine.isolation import sampling_isolated
from specdial.engine.loop_stats import VerifyLengths, engine_stats, log_progress
from specdial.engine.cache_ops import note_cached_tokens
from specdial.engine.courier import burst
from specdial.engine.live import (LiveRequest, join_chunks, prompt_plan,
                                  store_prompt_logprobs)
from specdial.engine.stops import StopCheck, check_stop_strings
from specdial.engine.messages import (Abort, Cancel, Crash, Message, RequestSpec,
                                      Shutdown, StepsSchedule, Submit, Submitted)
from specdial.worker.logprobs import HostLogprobs, LogprobRows
from specdial.worker.sampling import BatchSampling, SamplingParams
from specdial.worker.worker import SpecWorker, StepOutput

logger = logging.getLogger("specdial.engine")

__all__ = ["Abort", "Cancel", "Crash", "EngineLoop", "Message", "RequestSpec", "Shutdown",
           "StepsSchedule", "Submit", "Submitted"]


class EngineLoop(LoopInbox):
    """The loop thread over ``scheduler`` and ``worker`` (see the module docstring).

    ``generator``: the sampling generator of the requests without a ``seed`` (seeded requests
    never touch it: their draws are keyed by seed, token position and purpose, see
    :mod:`specdial.worker.seeded_noise`; the seeds reach the worker through the cached
    :class:`BatchSampling`); ``steps_schedule``: the test hook of :class:`specdial.Engine`
    (fixed steps per decode iteration through ``set_fixed_steps``); ``trace_file``: an open
    text file for ``drain_trace()`` output, or None; ``log_interval_s``: seconds between log
    lines while decoding (None or <= 0: never).
    """

    def __init__(self, scheduler: Any, worker: SpecWorker, *, tokenizer: Any,
                 generator: torch.Generator | None, steps_schedule: StepsSchedule | None = None,
                 trace_file: Any = None, log_interval_s: float | None,
                 stream_interval: int = 1) -> None:
        if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) \
                or stream_interval < 1:
            raise ValueError(f"stream_interval must be an int >= 1, got {stream_interval!r}")
        self.stream_interval = stream_interval
        self.sched, self.worker, self.tokenizer = scheduler, worker, tokenizer
        self.generator, self.steps_schedule = generator, steps_schedule
        self.trace_file, self.log_interval_s = trace_file, log_interval_s
        self.device = worker.device
        # torch's intra-op thread count is per OS thread (OpenMP): without this the loop thread
        # would run with the default and be many times slower than the caller configured
        self._num_threads = torch.get_num_threads()
        #: the iteration's seconds for the policy from this thread's CPU clock: on the CPU with
        #: one torch thread every op runs here, and on a shared machine wall seconds carry the
        #: waits for a core (at load 8-12 on 2 cores the cost model left 40 % of the iterations
        #: out as off pace, and the depth a run settled on moved with the load; BENCHMARKS.md,
        #: "Issue 29 at batch 1: why the adaptive depth moves from run to run")
        self._cpu_clock = torch.device(self.device).type == "cpu" and self._num_threads == 1
        self._init_inbox()
        self.live: dict[int, LiveRequest] = {}
        self.dead: BaseException | None = None
        self._stopping = self._drain = False
        self._outbox: list[tuple[Callable[[Any], None], Any]] = []
        self._sampling_key: tuple[int, ...] | None = None
        self._sampling: BatchSampling | None = None
        self._lp_rows: LogprobRows | None = None
        self._last_decode: tuple[int, int] | None = None  # (steps, padded batch size)
        self._decode_iters = self.turns = 0  # turns: of _main's loop (Engine.loop_turns)
        self._prompt_tokens = 0  # submitted (the scheduler's also counts startup profiling's)
        self._verify_reqs = self._verify_tokens = 0
        self._verify_lengths = VerifyLengths()  # chains: drafts verified per request
        self._tree_nodes = VerifyLengths()  # draft trees: nodes verified per request
        self._log_mark = (time.monotonic(), 0, 0, 0)
        #: the latest EngineStats, or the inputs of the next one (see :meth:`_refresh_stats`)
        self._stats: EngineStats | tuple[tuple[Any, Any], dict[str, Any]] = EngineStats()
        self._stats_built: tuple[Any, EngineStats] | None = None  # (inputs, what stats() built)
        self._goodput: dict[str, Any] | None = None
        self._goodput_at = -POLICY_REFRESH_S
        # read once: only this loop changes them (set_fixed_steps), and the strategy never
        self._policy = scheduler.policy_strategy
        #: the test hook for a deterministic cost: ``f(plan, measured_s) -> seconds`` reported
        #: to the policy instead of the measured wall seconds (None: the measured ones)
        self.decode_seconds: Callable[[Any, float], float] | None = None
        self._fixed_steps = scheduler.fixed_steps
        self._unfinished = 0  # live requests in the scheduler, from the latest stats
        self._stats_stale = False  # a request finished after the report's stats
        self._refresh_stats()  # before the thread starts: no concurrent scheduler call
        self.thread = threading.Thread(target=self._main, name="specdial-engine", daemon=True)

    # ------------------------------------------------------------------ other threads
    def start(self) -> None:
        self.thread.start()

    def stats(self) -> EngineStats:
        """The latest snapshot (a copy; refreshed after every iteration and inbox turn). Built
        here, on the caller's thread, from the inputs the loop kept (:meth:`_refresh_stats`):
        immutable report objects and copies, so the loop pays no dataclass per iteration."""
        snap = self._stats
        if not isinstance(snap, EngineStats):
            # cached per snapshot by identity, never written back to ``_stats``: a reader
            # must not replace a newer snapshot the loop stored meanwhile with an older one
            built = self._stats_built
            if built is None or built[0] is not snap:
                built = self._stats_built = (snap, engine_stats(*snap[0], **snap[1]))
            snap = built[1]
        return dataclasses.replace(snap, steps_per_slot=dict(snap.steps_per_slot),
                                   accepted_per_pos=list(snap.accepted_per_pos),
                                   slot_states=[dict(d) for d in snap.slot_states])

    # ------------------------------------------------------------------ the loop
    def _main(self) -> None:
        torch.set_num_threads(self._num_threads)
        try:
            with torch.inference_mode():
                while True:
                    self.turns, busy = self.turns + 1, self._unfinished > 0
                    if not busy and self._stopping and not self.held:
                        break
                    self._handle_inbox(block=not busy)
                    if not busy and self._unfinished:
                        self._log_mark = self._mark()  # tokens/s from when work arrived
                    if self._unfinished:
                        self.step()
        except BaseException as e:  # noqa: BLE001 - the loop must answer everyone
            logger.exception("the engine loop failed; the engine stops serving")
            self.dead = e
            reason = failed(f"the engine loop stopped: {type(e).__name__}: {e}")
            for rid in list(self.live):
                try:
                    self.sched.abort(rid)
                except Exception:  # noqa: BLE001 - the scheduler may be what broke
                    pass
                self._end_aborted(rid, reason)
            self._end_held(reason)
            self._flush()
            self._answer_until_shutdown(e)
        finally:
            if self.trace_file is not None:
                self._write_trace()
                self.trace_file.close()

    def step(self) -> None:
        """One iteration: ``schedule()`` -> the worker's passes -> ``report()`` ->
        post-processing (chunks to the sinks). A failed pass abandons the plan."""
        self._apply_steps_schedule()
        # a decode iteration's seconds: schedule -> passes done (see ``_cpu_clock``)
        started = time.thread_time() if self._cpu_clock else time.perf_counter()
        plan = self.sched.schedule()
        if plan is None:  # live requests but nothing to run now (not expected)
            logger.warning("nothing schedulable with %d live requests", len(self.live))
            time.sleep(0.01)
            return
        rids = plan.request_ids.tolist()
        try:
            if plan.is_prefill:
                out, res, stops = self._run_prefill(plan, rids)
            else:
                out, res, stops = self._run_decode(plan, rids, started)
        except Exception as e:  # noqa: BLE001 - fail these requests, keep serving
            logger.exception("a %s iteration failed; aborting its %d requests", plan.kind,
                             len(rids))
            self._fail_plan(plan, rids, e)
            return
        self._after_report(plan, rids, res, out.logprobs, stops)

    def _apply_steps_schedule(self) -> None:
        """The test hook: fix the next decode iteration's steps from ``steps_schedule``."""
        if self.steps_schedule is not None:
            sched, i = self.steps_schedule, self._decode_iters
            k = sched(i, self.sched.num_running) if callable(sched) else sched[i % len(sched)]
            self.sched.set_fixed_steps(int(k))
            self._fixed_steps = int(k)

    def _run_prefill(self, plan: Any, rids: list[int]) -> tuple[StepOutput, Any, StopCheck]:
        """The prefill passes and their report: first tokens sampled for ``sample_first``
        requests (stop strings checked in them), prompt logprobs stored where asked. The
        drafter's prefill is deferred when the plan says so (``draft_prefill``: decoding runs
        steps 0 with the zero-step extend skipped; the core decides and counts the catch-up)."""
        now = time.perf_counter()
        for rid in rids:
            lv = self.live[rid]
            if lv.queue_time is None:
                lv.queue_time = now - lv.submitted
        note_cached_tokens(plan, rids, self.live)
        first_live = [self.live[r] for r, f in zip(rids, plan.sample_first.tolist()) if f]
        sampling = self._batch_sampling(first_live) if first_live else None
        lp_rows = LogprobRows.build([lv.top_n() for lv in first_live], self.device)
        prompts, owners = prompt_plan(plan, rids, self.live)
        out = self.worker.prefill(plan, sampling, self.generator, lp_rows, prompts,
                                  draft_prefill=plan.draft_prefill)
        stops = check_stop_strings(self.live, rids, out.tokens, out.offsets)
        res = self.sched.report(out.tokens, out.offsets, stop_strings=stops.stopped)
        store_prompt_logprobs(out.prompt_logprobs, owners)
        return out, res, stops

    def _run_decode(self, plan: Any, rids: list[int], started: float
                    ) -> tuple[StepOutput, Any, StopCheck]:
        """The decode passes and their report, timed from ``started`` (before ``schedule()``,
        by the clock ``_cpu_clock`` picks) to the passes' end: the ``seconds`` the adaptive
        policy's cost model learns from (``decode_seconds(plan, measured)`` instead where
        that test hook is set). The stop strings are checked before the report, which
        finishes those that matched."""
        sampling = self._sampling_for(rids)
        out = self.worker.decode(plan, sampling, self.generator, self._lp_rows)
        seconds = (time.thread_time() if self._cpu_clock else time.perf_counter()) - started
        if self.decode_seconds is not None:
            seconds = float(self.decode_seconds(plan, seconds))
        stops = check_stop_strings(self.live, rids, out.tokens, out.offsets)
        res = self.sched.report(out.tokens, out.offsets, out.accepted, seconds=seconds,
                                stop_strings=stops.stopped, **out.decode_extras())
        self._decode_iters += 1
        if plan.tree_topk > 1:  # a tree's nodes are no verify length (loop_stats.VerifyLengths)
            self._tree_nodes.add(np.full(plan.batch_size, plan.num_draft_tokens, np.int64)
                                 if out.verified is None else out.verified)
        else:
            self._verify_lengths.add(plan.steps_per_request if out.verified is None
                                     else out.verified)
        self._last_decode = (int(plan.steps), int(plan.graph_bs or plan.batch_size))
        return out, res, stops

    def _build_sampling(self, params: list[SamplingParams], prompt_lens: list[int],
                        min_tokens_ids: list[tuple[int, ...]]) -> BatchSampling:
        return BatchSampling.from_params(params, self.device, prompt_lens=prompt_lens,
                                         min_tokens_ids=min_tokens_ids)

    def _batch_sampling(self, live: list[LiveRequest]) -> BatchSampling:
        """The options of ``live`` requests in batch order, with what their penalties and
        ``min_tokens`` need (prompt lengths, masked ids). A request whose options cannot be
        built fails alone (aborted in the scheduler, final ``error`` chunk); the batch runs
        with neutral options in its row (:func:`~specdial.engine.isolation.sampling_isolated`)."""
        sampling, culprits = sampling_isolated(
            [lv.spec.params for lv in live], [len(lv.spec.prompt_ids) for lv in live],
            [lv.spec.min_tokens_ids for lv in live], self._build_sampling)
        for i, error in culprits.items():
            logger.error("request %d: its sampling options failed in its batch: %s",
                         live[i].rid, error)
            self._finish_now(live[i].rid, failed(
                f"its sampling options could not be applied: {type(error).__name__}: {error}"))
        return attach_grammar(sampling, [lv.grammar for lv in live], self.worker)

    def _sampling_for(self, rids: list[int]) -> BatchSampling:
        key = tuple(rids)
        if key != self._sampling_key or self._sampling is None:
            live = [self.live[r] for r in rids]
            self._sampling = self._batch_sampling(live)
            self._lp_rows = LogprobRows.build([lv.top_n() for lv in live], self.device)
            self._sampling_key = key
        return self._sampling

    def _fail_plan(self, plan: Any, rids: list[int], error: Exception) -> None:
        """The plan's passes raised: abandon it (the scheduler aborts its live requests) and
        send each of them its final chunk with the error."""
        reason = failed(f"internal error: {type(error).__name__}: {error}")
        end = self._finish_now
        if self.sched.plan_in_flight:  # False when report() itself raised after applying
            self.sched.abandon_plan()  # aborts the plan's requests in the scheduler
            end = self._end_aborted
        for rid in rids:
            if rid in self.live:
                end(rid, reason)
        self._sampling_key = None
        self._refresh_stats()
        self._flush()

    def _after_report(self, plan: Any, rids: list[int], res: Any,
                      logprobs: HostLogprobs | None = None,
                      stops: StopCheck | None = None) -> None:
        """Post-process a report: per request its counters, text and chunk (final when the
        report finished it), then the trace, the stats snapshot, the log line and the sinks."""
        decode = not plan.is_prefill
        steps = int(plan.steps)
        finished = {f.request_id: f for f in res.finished}
        tokens = np.asarray(res.new_tokens)
        offsets = res.new_offsets.tolist()
        lp_row: dict[int, int] = {}
        if logprobs is not None:
            # decode rows are plan rows; prefill rows count the sample_first requests only
            plan_rows = (np.arange(len(rids)) if decode
                         else np.flatnonzero(np.asarray(plan.sample_first)))
            lp_row = {int(plan_rows[r]): i for i, r in enumerate(logprobs.rows.tolist())}
        for b, rid in enumerate(rids):
            lv = self.live.get(rid)
            if lv is None:
                continue
            new = tokens[offsets[b]:offsets[b + 1]].tolist()
            if decode:
                lv.verify_ct += 1
                lv.hist[steps] = lv.hist.get(steps, 0) + 1
                if steps > 0:
                    lv.draft_verify_ct += 1
                    lv.draft_verify_tokens += len(new)
                self._verify_reqs += 1
                self._verify_tokens += len(new)
            fin = finished.get(rid)
            if not new and fin is None:
                continue
            i = lp_row.get(b)
            token_lp = None if i is None or logprobs is None else (
                logprobs.logprob[i, :len(new)], logprobs.top_ids[i, :len(new)],
                logprobs.top_logprob[i, :len(new)])
            try:
                self._emit(lv, new, fin, token_lp,
                           None if stops is None else stops.text_for(rid, fin))
            except Exception as e:  # noqa: BLE001 - fail this request only
                logger.exception("post-processing request %d failed", rid)
                if rid in self.live:
                    self._finish_now(rid, failed(f"internal error: {type(e).__name__}: {e}"))
        if decode and self.trace_file is not None:
            self._write_trace()
        self._refresh_stats(res)
        if decode:
            self._maybe_log()
        self._flush()

    def _emit(self, lv: LiveRequest, new: list[int], fin: Any, token_lp: Any = None,
              checked: tuple[IncrementalText, str] | None = None) -> None:
        """Append ``new`` to ``lv``'s output and queue its chunk; ``fin``: the report's finish
        record of it, or None. ``checked``: the text state and delta the stop-string check
        computed on these tokens, when they hold (:meth:`StopCheck.text_for`). With
        ``stream_interval > 1`` a chunk may be held instead of sent (module docstring)."""
        hold = (fin is None and self.stream_interval > 1 and bool(lv.output)
                and len(new) + (0 if lv.held is None else len(lv.held.token_ids))
                < self.stream_interval)
        lv.output.extend(new)
        if checked is not None:
            lv.text, text = checked
        elif hold:
            text = ""  # detokenized with the chunk that sends these tokens
        else:
            shown = lv.output
            if (fin is not None and fin.reason == "stop" and fin.stop_token_id is not None
                    and not lv.spec.params.include_stop_str_in_output):
                shown = lv.output[:-1]  # the matched stop token's text is left out (vLLM, SGLang)
            text = lv.text.update(shown, final=fin is not None)
        if fin is None:
            self._send(lv, lv.chunk(text, new, False, None, token_lp, meta=not hold), hold)
            return
        del self.live[lv.rid]
        lv.cached_tokens = int(fin.cached_tokens)
        reason = grammar_end_error(lv.spec, lv.grammar, fin, lv.text.matched,
                                   self.worker.target.config.vocab_size)
        self._send(lv, lv.chunk(text, new, True, reason or finished(lv.text.matched, fin),
                                token_lp))

    def _send(self, lv: LiveRequest, chunk: Any, hold: bool = False) -> None:
        """Queue ``chunk`` for ``lv``'s sink joined after what it holds, or hold it."""
        if lv.held is not None:
            chunk, lv.held = join_chunks(lv.held, chunk), None
        if hold:
            lv.held = chunk
        else:
            self._out(lv.spec.sink, chunk)

    def _finish_now(self, rid: int, reason: dict[str, Any]) -> None:
        """End a live request now (between iterations): free everything, final chunk with
        ``reason`` (:mod:`specdial.engine.ends`: aborted, shut down or failed)."""
        self.sched.abort(rid)
        self._end_aborted(rid, reason)

    def _end_aborted(self, rid: int, reason: dict[str, Any]) -> None:
        """Send a request the scheduler no longer holds its final chunk with ``reason`` and
        forget it (the one place an aborted or failed request leaves :attr:`live`)."""
        lv = self.live.pop(rid)
        self._stats_stale = True
        self._sampling_key = None
        # held tokens (stream_interval) go out with it, with the text they would have shown
        text = "" if lv.held is None else lv.text.update(lv.output, final=False)
        self._send(lv, lv.chunk(text, [], True, reason, None))

    # ------------------------------------------------------------------ outputs
    def _out(self, sink: Callable[[Any], None], item: Any) -> None:
        self._outbox.append((sink, item))

    def _flush(self) -> None:
        out, self._outbox = self._outbox, []
        with burst():  # one wake per consumer event loop for the whole batch of items
            for sink, item in out:
                try:
                    sink(item)
                except Exception:  # noqa: BLE001 - a broken consumer must not stop the loop
                    logger.exception("delivering a result failed")

    def _write_trace(self) -> None:
        text = self.sched.drain_trace()
        if text:
            self.trace_file.write(text if text.endswith("\n") else text + "\n")
            self.trace_file.flush()

    def _refresh_stats(self, res: Any = None) -> None:
        """Renew the stats snapshot from ``res`` (a ``ReportResult``: the stats and slot states
        after it), or from the scheduler when there is none or a request finished since: its
        inputs only, which :meth:`stats` turns into the :class:`EngineStats` when asked (about
        0.08 ms per iteration at batch 1 saved on this loop; BENCHMARKS.md, "Issue 29 at batch
        1: why the adaptive depth moves from run to run")."""
        if res is None or self._stats_stale:
            s, slot_states = self.sched.stats(), self.sched.slot_states()
        else:
            s, slot_states = res.stats, res.slot_states
        self._stats_stale = False
        self._unfinished = s.running + s.prefilling + s.queued
        # the snapshot's inputs only (``s`` and ``slot_states`` are the report's frozen
        # objects, the histograms copied); stats() builds the EngineStats when asked
        self._stats = ((s, slot_states), dict(
            fixed_steps=self._fixed_steps, prompt_tokens=self._prompt_tokens,
            policy=self._policy, last_decode=self._last_decode, goodput=self._goodput_state(),
            verify_lengths=self._verify_lengths.snapshot(),
            tree_nodes=self._tree_nodes.snapshot()))

    def _goodput_state(self) -> dict[str, Any] | None:
        """The goodput strategy's state, rebuilt at most every POLICY_REFRESH_S seconds while
        requests run, and whenever the engine is idle (so the last decision is never lost)."""
        now = time.monotonic()
        if now - self._goodput_at >= POLICY_REFRESH_S or not self._unfinished:
            self._goodput, self._goodput_at = self.sched.goodput_state(), now
        return self._goodput

    def _mark(self) -> tuple[float, int, int, int]:
        return (time.monotonic(), self.stats().generation_tokens, self._verify_reqs,
                self._verify_tokens)

    def _maybe_log(self) -> None:
        interval = self.log_interval_s
        t0, tok0, req0, vt0 = self._log_mark
        now = time.monotonic()
        if not interval or interval <= 0 or now - t0 < interval:
            return
        st = self.stats()
        log_progress(st, now - t0, st.generation_tokens - tok0,
                     self._verify_reqs - req0, self._verify_tokens - vt0)
        self._log_mark = self._mark()
