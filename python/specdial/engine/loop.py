"""The engine loop: one background thread that owns the Rust scheduler and the worker.

Every :class:`specdial._core.Scheduler` call happens on this thread. Other threads talk to it
through :meth:`EngineLoop.post` (a FIFO inbox of typed messages: :class:`Submit`,
:class:`Cancel`, :class:`Abort`, :class:`Shutdown`) and get their results through each request's
*sink* (a callable the loop calls, from its thread, with :class:`Submitted`, an exception, or a
:class:`~specdial.engine.api.StreamChunk`). Each turn of the loop:

1. handles the inbox: submissions (``add_request``; the sink gets ``Submitted(id)``, or
   :class:`~specdial.engine.api.RequestError` / :class:`~specdial.engine.api.QueueFullError`),
   aborts, cancellations of streams, shutdown; it blocks there while nothing is live;
2. runs one iteration (:meth:`EngineLoop.step`): ``plan = schedule()`` ->
   ``worker.prefill/decode(plan)`` -> ``report(...)`` (the plan carries each request's worker
   row, which the scheduler assigns at admission and frees at finish / abort / preemption); a
   decode iteration is timed from just before ``schedule()`` to just after the passes return (the worker's one host sync)
   and reported as ``seconds``, which the adaptive policy's cost model learns from;
3. post-processes the report: appends tokens, detokenizes, matches stop strings (finishing the
   request through ``finish_request``), appends the per-verify trace (``record_trace``),
   refreshes the :class:`EngineStats` snapshot (from the stats the report returned, unless a
   stop string finished a request since), logs every
   ``log_interval_s`` while decoding, and only then hands the chunks to the sinks (so a caller
   that saw its last chunk sees the freed pages in ``stats()``).

A steady decode iteration makes two scheduler calls: ``schedule()`` and ``report()``.

An exception while running a plan fails the plan's requests (``abandon_plan()`` aborts them;
finish reason ``error`` with the message, :mod:`specdial.engine.ends`), is logged with its
traceback, and the loop keeps serving. A request whose sampling options cannot be built into
its batch fails alone (:mod:`specdial.engine.isolation`); nothing a request carries stops the
loop. Aborts and stop-string finishes happen between iterations, never while a plan is in
flight (except a request failed alone while its batch is built).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from specdial._core import InvalidRequestError, QueueFullError
from specdial.detokenize import IncrementalText
from specdial.engine.api import (POLICY_REFRESH_S, EngineStats, LogprobOptions, RequestError,
                                 StreamChunk)
from specdial.engine.ends import aborted, failed, shut_down
from specdial.engine.isolation import sampling_isolated
from specdial.worker.logprobs import HostLogprobs, LogprobRows, PromptLogprobPlan
from specdial.worker.sampling import BatchSampling, SamplingParams
from specdial.worker.worker import SpecWorker, StepOutput

logger = logging.getLogger("specdial.engine")

StepsSchedule = Callable[[int, int], int] | Sequence[int]


@dataclass(frozen=True)
class Submitted:
    """First sink item of an accepted request: its engine id."""

    request_id: int


@dataclass(eq=False)
class RequestSpec:
    """A validated request on its way to the loop. ``stop_token_ids`` includes the EOS ids
    unless ``ignore_eos``. ``rid`` is set by the loop when the scheduler accepts it.
    ``logprobs``: the log-probabilities it wants (None: none). ``min_tokens_ids``: the token
    ids masked while the output is shorter than ``params.min_tokens`` (EOS and stop token ids
    inside the vocabulary; empty without ``min_tokens``)."""

    prompt_ids: list[int]
    params: SamplingParams
    stop_token_ids: tuple[int, ...]
    stop: tuple[str, ...]
    sink: Callable[[Any], None]
    rid: int | None = None
    logprobs: LogprobOptions | None = None
    min_tokens_ids: tuple[int, ...] = ()


@dataclass(frozen=True, eq=False)
class Submit:
    """Loop message: add these requests (each spec's sink gets ``Submitted`` or an error)."""

    specs: list[RequestSpec]


@dataclass(frozen=True, eq=False)
class Cancel:
    """Loop message: the consumer of this request's stream went away; abort it if live."""

    spec: RequestSpec


@dataclass(frozen=True)
class Abort:
    """Loop message: abort the request with this engine id if live."""

    request_id: int


@dataclass(frozen=True)
class Shutdown:
    """Loop message: stop; ``drain`` finishes the live requests first, else aborts them."""

    drain: bool


@dataclass(frozen=True)
class Crash:
    """Loop message (a test hook): stop the loop as if it had failed with ``message``; every
    live request fails, later submissions are refused and the engine reports the failure."""

    message: str


#: What :meth:`EngineLoop.post` takes.
Message = Submit | Cancel | Abort | Shutdown | Crash


@dataclass(eq=False)
class _Live:
    spec: RequestSpec
    rid: int
    text: IncrementalText
    output: list[int] = field(default_factory=list)
    verify_ct: int = 0
    # verifies that carried drafts (steps > 0) and the tokens they emitted: the acceptance length
    draft_verify_ct: int = 0
    draft_verify_tokens: int = 0
    hist: dict[int, int] = field(default_factory=dict)
    submitted: float = field(default_factory=time.perf_counter)
    queue_time: float | None = None
    # prompt logprobs (LogprobOptions.prompt_start): per prompt position, filled by prefill
    prompt_lp: np.ndarray | None = None
    prompt_top: tuple[np.ndarray, np.ndarray] | None = None
    prompt_done: bool = False
    prompt_sent: bool = False

    def meta(self) -> dict[str, Any]:
        n = len(self.output)
        meta = {"prompt_tokens": len(self.spec.prompt_ids), "completion_tokens": n,
                "spec_verify_ct": self.verify_ct,
                "spec_accept_length": self.accept_length(),
                "spec_steps_histogram": dict(sorted(self.hist.items()))}
        if self.queue_time is not None:
            meta["queue_time_s"] = self.queue_time
        return meta

    def accept_length(self) -> float:
        """Acceptance length: tokens emitted per verify that carried drafts (accepted drafts + 1,
        the bonus token included; DESIGN.md's definition, vLLM's mean acceptance length); trivial
        verifies at steps 0 are plain decodes and are left out. Without any drafting verify:
        ``(completion_tokens - 1) / spec_verify_ct`` (1.0 for plain decoding), 0.0 without
        verifies."""
        if self.draft_verify_ct:
            return self.draft_verify_tokens / self.draft_verify_ct
        return (len(self.output) - 1) / self.verify_ct if self.verify_ct else 0.0

    def top_n(self) -> int | None:
        """The logprob rows entry of this request (None: no logprobs)."""
        return None if self.spec.logprobs is None else self.spec.logprobs.top_n

    def wants_prompt(self) -> bool:
        lp = self.spec.logprobs
        return lp is not None and lp.prompt_start is not None and not self.prompt_done

    def prompt_chunk(self) -> tuple[list[float | None], list[Any]] | None:
        """Prompt logprobs (and top alternatives) to send with the first chunk, once."""
        lp = self.spec.logprobs
        if lp is None or lp.prompt_start is None or self.prompt_sent or self.prompt_lp is None:
            return None
        self.prompt_sent = True
        start = lp.prompt_start
        values: list[float | None] = self.prompt_lp[start:].tolist()
        assert self.prompt_top is not None
        ids, top = self.prompt_top[0][start:].tolist(), self.prompt_top[1][start:].tolist()
        tops: list[Any] = [list(zip(i, t)) for i, t in zip(ids, top)]
        if start == 0:  # the first prompt token has no context: no logprob
            values[0], tops[0] = None, None
        return values, tops


def _goodput_summary(g: dict[str, Any] | None) -> str:
    """The goodput strategy's part of the log line ("" without it)."""
    if not g or not g.get("last_decision"):
        return ""
    d = g["last_decision"]
    ms = ", ".join(f"{k}: {1e3 * t:.1f}" for k, t in sorted(d["predicted_seconds"].items()))
    acc = ", ".join(f"{a:.2f}" for a in g["acceptance"][:8])
    return (f"; goodput at batch {d['batch_size']}: predicted ms per steps {{{ms}}}, "
            f"acceptance per position [{acc}], {g['probes']} probes")


def _param_of(message: str) -> str | None:
    """The field an InvalidRequestError / SamplingParams message starts with."""
    head = message.split(":", 1)[0].strip()
    head = head.removeprefix("SamplingParams.").split()[0] if head else ""
    return head or None


class EngineLoop:
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
                 trace_file: Any = None, log_interval_s: float | None) -> None:
        self.sched, self.worker, self.tokenizer = scheduler, worker, tokenizer
        self.generator, self.steps_schedule = generator, steps_schedule
        self.trace_file, self.log_interval_s = trace_file, log_interval_s
        self.device = worker.device
        # torch's intra-op thread count is per OS thread (OpenMP): without this the loop thread
        # would run with the default and be many times slower than the caller configured
        self._num_threads = torch.get_num_threads()
        self.inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.live: dict[int, _Live] = {}
        self.dead: BaseException | None = None
        self._stopping = self._drain = False
        self._outbox: list[tuple[Callable[[Any], None], Any]] = []
        self._sampling_key: tuple[int, ...] | None = None
        self._sampling: BatchSampling | None = None
        self._lp_rows: LogprobRows | None = None
        self._last_decode: tuple[int, int] | None = None  # (steps, padded batch size)
        self._decode_iters = 0
        self._prompt_tokens = 0
        self._verify_reqs = self._verify_tokens = 0
        self._log_mark = (time.monotonic(), 0, 0, 0)
        self._stats = EngineStats()
        self._goodput: dict[str, Any] | None = None
        self._goodput_at = -POLICY_REFRESH_S
        # read once: only this loop changes them (set_fixed_steps), and the strategy never
        self._policy = scheduler.policy_strategy
        self._fixed_steps = scheduler.fixed_steps
        self._unfinished = 0  # live requests in the scheduler, from the latest stats
        self._stats_stale = False  # a request finished after the report's stats
        self._refresh_stats()  # before the thread starts: no concurrent scheduler call
        self.thread = threading.Thread(target=self._main, name="specdial-engine", daemon=True)

    # ------------------------------------------------------------------ other threads
    def start(self) -> None:
        self.thread.start()

    def post(self, message: Message) -> None:
        """Queue a :class:`Submit`, :class:`Cancel`, :class:`Abort` or :class:`Shutdown` for
        the loop (FIFO; handled between iterations)."""
        self.inbox.put(message)

    def stats(self) -> EngineStats:
        """The latest snapshot (a copy; refreshed after every iteration and inbox turn)."""
        s = self._stats
        return dataclasses.replace(s, steps_per_slot=dict(s.steps_per_slot),
                                   accepted_per_pos=list(s.accepted_per_pos),
                                   slot_states=[dict(d) for d in s.slot_states])

    # ------------------------------------------------------------------ the loop
    def _main(self) -> None:
        torch.set_num_threads(self._num_threads)
        try:
            with torch.inference_mode():
                while True:
                    busy = self._unfinished > 0
                    if not busy and self._stopping:
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
            self._flush()
            self._answer_until_shutdown(e)
        finally:
            if self.trace_file is not None:
                self._write_trace()
                self.trace_file.close()

    def _answer_until_shutdown(self, error: BaseException) -> None:
        while True:
            match self.inbox.get():
                case Submit(specs):
                    for spec in specs:
                        spec.sink(RuntimeError(f"the engine loop failed: {error}"))
                case Shutdown():
                    return
                case _:
                    pass

    def _handle_inbox(self, block: bool) -> None:
        messages = [self.inbox.get()] if block else []
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for message in messages:
            match message:
                case Submit(specs):
                    for spec in specs:
                        self._submit(spec)
                case Cancel(spec):
                    if spec.rid is not None and spec.rid in self.live:
                        self._finish_now(spec.rid, aborted("aborted: the client stopped reading"))
                case Abort(rid):
                    if rid in self.live:
                        self._finish_now(rid, aborted("aborted by request"))
                case Shutdown(drain):
                    self._stopping, self._drain = True, bool(drain)
                    if not self._drain:
                        for rid in list(self.live):
                            self._finish_now(rid, shut_down("aborted: the engine is shutting "
                                                            "down"))
                case Crash(text):
                    raise RuntimeError(text)
                case _:
                    raise TypeError(f"unknown engine loop message {message!r}")
        if messages:
            self._refresh_stats()
            self._flush()

    def _submit(self, spec: RequestSpec) -> None:
        if self._stopping:
            self._out(spec.sink, RuntimeError("Engine is shut down"))
            return
        try:
            rid = self.sched.add_request(np.asarray(spec.prompt_ids, np.int64),
                                         spec.params.max_new_tokens, list(spec.stop_token_ids),
                                         True)  # EOS ids are in stop_token_ids
        except InvalidRequestError as e:
            self._out(spec.sink, RequestError(str(e), _param_of(str(e))))
            return
        except QueueFullError as e:
            self._out(spec.sink, e)
            return
        except Exception as e:  # noqa: BLE001 - no request may stop the loop
            self._out(spec.sink, RequestError(f"the scheduler refused the request: "
                                              f"{type(e).__name__}: {e}"))
            return
        spec.rid = rid
        p = spec.params
        self.live[rid] = _Live(spec, rid, IncrementalText(
            self.tokenizer, spec.stop, skip_special_tokens=p.skip_special_tokens,
            include_stop=p.include_stop_str_in_output, min_tokens=p.min_tokens))
        self._prompt_tokens += len(spec.prompt_ids)
        self._out(spec.sink, Submitted(rid))

    def step(self) -> None:
        """One iteration: ``schedule()`` -> the worker's passes -> ``report()`` ->
        post-processing (chunks to the sinks). A failed pass abandons the plan."""
        self._apply_steps_schedule()
        started = time.perf_counter()  # a decode iteration's seconds: schedule -> passes done
        plan = self.sched.schedule()
        if plan is None:  # live requests but nothing to run now (not expected)
            logger.warning("nothing schedulable with %d live requests", len(self.live))
            time.sleep(0.01)
            return
        rids = plan.request_ids.tolist()
        try:
            if plan.is_prefill:
                out, res = self._run_prefill(plan, rids)
            else:
                out, res = self._run_decode(plan, rids, started)
        except Exception as e:  # noqa: BLE001 - fail these requests, keep serving
            logger.exception("a %s iteration failed; aborting its %d requests", plan.kind,
                             len(rids))
            self._fail_plan(plan, rids, e)
            return
        self._after_report(plan, rids, res, out.logprobs)

    def _apply_steps_schedule(self) -> None:
        """The test hook: fix the next decode iteration's steps from ``steps_schedule``."""
        if self.steps_schedule is not None:
            sched, i = self.steps_schedule, self._decode_iters
            k = sched(i, self.sched.num_running) if callable(sched) else sched[i % len(sched)]
            self.sched.set_fixed_steps(int(k))
            self._fixed_steps = int(k)

    def _run_prefill(self, plan: Any, rids: list[int]) -> tuple[StepOutput, Any]:
        """The prefill passes and their report: first tokens sampled for ``sample_first``
        requests, prompt logprobs stored where asked."""
        now = time.perf_counter()
        for rid in rids:
            lv = self.live[rid]
            if lv.queue_time is None:
                lv.queue_time = now - lv.submitted
        first_live = [self.live[r] for r, f in zip(rids, plan.sample_first.tolist()) if f]
        sampling = self._batch_sampling(first_live) if first_live else None
        lp_rows = LogprobRows.build([lv.top_n() for lv in first_live], self.device)
        prompt_plan, owners = self._prompt_plan(plan, rids)
        # while decoding runs steps 0 with the zero-step extend skipped, the drafter's prefill
        # waits for the catch-up too (nothing reads the drafter's KV before drafting resumes)
        lazy = (self.worker.skip_zero_step_draft_extend and self._last_decode is not None
                and self._last_decode[0] == 0)
        out = self.worker.prefill(plan, sampling, self.generator, lp_rows, prompt_plan,
                                  draft_prefill=not lazy)
        res = self.sched.report(out.tokens, out.offsets)
        self._store_prompt_logprobs(out.prompt_logprobs, owners)
        return out, res

    def _run_decode(self, plan: Any, rids: list[int], started: float
                    ) -> tuple[StepOutput, Any]:
        """The decode passes and their report, timed from ``started`` (before ``schedule()``)
        to the passes' end: the ``seconds`` the adaptive policy's cost model learns from."""
        sampling = self._sampling_for(rids)
        out = self.worker.decode(plan, sampling, self.generator, self._lp_rows)
        seconds = time.perf_counter() - started
        res = self.sched.report(out.tokens, out.offsets, out.accepted, seconds=seconds)
        self._decode_iters += 1
        self._last_decode = (int(plan.steps), int(plan.graph_bs or plan.batch_size))
        return out, res

    def _build_sampling(self, params: list[SamplingParams], prompt_lens: list[int],
                        min_tokens_ids: list[tuple[int, ...]]) -> BatchSampling:
        return BatchSampling.from_params(params, self.device, prompt_lens=prompt_lens,
                                         min_tokens_ids=min_tokens_ids)

    def _batch_sampling(self, live: list[_Live]) -> BatchSampling:
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
        return sampling

    def _sampling_for(self, rids: list[int]) -> BatchSampling:
        key = tuple(rids)
        if key != self._sampling_key or self._sampling is None:
            live = [self.live[r] for r in rids]
            self._sampling = self._batch_sampling(live)
            self._lp_rows = LogprobRows.build([lv.top_n() for lv in live], self.device)
            self._sampling_key = key
        return self._sampling

    def _prompt_plan(self, plan: Any, rids: list[int]
                     ) -> tuple[PromptLogprobPlan | None, list[tuple[_Live, int, int, int]]]:
        """Positions of this prefill chunk whose next prompt token's logprob is wanted:
        position ``p`` (of a chunk ``[s, e)``) predicts prompt token ``p + 1``; wanted for
        ``p + 1`` in ``max(prompt_start, 1)..P-1``. ``owners``: ``(live, first position,
        count, chunk end)`` per request, in the plan's order."""
        owners: list[tuple[_Live, int, int, int]] = []
        index, targets = [], []
        top = 0
        qo, ends = plan.qo_lens.tolist(), plan.kv_lens.tolist()
        base = 0
        for b, rid in enumerate(rids):
            lv = self.live.get(rid)
            s, e = ends[b] - qo[b], ends[b]
            if lv is not None and lv.wants_prompt():
                assert lv.spec.logprobs is not None and lv.spec.logprobs.prompt_start is not None
                prompt = lv.spec.prompt_ids
                lo = max(s, max(lv.spec.logprobs.prompt_start, 1) - 1)
                hi = min(e, len(prompt) - 1)
                if hi > lo:
                    index.append(np.arange(base + lo - s, base + hi - s))
                    targets.append(np.asarray(prompt[lo + 1:hi + 1], np.int64))
                    top = max(top, lv.spec.logprobs.top_n)
                owners.append((lv, lo, max(hi - lo, 0), e))
            base += qo[b]
        if not index:
            return None, owners
        return PromptLogprobPlan(np.concatenate(index), np.concatenate(targets), top), owners

    def _store_prompt_logprobs(self, host: HostLogprobs | None,
                               owners: list[tuple[_Live, int, int, int]]) -> None:
        off = 0
        for lv, lo, count, end in owners:
            prompt_len = len(lv.spec.prompt_ids)
            if lv.prompt_lp is None:
                assert lv.spec.logprobs is not None
                k = lv.spec.logprobs.top_n
                lv.prompt_lp = np.full(prompt_len, np.nan, np.float32)
                lv.prompt_top = (np.zeros((prompt_len, k), np.int64),
                                 np.zeros((prompt_len, k), np.float32))
            if count and host is not None:
                assert lv.prompt_top is not None
                k = lv.prompt_top[0].shape[1]
                lv.prompt_lp[lo + 1:lo + 1 + count] = host.logprob[0, off:off + count]
                lv.prompt_top[0][lo + 1:lo + 1 + count] = host.top_ids[0, off:off + count, :k]
                lv.prompt_top[1][lo + 1:lo + 1 + count] = host.top_logprob[0, off:off + count, :k]
                off += count
            lv.prompt_done = lv.prompt_done or end >= prompt_len

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
                      logprobs: HostLogprobs | None = None) -> None:
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
                self._emit(lv, new, fin, token_lp)
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

    def _chunk(self, lv: _Live, text: str, new: list[int], finished: bool,
               reason: dict[str, Any] | None, token_lp: Any) -> StreamChunk:
        chunk = StreamChunk(lv.rid, text, new, finished, reason, lv.meta())
        if lv.spec.logprobs is None:
            return chunk
        if token_lp is not None:
            values, ids, top = token_lp
            chunk.logprobs = values.tolist()
            chunk.top_logprobs = [list(zip(i, t)) for i, t in zip(ids.tolist(), top.tolist())]
        elif not new:
            chunk.logprobs, chunk.top_logprobs = [], []
        if new:
            prompt = lv.prompt_chunk()
            if prompt is not None:
                chunk.prompt_logprobs, chunk.prompt_top_logprobs = prompt
        return chunk

    def _emit(self, lv: _Live, new: list[int], fin: Any, token_lp: Any = None) -> None:
        lv.output.extend(new)
        shown = lv.output
        if (fin is not None and fin.reason == "stop" and fin.stop_token_id is not None
                and not lv.spec.params.include_stop_str_in_output):
            shown = lv.output[:-1]  # the matched stop token's text is left out (vLLM, SGLang)
        text = lv.text.update(shown, final=fin is not None)
        if lv.text.matched is not None and fin is None:
            fin = self.sched.finish_request(lv.rid, "stop")
            if fin is None:
                raise RuntimeError(f"request {lv.rid} is not live in the scheduler")
            self._stats_stale = True
        if fin is None:
            self._out(lv.spec.sink, self._chunk(lv, text, new, False, None, token_lp))
            return
        del self.live[lv.rid]
        if lv.text.matched is not None:
            reason: dict[str, Any] = {"type": "stop", "matched": lv.text.matched}
        elif fin.reason == "length":
            reason = {"type": "length", "length": int(fin.output_len)}
        elif fin.reason == "stop":
            reason = {"type": "stop", "matched": fin.stop_token_id}
        else:
            reason = {"type": "abort", "message": "aborted"}
        self._out(lv.spec.sink, self._chunk(lv, text, new, True, reason, token_lp))

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
        self._out(lv.spec.sink, self._chunk(lv, "", [], True, reason, None))

    # ------------------------------------------------------------------ outputs
    def _out(self, sink: Callable[[Any], None], item: Any) -> None:
        self._outbox.append((sink, item))

    def _flush(self) -> None:
        out, self._outbox = self._outbox, []
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
        """Rebuild the :class:`EngineStats` snapshot from ``res`` (a ``ReportResult``: the
        stats and slot states after it), or from the scheduler when there is none or a request
        finished since."""
        if res is None or self._stats_stale:
            s, slot_states = self.sched.stats(), self.sched.slot_states()
        else:
            s, slot_states = res.stats, res.slot_states
        self._stats_stale = False
        self._unfinished = s.running + s.prefilling + s.queued
        states = [{"lower_bound": int(lb), "steps": int(k), "ema_accept_len": float(ema),
                   "verify_count": int(n)} for lb, k, ema, n in slot_states]
        slots = {int(st["lower_bound"]): int(st["steps"]) for st in states}
        if not slots and self._fixed_steps is not None:
            slots = {1: int(self._fixed_steps)}
        self._stats = EngineStats(
            running=s.running + s.prefilling, queued=s.queued, kv_pages_used=s.kv_pages_used,
            kv_pages_total=s.kv_pages_total, steps_per_slot=slots, num_drafts=s.spec_num_drafts,
            draft_tokens_proposed=s.spec_num_draft_tokens,
            num_accepted_tokens=s.spec_num_accepted_tokens,
            accepted_per_pos=list(s.spec_accepted_per_pos), step_switches=s.step_switches,
            preemptions=s.preemptions, requests_finished=s.requests_finished,
            prompt_tokens=self._prompt_tokens, generation_tokens=s.tokens_generated,
            slot_states=states,
            last_decode_steps=None if self._last_decode is None else self._last_decode[0],
            last_decode_batch_size=None if self._last_decode is None else self._last_decode[1],
            policy=self._policy, goodput=self._goodput_state())

    def _goodput_state(self) -> dict[str, Any] | None:
        """The goodput strategy's state, rebuilt at most every POLICY_REFRESH_S seconds while
        requests run, and whenever the engine is idle (so the last decision is never lost)."""
        now = time.monotonic()
        if now - self._goodput_at >= POLICY_REFRESH_S or not self._unfinished:
            self._goodput, self._goodput_at = self.sched.goodput_state(), now
        return self._goodput

    def _mark(self) -> tuple[float, int, int, int]:
        return (time.monotonic(), self._stats.generation_tokens, self._verify_reqs,
                self._verify_tokens)

    def _maybe_log(self) -> None:
        interval = self.log_interval_s
        t0, tok0, req0, vt0 = self._log_mark
        now = time.monotonic()
        if not interval or interval <= 0 or now - t0 < interval:
            return
        s = self._stats
        reqs = self._verify_reqs - req0
        logger.info("running %d, queued %d, KV cache %.1f%% (%d/%d pages), %.1f tokens/s, "
                    "accept length %.2f, steps per slot %s%s", s.running, s.queued,
                    100.0 * s.kv_pages_used / max(s.kv_pages_total, 1), s.kv_pages_used,
                    s.kv_pages_total, (s.generation_tokens - tok0) / (now - t0),
                    (self._verify_tokens - vt0) / reqs if reqs else 0.0, s.steps_per_slot,
                    _goodput_summary(s.goodput))
        self._log_mark = self._mark()
