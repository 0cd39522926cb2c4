"""Data parallelism: N engine replicas behind one front end (``dp_size``, ``serve --dp-size``).

:class:`DataParallelEngine` implements the serving contract of :mod:`specdial.engine.api`
over replicas that each implement it (``specdial.Engine`` instances, each with its own Rust
scheduler, KV cache and adaptive policy; nothing is shared between them). Each request goes to
the replica with the fewest requests in flight through this front end (submitted and not
finished: an exact count, not a sampled gauge), ties broken round-robin, so a burst spreads
evenly and a replica slowed by long requests gets fewer new ones (SGLang's
``--load-balance-method`` ``shortest_queue``). A request never moves once routed.

Request ids: replica ``i``'s request ``r`` is ``r * N + i`` here, so :meth:`abort` reaches the
right replica. :meth:`stats` aggregates the replicas (:func:`aggregate_stats`), which is what
``/metrics`` exports; :meth:`replica_stats` keeps them apart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from specdial.engine.api import EngineStats, LogprobOptions, StreamChunk

__all__ = ["DataParallelEngine", "aggregate_stats"]

_SUMMED = ("running", "queued", "kv_pages_used", "kv_pages_total", "num_drafts",
           "draft_tokens_proposed", "num_accepted_tokens", "step_switches", "preemptions",
           "requests_finished", "prompt_tokens", "cached_tokens", "cached_pages",
           "generation_tokens")


def aggregate_stats(parts: Sequence[EngineStats]) -> EngineStats:
    """One :class:`EngineStats` for replicas ``parts`` (at least one).

    Gauges and counters are summed (``accepted_per_pos`` position by position). Policy state
    cannot be summed: ``slot_states`` lists every replica's slots with a ``replica`` key added;
    ``steps_per_slot``, ``last_decode_steps`` / ``last_decode_batch_size``, ``policy`` and
    ``goodput`` are replica 0's (each replica adapts on its own; see :meth:`DataParallelEngine.
    replica_stats` for the others).
    """
    if not parts:
        raise ValueError("aggregate_stats needs at least one replica's stats")
    first = parts[0]
    out = dataclasses.replace(first, **{f: sum(getattr(p, f) for p in parts) for f in _SUMMED})
    width = max(len(p.accepted_per_pos) for p in parts)
    out.accepted_per_pos = [sum(p.accepted_per_pos[i] for p in parts
                                if i < len(p.accepted_per_pos)) for i in range(width)]
    out.slot_states = [{**s, "replica": i} for i, p in enumerate(parts) for s in p.slot_states]
    out.steps_per_slot = dict(first.steps_per_slot)
    return out


class DataParallelEngine:
    """The engine contract over ``replicas`` (see the module docstring).

    ``replicas``: engines with the same tokenizer vocabulary and the same
    ``context_length`` (the smallest is used otherwise); ``ValueError`` for an empty list.
    ``tokenizer`` and ``context_length`` are replica 0's. :meth:`generate` with a list of
    prompts routes each prompt separately and runs the replicas' shares concurrently.
    """

    def __init__(self, replicas: Sequence[Any]) -> None:
        if not replicas:
            raise ValueError("DataParallelEngine needs at least one replica (dp_size >= 1)")
        self.replicas = list(replicas)
        self.tokenizer = self.replicas[0].tokenizer
        self.context_length = min(int(r.context_length) for r in self.replicas)
        self._inflight = [0] * len(self.replicas)
        self._next = itertools.count()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="specdial-dp")

    @property
    def dp_size(self) -> int:
        return len(self.replicas)

    def inflight(self) -> list[int]:
        """Requests in flight per replica (a snapshot)."""
        with self._lock:
            return list(self._inflight)

    def _route(self, count: int = 1) -> list[int]:
        """Replica indices for ``count`` new requests, least loaded first (each choice counts
        immediately, so a batch spreads); the counts stay raised until :meth:`_done`."""
        n = len(self.replicas)
        out = []
        with self._lock:
            for _ in range(count):
                start = next(self._next) % n
                order = [(start + k) % n for k in range(n)]
                i = min(order, key=lambda j: self._inflight[j])
                self._inflight[i] += 1
                out.append(i)
        return out

    def _done(self, i: int, count: int = 1) -> None:
        with self._lock:
            self._inflight[i] -= count

    @contextmanager
    def _routed(self) -> Iterator[int]:
        i = self._route()[0]
        try:
            yield i
        finally:
            self._done(i)

    def _global(self, chunk: StreamChunk, i: int) -> StreamChunk:
        chunk.request_id = chunk.request_id * len(self.replicas) + i
        return chunk

    # ------------------------------------------------------------------ streams
    def stream(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
               sampling_params: dict[str, Any] | None = None, stop: list[str] | None = None,
               logprobs: LogprobOptions | None = None) -> Iterator[StreamChunk]:
        """One request on the least-loaded replica (its ``stream``; ids made global)."""
        with self._routed() as i:
            kwargs = {} if logprobs is None else {"logprobs": logprobs}
            it = self.replicas[i].stream(prompt, input_ids=input_ids,
                                         sampling_params=sampling_params, stop=stop, **kwargs)
            try:
                for chunk in it:
                    yield self._global(chunk, i)
            finally:
                it.close()

    async def async_stream(self, prompt: str | None = None, *,
                           input_ids: list[int] | None = None,
                           sampling_params: dict[str, Any] | None = None,
                           stop: list[str] | None = None,
                           logprobs: LogprobOptions | None = None) -> AsyncIterator[StreamChunk]:
        """:meth:`stream` on an asyncio loop (the replica's ``async_stream``)."""
        with self._routed() as i:
            kwargs = {} if logprobs is None else {"logprobs": logprobs}
            it = self.replicas[i].async_stream(prompt, input_ids=input_ids,
                                               sampling_params=sampling_params, stop=stop,
                                               **kwargs)
            try:
                async for chunk in it:
                    yield self._global(chunk, i)
            finally:
                await it.aclose()

    # ------------------------------------------------------------------ offline API
    @staticmethod
    def _items(prompt: Any, sampling_params: Any, input_ids: Any) -> tuple[bool, list[tuple]]:
        """``(single, [(prompt_i, input_ids_i, sampling_params_i), ...])``."""
        many_ids = isinstance(input_ids, list) and bool(input_ids) and isinstance(
            input_ids[0], list)
        single = not isinstance(prompt, list) and not many_ids
        prompts = [prompt] if single else (prompt if isinstance(prompt, list)
                                           else [None] * len(input_ids))
        ids = [input_ids] if single else (input_ids if many_ids else [None] * len(prompts))
        if len(ids) != len(prompts):
            ids = [None] * len(prompts)  # the replica reports the conflict
        params = (sampling_params if isinstance(sampling_params, list)
                  and len(sampling_params) == len(prompts) and not single
                  else [sampling_params] * len(prompts))
        return single, list(zip(prompts, ids, params))

    def generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                 **kwargs: Any) -> Any:
        """``Engine.generate`` over the replicas: one prompt -> one replica; a list -> each
        prompt to the least-loaded replica, the shares run concurrently, results in prompt
        order. ``kwargs`` (``return_logprob``, ``stream``, ...) go to the replicas unchanged.
        Raises what the replicas raise (the first error)."""
        single, items = self._items(prompt, sampling_params, input_ids)
        if single:
            i = self._route()[0]
            try:
                result = self.replicas[i].generate(prompt, sampling_params, input_ids, **kwargs)
            except BaseException:
                self._done(i)
                raise
            if kwargs.get("stream"):
                return self._release_after(result, i)
            self._done(i)
            return result
        shares = self._shares(len(items))

        def run(i: int, ks: list[int]) -> list[Any]:
            try:
                return self.replicas[i].generate(*self._share_args(items, ks, prompt, input_ids),
                                                 **kwargs)
            finally:
                self._done(i, len(ks))

        futures = {i: self._pool.submit(run, i, ks) for i, ks in shares.items()}
        return self._merge(len(items), shares, {i: f.result() for i, f in futures.items()})

    async def async_generate(self, prompt: Any = None, sampling_params: Any = None,
                             input_ids: Any = None, **kwargs: Any) -> Any:
        """``Engine.async_generate`` over the replicas, routed as :meth:`generate` (the
        replicas' shares awaited together)."""
        single, items = self._items(prompt, sampling_params, input_ids)
        if single:
            i = self._route()[0]
            try:
                result = await self.replicas[i].async_generate(prompt, sampling_params,
                                                               input_ids, **kwargs)
            except BaseException:
                self._done(i)
                raise
            if kwargs.get("stream"):
                return self._async_release_after(result, i)
            self._done(i)
            return result
        shares = self._shares(len(items))

        async def run(i: int, ks: list[int]) -> list[Any]:
            try:
                return await self.replicas[i].async_generate(
                    *self._share_args(items, ks, prompt, input_ids), **kwargs)
            finally:
                self._done(i, len(ks))

        order = list(shares)
        results = await asyncio.gather(*(run(i, shares[i]) for i in order))
        return self._merge(len(items), shares, dict(zip(order, results)))

    def _shares(self, count: int) -> dict[int, list[int]]:
        """Route ``count`` prompts: ``{replica: [prompt indices]}`` (counted in flight)."""
        shares: dict[int, list[int]] = {}
        for k, i in enumerate(self._route(count)):
            shares.setdefault(i, []).append(k)
        return shares

    @staticmethod
    def _share_args(items: list[tuple], ks: list[int], prompt: Any,
                    input_ids: Any) -> tuple[Any, Any, Any]:
        """``(prompt, sampling_params, input_ids)`` of the prompts ``ks`` for one replica."""
        p = [items[k][0] for k in ks]
        ids = [items[k][1] for k in ks]
        sp = [items[k][2] for k in ks]
        return None if prompt is None else p, sp, None if input_ids is None else ids

    @staticmethod
    def _merge(count: int, shares: dict[int, list[int]],
               results: dict[int, list[Any]]) -> list[Any]:
        """The replicas' results back in prompt order."""
        out: list[Any] = [None] * count
        for i, ks in shares.items():
            for k, result in zip(ks, results[i]):
                out[k] = result
        return out

    def _release_after(self, it: Iterator[Any], i: int) -> Iterator[Any]:
        try:
            yield from it
        finally:
            self._done(i)

    async def _async_release_after(self, it: AsyncIterator[Any], i: int) -> AsyncIterator[Any]:
        try:
            async for item in it:
                yield item
        finally:
            self._done(i)
            await it.aclose()  # type: ignore[attr-defined]

    def abort(self, request_id: int) -> None:
        """Abort a request by its front-end id (see the module docstring)."""
        n = len(self.replicas)
        self.replicas[request_id % n].abort(request_id // n)

    # ------------------------------------------------------------------ state
    def stats(self) -> EngineStats:
        """The replicas' stats aggregated (:func:`aggregate_stats`)."""
        return aggregate_stats(self.replica_stats())

    def replica_stats(self) -> list[EngineStats]:
        """Each replica's own :class:`EngineStats`, in replica order."""
        return [r.stats() for r in self.replicas]

    @property
    def failure(self) -> str | None:
        """The first replica's fatal failure message (``engine.failure``), or None."""
        for i, r in enumerate(self.replicas):
            why = getattr(r, "failure", None)
            if why:
                return f"replica {i}: {why}"
        return None

    def shutdown(self, drain: bool = True) -> None:
        """Shut every replica down concurrently (``drain`` as for ``Engine.shutdown``)."""
        list(self._pool.map(lambda r: r.shutdown(drain), self.replicas))
        self._pool.shutdown(wait=False)

    def __enter__(self) -> "DataParallelEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
