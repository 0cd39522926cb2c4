"""Drivers (what a benchmark sends requests to) and the run loop.

- :class:`EngineDriver`: an in-process engine (:mod:`specdial.engine.api`). With
  ``async_stream`` every request is its own stream and TTFT/TPOT/ITL are measured per chunk.
  An engine with only ``generate`` (the static-batch Engine of issue 3) is driven in batches:
  the requests that have arrived, up to the concurrency, go into one ``generate`` call; TTFT,
  TPOT and ITL then need streaming and are reported as None.
- :class:`HttpDriver` (in :mod:`specdial.bench.http_driver`, re-exported here): a running
  OpenAI-compatible server (``specdial serve``, or vLLM/SGLang): ``POST /v1/completions`` with ``stream: true`` and ``stream_options.include_usage`` (the
  completion token count comes from ``usage``), engine counters from ``GET /metrics``.

:func:`run_benchmark` sends the requests with a fixed concurrency (a semaphore) and/or Poisson
arrivals at a request rate (:func:`poisson_arrivals`, seeded), samples the engine's stats every
``sample_interval`` seconds while it runs, and shows a tqdm progress bar on stderr.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import random
import time
from typing import Any, Awaitable, Callable, Protocol, Sequence

from specdial.bench.datasets import BenchRequest
from specdial.bench.http_driver import HttpDriver, parse_prometheus, prometheus_snapshot
from specdial.bench.metrics import RequestRecord, RunData, snapshot

__all__ = ["Driver", "EngineDriver", "HttpDriver", "Runner", "parse_prometheus",
           "poisson_arrivals", "prometheus_snapshot", "run_benchmark"]

logger = logging.getLogger("specdial.bench")

Clock = Callable[[], float]
#: ``async runner(driver, requests, records, sampling_params, caps, clock, progress_bar)``:
#: sends ``requests`` and fills their ``records`` (caps: the concurrency, an int, a per-request
#: sequence or None).
Runner = Callable[..., Awaitable[None]]


def poisson_arrivals(n: int, request_rate: float | None, seed: int = 0) -> list[float]:
    """Arrival times (seconds from the start) of ``n`` requests of a Poisson process with
    ``request_rate`` requests/s: the first at 0, then exponential gaps of mean
    ``1 / request_rate``, drawn from ``random.Random(seed)`` (same seed, same times). None or
    ``inf`` means every request at 0."""
    if request_rate is None or math.isinf(request_rate):
        return [0.0] * n
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 requests/s, got {request_rate}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(request_rate)
    return times


class Driver(Protocol):
    """What :func:`run_benchmark` needs of a backend."""

    name: str
    #: True: :meth:`send` per request; False: :meth:`generate_batch`.
    streaming: bool

    def prepare(self, req: BenchRequest, max_new_tokens: int) -> BenchRequest | None:
        """The request to send (e.g. tokenized), or None when it cannot be served (too long
        for the context, no usable prompt field)."""
        ...

    async def start(self) -> None: ...

    async def stats(self) -> dict[str, Any] | None:
        """A :func:`specdial.bench.metrics.snapshot`-ready mapping, or None (no stats)."""
        ...

    async def send(self, req: BenchRequest, params: dict[str, Any], rec: RequestRecord,
                   clock: Clock) -> None:
        """Run one request to the end, filling ``rec`` (chunks, meta, success)."""
        ...

    def generate_batch(self, reqs: Sequence[BenchRequest],
                       params: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run ``reqs`` in one batch (``params``: one dict per request)."""
        ...

    async def close(self) -> None: ...


# ---------------------------------------------------------------------------- in-process
def _encode(tokenizer: Any, text: str) -> list[int]:
    enc = tokenizer.encode(text)
    return [int(t) for t in getattr(enc, "ids", enc)]


class EngineDriver:
    """An in-process engine (see the module docstring). Prompts are tokenized once, before the
    run, with ``engine.tokenizer`` (as the server does), and those longer than
    ``engine.context_length - max_new_tokens`` are dropped."""

    def __init__(self, engine: Any, name: str = "engine") -> None:
        self.engine, self.name = engine, name
        self.streaming = hasattr(engine, "async_stream")
        self._has_stats = callable(getattr(engine, "stats", None))

    def prepare(self, req: BenchRequest, max_new_tokens: int) -> BenchRequest | None:
        ids = req.input_ids
        if ids is None:
            tok = getattr(self.engine, "tokenizer", None)
            if tok is None or req.prompt is None:
                return None
            ids = tuple(_encode(tok, req.prompt))
        ctx = getattr(self.engine, "context_length", None)
        max_new_tokens = req.max_new_tokens or max_new_tokens
        if not ids or (ctx is not None and len(ids) + max_new_tokens > int(ctx)):
            return None
        return dataclasses.replace(req, input_ids=ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (the engine's tokenizer; ``ValueError`` without one)."""
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None:
            raise ValueError("this engine has no tokenizer")
        return _encode(tok, text)

    def fits(self, prompt_tokens: int, output_tokens: int) -> bool:
        """Whether a request of these lengths fits the engine's context."""
        ctx = getattr(self.engine, "context_length", None)
        return ctx is None or prompt_tokens + output_tokens <= int(ctx)

    async def start(self) -> None:
        return None

    async def flush_cache(self) -> bool:
        """Empty the engine's prefix cache (``Engine.flush_cache``, waiting until it is idle);
        False when the engine has none."""
        flush = getattr(self.engine, "flush_cache", None)
        if flush is None:
            return False
        while not await asyncio.to_thread(flush):
            await asyncio.sleep(0.01)
        return True

    async def stats(self) -> dict[str, Any] | None:
        if not self._has_stats:
            return None
        stats = await asyncio.to_thread(self.engine.stats)
        return snapshot(stats, 0.0)

    async def send(self, req: BenchRequest, params: dict[str, Any], rec: RequestRecord,
                   clock: Clock) -> None:
        stream = self.engine.async_stream(input_ids=list(req.input_ids or ()),
                                          sampling_params=dict(params))
        try:
            async for chunk in stream:
                now = clock()
                if chunk.token_ids:
                    rec.add_chunk(now, len(chunk.token_ids))
                    rec.output_ids += chunk.token_ids
                if chunk.meta_info:
                    rec.set_meta(chunk.meta_info)
                if chunk.finished:
                    reason = (chunk.finish_reason or {}).get("type")
                    rec.finish_reason, rec.end_time = reason, now
                    rec.success = reason not in ("abort", "error")
                    if not rec.success:
                        rec.error = str((chunk.finish_reason or {}).get("message", "aborted"))
                    break
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    def generate_batch(self, reqs: Sequence[BenchRequest],
                       params: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = self.engine.generate(input_ids=[list(r.input_ids or ()) for r in reqs],
                                   sampling_params=[dict(p) for p in params])
        return list(out)

    async def close(self) -> None:
        return None


# ---------------------------------------------------------------------------- the run loop
def _progress(total: int, desc: str, enabled: bool, leave: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, leave=leave,
                dynamic_ncols=True)


async def _sampler(driver: Driver, clock: Clock, interval: float, out: list[dict[str, Any]],
                   stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval)
        except asyncio.TimeoutError:
            pass
        if stop.is_set():
            return
        snap = await driver.stats()
        if snap is None:
            return
        out.append(snapshot(snap, clock()))


def ramp_concurrency(n: int, peak: int) -> list[int]:
    """A load ramp over ``n`` requests: request ``i`` may start only while fewer than
    ``1 + round((peak - 1) * sin(pi * i / (n - 1)))`` requests are in flight, so arrivals rise
    from one at a time to ``peak`` concurrent at the middle of the run and fall back to one."""
    if n < 1 or peak < 1:
        raise ValueError(f"a ramp needs n >= 1 and peak >= 1, got n={n}, peak={peak}")
    return [1 + round((peak - 1) * math.sin(math.pi * i / max(n - 1, 1))) for i in range(n)]


async def run_benchmark(driver: Driver, requests: Sequence[BenchRequest], *,
                        sampling_params: dict[str, Any], concurrency: int | None = None,
                        request_rate: float | None = None, seed: int = 0,
                        sample_interval: float = 0.25, progress: bool = True,
                        desc: str = "bench", leave: bool = True,
                        concurrency_schedule: Sequence[int] | None = None,
                        runner: Runner | None = None) -> RunData:
    """Send ``requests`` (already :meth:`Driver.prepare`-d) through ``driver`` and measure.

    ``concurrency``: most requests in flight (None = no limit); ``request_rate``: Poisson
    arrivals in requests/s (None = all at once), seeded with ``seed``; both may be given (the
    rate, capped by the concurrency). ``concurrency_schedule``: one cap per request (e.g.
    :func:`ramp_concurrency`): request ``i`` starts, in order, once fewer than
    ``concurrency_schedule[i]`` requests are in flight (replaces ``concurrency``). ``sampling_params`` go to every request (the engine's
    names: ``max_new_tokens``, ``temperature``, ``ignore_eos``). ``sample_interval``: seconds
    between stats snapshots. ``runner``: sends the requests instead of the default
    (a streaming driver's requests independently, else in batches), with the signature of
    :data:`Runner` (e.g. :func:`specdial.bench.multiturn.conversation_runner`, whose requests
    depend on earlier answers). Returns the :class:`~specdial.bench.metrics.RunData`
    (duration: start to the last finished request, seconds).
    """
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if concurrency_schedule is not None:
        if len(concurrency_schedule) != len(requests) or min(concurrency_schedule, default=1) < 1:
            raise ValueError("concurrency_schedule needs one cap >= 1 per request")
        caps: Sequence[int] | int | None = concurrency_schedule
    else:
        caps = concurrency
    arrivals = poisson_arrivals(len(requests), request_rate, seed)
    records = [RequestRecord(r.index, r.workload, arrival_time=a, prompt_tokens=r.prompt_tokens,
                             streamed=driver.streaming) for r, a in zip(requests, arrivals)]
    bar = _progress(len(requests), desc, progress, leave)
    timeline: list[dict[str, Any]] = []
    first = await driver.stats()
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    if first is not None:
        timeline.append(snapshot(first, 0.0))
    stop = asyncio.Event()
    sampler = (asyncio.create_task(_sampler(driver, clock, sample_interval, timeline, stop))
               if first is not None else None)
    try:
        if runner is not None:
            await runner(driver, requests, records, sampling_params, caps, clock, bar)
        elif driver.streaming:
            await _run_streaming(driver, requests, records, sampling_params, caps, clock, bar)
        else:
            await _run_batches(driver, requests, records, sampling_params, caps, clock, bar)
        duration = clock()
    finally:
        stop.set()
        if sampler is not None:
            await sampler
        bar.close()
    if first is not None:
        last = await driver.stats()
        if last is not None:
            timeline.append(snapshot(last, clock()))
    return RunData(records, duration, timeline, streaming=driver.streaming)


def _params_of(req: BenchRequest, params: dict[str, Any]) -> dict[str, Any]:
    """The run's sampling params with ``req``'s own output length and temperature, when it
    has them."""
    own = {k: v for k, v in (("max_new_tokens", req.max_new_tokens),
                             ("temperature", req.temperature)) if v is not None}
    return {**params, **own} if own else params


class _Gate:
    """Admits requests in order, request ``i`` once fewer than ``cap(i)`` are in flight."""

    def __init__(self, caps: Sequence[int] | int | None) -> None:
        self.caps, self.in_flight, self.next = caps, 0, 0
        self.cond = asyncio.Condition()

    def _cap(self, i: int) -> int | None:
        return self.caps if not isinstance(self.caps, Sequence) else self.caps[i]

    async def enter(self, i: int) -> None:
        async with self.cond:
            ordered = isinstance(self.caps, Sequence)
            cap = self._cap(i)
            await self.cond.wait_for(lambda: (not ordered or self.next == i) and (
                cap is None or self.in_flight < cap))
            self.in_flight += 1
            self.next = max(self.next, i + 1)
            self.cond.notify_all()

    async def leave(self) -> None:
        async with self.cond:
            self.in_flight -= 1
            self.cond.notify_all()


async def _run_streaming(driver: Driver, requests: Sequence[BenchRequest],
                         records: list[RequestRecord], params: dict[str, Any],
                         caps: Sequence[int] | int | None, clock: Clock, bar: Any) -> None:
    gate = _Gate(caps)

    async def one(i: int, req: BenchRequest, rec: RequestRecord) -> None:
        delay = rec.arrival_time - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        await gate.enter(i)
        try:
            rec.send_time = clock()
            try:
                await driver.send(req, _params_of(req, params), rec, clock)
            except Exception as e:  # noqa: BLE001 - a failed request is a figure, not a crash
                rec.success, rec.error = False, f"{type(e).__name__}: {e}"
            if rec.end_time is None:
                rec.end_time = clock()
        finally:
            await gate.leave()
            bar.update(1)

    await asyncio.gather(*(one(i, r, rec) for i, (r, rec) in enumerate(zip(requests, records))))


async def _run_batches(driver: Driver, requests: Sequence[BenchRequest],
                       records: list[RequestRecord], params: dict[str, Any],
                       caps: Sequence[int] | int | None, clock: Clock, bar: Any) -> None:
    pending = collections.deque(range(len(requests)))
    while pending:
        cap = (caps[pending[0]] if isinstance(caps, Sequence) else caps) or len(requests)
        delay = records[pending[0]].arrival_time - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        now = clock()
        batch: list[int] = []
        while pending and len(batch) < cap and records[pending[0]].arrival_time <= now:
            batch.append(pending.popleft())
        start = clock()
        try:
            reqs = [requests[i] for i in batch]
            outs = await asyncio.to_thread(driver.generate_batch, reqs,
                                           [_params_of(r, params) for r in reqs])
            error = None
        except Exception as e:  # noqa: BLE001
            outs, error = [], f"{type(e).__name__}: {e}"
        end = clock()
        for j, i in enumerate(batch):
            rec = records[i]
            rec.send_time, rec.end_time = start, end
            if error is not None or j >= len(outs):
                rec.error = error or "no output"
                continue
            meta = outs[j].get("meta_info", {})
            rec.set_meta(meta)
            if "completion_tokens" not in meta:
                rec.completion_tokens = len(outs[j].get("output_ids", []))
            rec.finish_reason = (meta.get("finish_reason") or {}).get("type")
            rec.success = rec.finish_reason not in ("abort", "error")
        bar.update(len(batch))
