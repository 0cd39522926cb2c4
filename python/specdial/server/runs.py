"""The engine requests of one HTTP request, and their delivery.

- :class:`Job`: one engine request (prompt, sampling parameters, stops, logprob options) of an
  HTTP request; :class:`Choice`: what it produced so far.
- :class:`Run`: the jobs of one HTTP request, run concurrently (one pump task per job) and
  merged into one queue of :class:`~specdial.engine.api.StreamChunk` s in arrival order; it
  keeps the choices and the latency metrics up to date and aborts its engine requests when
  closed.
- :func:`watch_disconnect` (non-streaming responses) and :class:`RunStreamingResponse`
  (streaming ones): a client that goes away aborts its run.

Used by the OpenAI routes (:mod:`specdial.server.openai_api`) and SGLang's ``/generate``
(:mod:`specdial.server.sglang_api`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specdial.engine.api import LogprobOptions, StreamChunk, stream_takes
from specdial.engine.ends import aborted, end_kind, is_failure, shut_down
from specdial.server.metrics import ServerMetrics

__all__ = ["DONE", "Choice", "ClientGone", "Job", "Run", "RunStreamingResponse",
           "watch_disconnect"]

logger = logging.getLogger("specdial.server")

#: The last server-sent event of every stream (OpenAI's and SGLang's).
DONE = "data: [DONE]\n\n"
_END = object()  # a pump finished its stream
_CLOSED = object()  # the run was closed (client gone)
_BACKGROUND: set[asyncio.Task[Any]] = set()  # strong references to pump tasks


@dataclass
class Job:
    """One engine request of an HTTP request: ``index`` its choice index in the response,
    ``prompt`` (text; only without a tokenizer) or ``input_ids``, the engine's
    ``sampling_params`` (``max_new_tokens`` included), ``stop`` strings and ``logprobs``."""

    index: int
    prompt: str | None
    input_ids: list[int] | None
    sampling_params: dict[str, Any]
    stop: list[str] | None
    logprobs: LogprobOptions | None = None
    counts_prompt: bool = True  # the first choice of its prompt (usage counts prompts once)
    echo: str | None = None  # prompt text prepended to the choice's text
    #: the index of the choice whose prompt logprobs this one reports (the same prompt's
    #: choice 0; its own engine request computes none: :func:`~specdial.server.jobs.choices`)
    prompt_logprobs_from: int | None = None


@dataclass
class Choice:
    """What one :class:`Job` produced so far: text parts, token ids, logprobs, finish reason
    (a :mod:`specdial.engine.ends` dict), ``meta`` (the engine's latest ``meta_info``) and the
    first/last token times (seconds since the request's arrival)."""

    index: int
    parts: list[str] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    first_token_s: float | None = None
    last_token_s: float | None = None
    completion_tokens: int = 0
    done: bool = False
    token_ids: list[int] = field(default_factory=list)  # every emitted token
    # with logprobs: each token's logprob and top alternatives; the prompt's
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[Any] | None = None

    @property
    def reason(self) -> str | None:
        """The finish reason's ``type`` (``stop``, ``length``, ``abort``, ``error``) or None."""
        return None if self.finish_reason is None else str(self.finish_reason.get("type"))


class ClientGone(Exception):
    """Raised by :meth:`Run.wait_started` and :meth:`Run.events` once the run was closed (the
    client went away): nobody reads the answer any more."""


class Run:
    """The engine requests of one HTTP request: one pump task per job, merged into a queue.

    ``engine`` (an :class:`~specdial.engine.api.EngineProtocol`) runs the jobs, ``metrics``
    observes their latencies, ``registry`` (the server's open runs) holds the run from
    :meth:`start` to :meth:`close` / :meth:`abort`; ``arrival`` is the request's
    ``time.perf_counter()`` and ``rid`` its id in log lines (default: a new one).

    ``whole``: the response is sent only when every job ended (not streamed), so the jobs ask
    the engine for their chunks at the end (``async_stream(whole=True)``): one wake-up of this
    event loop per job instead of one per decode iteration, and with replica processes one
    message per job instead of one per iteration through the router. The latencies are then
    taken at each chunk's ``emitted_s`` (when the engine emitted it), not at its arrival, so
    the time-to-first-token and inter-token histograms read as for a stream.

    Cancelling a pump task (``close``) cancels its ``await stream.__anext__()``, which aborts the
    engine request (the :mod:`specdial.engine.api` contract); the pump then also calls
    ``aclose()``.
    """

    def __init__(self, engine: Any, metrics: ServerMetrics, registry: set[Run],
                 jobs: list[Job], arrival: float, rid: str | None = None,
                 whole: bool = False) -> None:
        self.engine, self.metrics, self.registry = engine, metrics, registry
        self.jobs, self.arrival, self.whole = jobs, arrival, whole
        self.rid = rid or uuid.uuid4().hex  # the request id of the log lines
        #: each job's request id as the client knows it (``/generate``'s ``rid``), or None
        self.job_rids: list[str] | None = None
        self._settled: set[int] = set()  # jobs whose last chunk is queued (or aborted)
        #: each job's engine request id, once known (``on_submitted``, else its first chunk)
        self._engine_ids: dict[int, int] = {}
        #: jobs /abort_request asked the engine to end, with the finish reason's message
        self._abort_messages: dict[int, str] = {}
        self._on_submitted = stream_takes(engine, "on_submitted")  # specdial.Engine does
        self.choices = [Choice(j.index) for j in jobs]
        self.queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False
        self.complete = False  # every choice delivered its last chunk to the consumer
        self._ended = 0
        self._buffer: list[tuple[int, Any]] = []  # read by wait_started, replayed by events
        # a queue entry (an error, the close marker) held back until a batch was yielded
        self._held: tuple[int, Any, BaseException | None] | None = None

    def start(self) -> None:
        """Register the run and start one pump task per job (each submits its request)."""
        self.registry.add(self)
        for job in self.jobs:
            task = asyncio.create_task(self._pump(job))
            _BACKGROUND.add(task)
            task.add_done_callback(_BACKGROUND.discard)
            self.tasks.append(task)

    async def _pump(self, job: Job) -> None:
        stream: Any = None
        try:
            extra: dict[str, Any] = {} if job.logprobs is None else {"logprobs": job.logprobs}
            if self.whole:
                extra["whole"] = True
            if self._on_submitted:
                extra["on_submitted"] = lambda rid: self._engine_ids.setdefault(job.index, rid)
            stream = self.engine.async_stream(
                prompt=job.prompt, input_ids=job.input_ids,
                sampling_params=job.sampling_params, stop=job.stop, **extra)
            async for chunk in stream:
                self._engine_ids.setdefault(job.index, chunk.request_id)
                if chunk.finished:
                    chunk = self._as_requested(job.index, chunk)
                self.queue.put_nowait((job.index, chunk, None))
                if chunk.finished:
                    self._settled.add(job.index)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            self.queue.put_nowait((job.index, None, e))
            return
        finally:
            aclose = getattr(stream, "aclose", None)  # None when async_stream() raised
            if aclose is not None:
                await aclose()
        self.queue.put_nowait((job.index, _END, None))

    def close(self) -> None:
        """Cancel every pump still running (aborting its engine request); idempotent and
        synchronous, so it is safe in ``finally`` blocks of cancelled tasks."""
        if self.closed:
            return
        self.closed = True
        self.registry.discard(self)
        for task in self.tasks:
            task.cancel()
        self.queue.put_nowait((-1, _CLOSED, None))

    def abort(self, message: str) -> None:
        """Cancel the pumps still running (aborting their engine requests) and finish their
        choices with ``finish_reason`` ``abort``; the consumer then ends normally."""
        if self.closed:
            return
        self.closed = True
        self.registry.discard(self)
        for job, task in zip(self.jobs, self.tasks):
            if not task.done():
                task.cancel()
                final = StreamChunk(-1, "", [], True, shut_down(message))
                self.queue.put_nowait((job.index, final, None))
                self.queue.put_nowait((job.index, _END, None))

    def abort_jobs(self, rids: set[str] | None, message: str) -> int:
        """SGLang's ``/abort_request``: end the jobs whose client request id
        (:attr:`job_rids`) is in ``rids`` (None: every job) and still runs, with SGLang's
        abort finish reason (:func:`~specdial.engine.ends.aborted`, ``message``), while the
        run's other jobs go on. Returns how many it ended.

        A job whose engine request id is known (the engine's ``on_submitted``, or its first
        chunk) is ended by ``engine.abort(id)``: the engine frees its KV pages and ends its
        stream with everything generated until then (text, tokens, logprobs, ``meta_info``
        counts), as SGLang answers an aborted request. One without (still queued before the
        engine said its id) has generated nothing: its pump is cancelled (aborting its engine
        request) and it ends with an empty abort chunk."""
        n = 0
        for i, (job, task) in enumerate(zip(self.jobs, self.tasks)):
            if task.done() or job.index in self._settled or job.index in self._abort_messages or (
                    rids is not None and (self.job_rids is None or self.job_rids[i] not in rids)):
                continue
            n += 1
            engine_id = self._engine_ids.get(job.index)
            if engine_id is not None:
                self._abort_messages[job.index] = message
                self.engine.abort(engine_id)
                continue
            self._settled.add(job.index)
            task.cancel()
            self.queue.put_nowait((job.index, StreamChunk(-1, "", [], True, aborted(message)),
                                   None))
            self.queue.put_nowait((job.index, _END, None))
        return n

    def _as_requested(self, index: int, chunk: StreamChunk) -> StreamChunk:
        """The last ``chunk`` of job ``index``, its abort finish reason carrying the message
        of the ``/abort_request`` that ended it (the engine's says only "aborted by
        request")."""
        message = self._abort_messages.get(index)
        if message is None or end_kind(chunk.finish_reason) != "aborted":
            return chunk
        return dataclasses.replace(chunk, finish_reason=aborted(message))

    async def _next(self, buffered: bool = True) -> tuple[int, Any]:
        if buffered and self._buffer:
            return self._buffer.pop(0)
        if self._held is not None:
            entry, self._held = self._held, None
            return self._check(*entry)
        return self._check(*await self.queue.get())

    def _check(self, i: int, item: Any, err: BaseException | None) -> tuple[int, Any]:
        """A queue entry as ``(choice, item)``; raises ``ClientGone`` for the close marker and
        a pump's error (after closing the run)."""
        if item is _CLOSED:
            raise ClientGone
        if err is not None:
            self.close()
            raise err
        return i, item

    async def wait_started(self) -> None:
        """Wait until every engine request delivered its first chunk (or finished). Raises the
        first submission error (:class:`QueueFullError`, :class:`RequestError`, ...) after
        closing the run, or ``ClientGone``."""
        started: set[int] = set()
        while len(started) < len(self.jobs):
            i, item = await self._next(buffered=False)
            started.add(i)
            self._buffer.append((i, item))

    async def events(self) -> AsyncIterator[tuple[Choice, StreamChunk]]:
        """Every chunk, in arrival order, after updating its choice and the metrics."""
        async for batch in self.batches():
            for pair in batch:
                yield pair

    async def batches(self) -> AsyncIterator[list[tuple[Choice, StreamChunk]]]:
        """Every chunk as :meth:`events` gives them, grouped by wake-up: each list holds the
        chunks that had arrived when this consumer resumed (the first one awaited, the others
        already queued, in arrival order), each accounted (its choice and the metrics updated)
        before the list is yielded. A streaming response writes each list as one batch of
        server-sent events (:func:`specdial.server.openai_responses.sse_events`), so a
        response that fell behind its engine requests catches up in one write, as vLLM's
        output collector and SGLang's ``stream_interval`` batch a stream's tokens. A pump's
        error is raised after the chunks that arrived before it were yielded."""
        while self._ended < len(self.jobs):
            batch: list[tuple[Choice, StreamChunk]] = []
            i, item = await self._next()
            while True:
                if item is _END:
                    self._ended += 1
                else:
                    batch.append((self._account(self.choices[i], item), item))
                if self._buffer:
                    i, item = self._buffer.pop(0)
                    continue
                if self.queue.empty():
                    break
                entry = self.queue.get_nowait()
                if batch and (entry[2] is not None or entry[1] is _CLOSED):
                    self._held = entry  # raised by the next _next, after this batch
                    break
                i, item = self._check(*entry)
            if batch:
                yield batch
        self.complete = True

    def _account(self, c: Choice, chunk: StreamChunk) -> Choice:
        made = chunk.emitted_s if chunk.emitted_s is not None else time.perf_counter()
        now = made - self.arrival
        if chunk.text:
            c.parts.append(chunk.text)
        if chunk.token_ids:
            c.completion_tokens += len(chunk.token_ids)
            if c.first_token_s is None:
                c.first_token_s = now
                self.metrics.observe_first_token(now)
            else:
                assert c.last_token_s is not None
                self.metrics.observe_inter_token(now - c.last_token_s)
            c.last_token_s = now
        c.token_ids += chunk.token_ids
        if chunk.logprobs is not None:
            c.logprobs += chunk.logprobs
            c.top_logprobs += chunk.top_logprobs or [[] for _ in chunk.token_ids]
        if chunk.prompt_logprobs is not None:
            c.prompt_logprobs = chunk.prompt_logprobs
            c.prompt_top_logprobs = chunk.prompt_top_logprobs
        if chunk.meta_info and "queue_time_s" in chunk.meta_info and "queue_time_s" not in c.meta:
            self.metrics.observe_queue_time(float(chunk.meta_info["queue_time_s"]))
        if chunk.meta_info:
            c.meta = chunk.meta_info
            c.completion_tokens = int(chunk.meta_info.get("completion_tokens",
                                                          c.completion_tokens))
        if chunk.finished and not c.done:
            c.done, c.finish_reason = True, chunk.finish_reason
            self.metrics.observe_finished(
                reason=c.reason or "unknown", e2e_s=now, first_token_s=c.first_token_s,
                completion_tokens=c.completion_tokens)
        return c

    def failure(self) -> dict[str, Any] | None:
        """The finish reason of the first failed choice (:mod:`specdial.engine.ends`), or
        None."""
        return next((c.finish_reason for c in self.choices if is_failure(c.finish_reason)),
                    None)

    def usage(self) -> dict[str, Any]:
        """OpenAI's ``usage``: prompt tokens counted once per prompt, completion tokens summed
        over the choices, and ``prompt_tokens_details.cached_tokens``: the prompt tokens the
        engine's prefix cache served (the ``meta_info`` ``cached_tokens`` of the same choices
        whose prompt tokens are counted, so it never exceeds ``prompt_tokens``; 0 when the
        engine reports none). OpenAI's API always sends ``prompt_tokens_details``; vLLM and
        SGLang send it behind a flag (``--enable-prompt-tokens-details``,
        ``--enable-cache-report``); specdial always does, as OpenAI."""
        counted = [c for c, j in zip(self.choices, self.jobs) if j.counts_prompt]
        prompt = sum(int(c.meta.get("prompt_tokens", 0)) for c in counted)
        cached = sum(int(c.meta.get("cached_tokens", 0) or 0) for c in counted)
        completion = sum(c.completion_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


async def watch_disconnect(request: Request, run: Run) -> None:
    """Close ``run`` when the client disconnects (for the time a response is not streaming)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            logger.info("request %s: the client disconnected; aborting it", run.rid)
            run.close()
            return


class RunStreamingResponse(StreamingResponse):
    """A streaming response that closes its run whatever happens (client gone before the body
    started, cancellation at a ``yield``, normal end)."""

    def __init__(self, content: AsyncIterator[str], run: Run) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not (self._run.closed or self._run.complete):
                logger.info("request %s: the client disconnected during the stream; aborting "
                            "it", self._run.rid)
            self._run.close()
