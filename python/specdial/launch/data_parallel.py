"""Data parallelism: N engine replicas behind one front end (``dp_size``, ``serve --dp-size``).

:class:`DataParallelEngine` implements the serving contract of :mod:`specdial.engine.api`
over replicas that each implement it, each with its own Rust scheduler, KV cache and adaptive
policy (nothing is shared between them): by default replica processes
(:class:`~specdial.launch.replica_client.ReplicaClient`, ``data_parallel_backend="mp"``,
started by :meth:`DataParallelEngine.start_processes`), or ``specdial.Engine`` instances in this
process (``"inprocess"``). Each request goes to the replica the router picks
(:class:`~specdial.launch.routing.Router`, ``load_balance_method``; by default the least
outstanding work: prompt tokens plus ``max_new_tokens`` of the requests in flight there), ties
broken round-robin. A request never moves once routed.

Faults: a replica whose ``failure`` is set (its process died, its engine failed, or it hung for
``watchdog_timeout`` seconds and was killed: :mod:`specdial.launch.replica_watch`) is not routed
to again; its requests in flight end with an error (the replica's doing). The others keep
serving: :attr:`DataParallelEngine.failure` stays None (``/health`` answers 200) while one
replica is well, and :attr:`DataParallelEngine.degraded` names the failed ones.

Request ids: replica ``i``'s request ``r`` is ``r * N + i`` here, so :meth:`abort` reaches the
right replica. :meth:`stats` aggregates the replicas still serving (:func:`aggregate_stats`),
which is what ``/metrics`` sums; :meth:`replica_stats` / :meth:`live_stats` keep them apart
(``/metrics``' ``dp_rank`` series, :mod:`specdial.server.replica_metrics`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable

from specdial.engine.api import EngineStats, LogprobOptions, StreamChunk, stream_takes
from specdial.launch.routing import Router, prompt_tokens, request_work

__all__ = ["DataParallelEngine", "aggregate_stats"]

_SUMMED = ("running", "queued", "kv_pages_used", "kv_pages_total", "num_drafts",
           "draft_tokens_proposed", "num_accepted_tokens", "step_switches", "preemptions",
           "requests_finished", "prompt_tokens", "cached_tokens", "cached_pages",
           "generation_tokens")


def aggregate_stats(parts: Sequence[EngineStats]) -> EngineStats:
    """One :class:`EngineStats` for replicas ``parts`` (at least one).

    Gauges and counters are summed (``accepted_per_pos`` position by position,
    ``verify_length_histogram`` length by length, ``tree_node_histogram`` node count by node
    count). Policy state
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
    out.verify_length_histogram = _summed(p.verify_length_histogram for p in parts)
    out.tree_node_histogram = _summed(p.tree_node_histogram for p in parts)
    out.slot_states = [{**s, "replica": i} for i, p in enumerate(parts) for s in p.slot_states]
    out.steps_per_slot = dict(first.steps_per_slot)
    return out


def _summed(hists: Iterable[dict[int, int]]) -> dict[int, int]:
    """``{key: count}`` histograms summed key by key (keys ascending)."""
    hists = list(hists)
    return {v: sum(h.get(v, 0) for h in hists) for v in sorted(set().union(*hists))}


class DataParallelEngine:
    """The engine contract over ``replicas`` (see the module docstring).

    ``replicas``: engines with the same tokenizer vocabulary and the same
    ``context_length`` (the smallest is used otherwise); ``ValueError`` for an empty list.
    ``tokenizer`` and ``context_length`` are replica 0's. :meth:`generate` with a list of
    prompts routes each prompt separately and runs the replicas' shares concurrently.
    ``load_balance_method``: the :class:`~specdial.launch.routing.Router`'s strategy
    (``ValueError`` naming it for another value). :attr:`router` holds the routing counts.
    """

    def __init__(self, replicas: Sequence[Any],
                 load_balance_method: str = "minimum_tokens") -> None:
        if not replicas:
            raise ValueError("DataParallelEngine needs at least one replica (dp_size >= 1)")
        self.replicas = list(replicas)
        self.tokenizer = self.replicas[0].tokenizer
        self.context_length = min(int(r.context_length) for r in self.replicas)
        self.router = Router(len(self.replicas), load_balance_method)
        self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="specdial-dp")

    @classmethod
    def build(cls, cfg: Any, make_replica: Any) -> "DataParallelEngine":
        """The front end of the :class:`~specdial.config.EngineConfig` ``cfg``: replica
        processes (:meth:`start_processes`) or, with ``data_parallel_backend="inprocess"``,
        ``cfg.dp_size`` calls of ``make_replica(seed=...)`` (each replica's own seed,
        :func:`~specdial.launch.replica_setup.replica_seed`; those built are shut down when
        one raises)."""
        from specdial.launch.replica_setup import replica_seed

        if cfg.data_parallel_backend == "mp":
            return cls.start_processes(cfg)
        replicas: list[Any] = []
        try:
            for i in range(cfg.dp_size):
                replicas.append(make_replica(seed=replica_seed(cfg.seed, i)))
        except BaseException:
            for r in replicas:
                r.shutdown(drain=False)
            raise
        return cls(replicas, cfg.load_balance_method)

    @classmethod
    def start_processes(cls, cfg: Any) -> "DataParallelEngine":
        """``cfg.dp_size`` replica processes of the :class:`~specdial.config.EngineConfig`
        ``cfg`` (:mod:`specdial.launch.replica_setup` says what each gets) behind a front end
        routing by ``cfg.load_balance_method``. Blocks until every replica is ready; raises
        what a replica raises (the others are stopped)."""
        import os

        import torch

        from specdial.config import DEFAULT_STARTUP_TIMEOUT_S
        from specdial.launch.replica_client import start_replicas
        from specdial.launch.replica_setup import visible_devices

        device = str(cfg.device)
        on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
        visible = None if on_cpu else visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"),
                                                      torch.cuda.device_count())
        clients = start_replicas(cfg, on_cpu, visible, DEFAULT_STARTUP_TIMEOUT_S)
        return cls(clients, cfg.load_balance_method)

    @property
    def dp_size(self) -> int:
        return len(self.replicas)

    def inflight(self) -> list[int]:
        """Requests in flight per replica (a snapshot)."""
        return self.router.snapshot()[0]

    def _work(self, prompt: Any, input_ids: Any, sampling_params: Any) -> int:
        return request_work(prompt_tokens(self.tokenizer, prompt, input_ids), sampling_params)

    def _route(self, works: list[int]) -> list[int]:
        """Replica indices for new requests of outstanding work ``works`` (the router's
        choice; each counts at once, so a batch spreads) until :meth:`_done`. Replicas that
        report a ``failure`` are taken out first. Raises
        :class:`~specdial.launch.routing.NoReplicaError` when none is left."""
        for i, r in enumerate(self.replicas):
            if i not in self.router.failed:
                why = getattr(r, "failure", None)
                if why:
                    self.router.mark_failed(i, f"replica {i}: {why}")
        return self.router.route(works)

    def _done(self, i: int, works: list[int]) -> None:
        self.router.done(i, works)

    @contextmanager
    def _routed(self, work: int) -> Iterator[int]:
        i = self._route([work])[0]
        try:
            yield i
        finally:
            self._done(i, [work])

    def _global(self, chunk: StreamChunk, i: int) -> StreamChunk:
        chunk.request_id = chunk.request_id * len(self.replicas) + i
        return chunk

    # ------------------------------------------------------------------ streams
    def stream(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
               sampling_params: dict[str, Any] | None = None, stop: list[str] | None = None,
               logprobs: LogprobOptions | None = None) -> Iterator[StreamChunk]:
        """One request on the router's replica (its ``stream``; ids made global)."""
        with self._routed(self._work(prompt, input_ids, sampling_params)) as i:
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
                           logprobs: LogprobOptions | None = None,
                           whole: bool = False,
                           on_submitted: Callable[[int], None] | None = None
                           ) -> AsyncIterator[StreamChunk]:
        """:meth:`stream` on an asyncio loop (the replica's ``async_stream``; ``whole``: its
        chunks together at the end, so a replica process sends them in one message instead of
        one per decode iteration; ``on_submitted``: called with the request's front-end id,
        the one :meth:`abort` takes, once its replica accepted it, where the replica's
        ``async_stream`` takes it: replica processes and in-process engines do)."""
        with self._routed(self._work(prompt, input_ids, sampling_params)) as i:
            kwargs: dict[str, Any] = {} if logprobs is None else {"logprobs": logprobs}
            if whole:
                kwargs["whole"] = True
            if on_submitted is not None and stream_takes(self.replicas[i], "on_submitted"):
                n = len(self.replicas)
                kwargs["on_submitted"] = lambda rid: on_submitted(rid * n + i)
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
        works = [self._work(*item) for item in items]
        if single:
            i = self._route(works)[0]
            try:
                result = self.replicas[i].generate(prompt, sampling_params, input_ids, **kwargs)
            except BaseException:
                self._done(i, works)
                raise
            if kwargs.get("stream"):
                return self._release_after(result, i, works)
            self._done(i, works)
            return result
        shares = self._shares(works)

        def run(i: int, ks: list[int]) -> list[Any]:
            try:
                return self.replicas[i].generate(*self._share_args(items, ks, prompt, input_ids),
                                                 **kwargs)
            finally:
                self._done(i, [works[k] for k in ks])

        futures = {i: self._pool.submit(run, i, ks) for i, ks in shares.items()}
        return self._merge(len(items), shares, {i: f.result() for i, f in futures.items()})

    async def async_generate(self, prompt: Any = None, sampling_params: Any = None,
                             input_ids: Any = None, **kwargs: Any) -> Any:
        """``Engine.async_generate`` over the replicas, routed as :meth:`generate` (the
        replicas' shares awaited together)."""
        single, items = self._items(prompt, sampling_params, input_ids)
        works = [self._work(*item) for item in items]
        if single:
            i = self._route(works)[0]
            try:
                result = await self.replicas[i].async_generate(prompt, sampling_params,
                                                               input_ids, **kwargs)
            except BaseException:
                self._done(i, works)
                raise
            if kwargs.get("stream"):
                return self._async_release_after(result, i, works)
            self._done(i, works)
            return result
        shares = self._shares(works)

        async def run(i: int, ks: list[int]) -> list[Any]:
            try:
                return await self.replicas[i].async_generate(
                    *self._share_args(items, ks, prompt, input_ids), **kwargs)
            finally:
                self._done(i, [works[k] for k in ks])

        order = list(shares)
        results = await asyncio.gather(*(run(i, shares[i]) for i in order))
        return self._merge(len(items), shares, dict(zip(order, results)))

    def _shares(self, works: list[int]) -> dict[int, list[int]]:
        """Route prompts of work ``works``: ``{replica: [prompt indices]}`` (counted in
        flight)."""
        shares: dict[int, list[int]] = {}
        for k, i in enumerate(self._route(works)):
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

    def _release_after(self, it: Iterator[Any], i: int, works: list[int]) -> Iterator[Any]:
        try:
            yield from it
        finally:
            self._done(i, works)

    async def _async_release_after(self, it: AsyncIterator[Any], i: int,
                                   works: list[int]) -> AsyncIterator[Any]:
        try:
            async for item in it:
                yield item
        finally:
            self._done(i, works)
            await it.aclose()  # type: ignore[attr-defined]

    def abort(self, request_id: int) -> None:
        """Abort a request by its front-end id (see the module docstring)."""
        n = len(self.replicas)
        self.replicas[request_id % n].abort(request_id // n)

    # ------------------------------------------------------------------ state
    def stats(self) -> EngineStats:
        """The stats of the replicas still serving, aggregated (:func:`aggregate_stats`);
        raises ``RuntimeError`` when none is."""
        live = self.live_stats()
        if not live:
            raise RuntimeError(f"no data-parallel replica is serving: {self.failure}")
        return aggregate_stats(list(live.values()))

    def replica_stats(self) -> list[EngineStats]:
        """Each replica's own :class:`EngineStats`, in replica order (raises what a failed
        replica's ``stats()`` raises; :meth:`live_stats` skips those)."""
        return [r.stats() for r in self.replicas]

    def live_stats(self) -> dict[int, EngineStats]:
        """``{dp_rank: stats}`` of the replicas without a ``failure`` whose ``stats()``
        answers."""
        out = {}
        for i, r in enumerate(self.replicas):
            if getattr(r, "failure", None):
                continue
            try:
                out[i] = r.stats()
            except Exception:  # noqa: BLE001 - it failed since: left out, as a failed one
                continue
        return out

    @property
    def loop_turns(self) -> int:
        """The replicas' engine loop turns summed, failed replicas' last counts included (so it
        never goes back); a replica process's count is its latest heartbeat's
        (:attr:`~specdial.launch.replica_client.ReplicaClient.loop_turns`)."""
        return sum(int(r.loop_turns) for r in self.replicas)

    def graph_stats(self) -> dict[str, Any]:
        """The replicas' CUDA-graph counters (``Engine.graph_stats``) summed: ``replays`` pass
        by pass, ``eager`` reason by reason, ``captured``. Raises what a replica's
        ``graph_stats()`` raises (:class:`~specdial.launch.replica_client.ReplicaFailure` for
        a dead replica process)."""
        parts = [r.graph_stats() for r in self.replicas]
        out: dict[str, Any] = {"replays": {}, "eager": {},
                               "captured": sum(int(p["captured"]) for p in parts)}
        for key in ("replays", "eager"):
            for p in parts:
                for name, n in p[key].items():
                    out[key][name] = out[key].get(name, 0) + n
        return out

    def failed_replicas(self) -> dict[int, str]:
        """``{dp_rank: why}`` of the replicas that failed (their ``failure``)."""
        out = {}
        for i, r in enumerate(self.replicas):
            why = getattr(r, "failure", None)
            if why:
                out[i] = f"replica {i}: {why}"
        return out

    @property
    def failure(self) -> str | None:
        """None while one replica can serve; once every replica has failed, their messages
        (``/health`` then answers 503)."""
        failed = self.failed_replicas()
        if len(failed) < len(self.replicas):
            return None
        return "every data-parallel replica failed: " + "; ".join(failed.values())

    @property
    def degraded(self) -> str | None:
        """While some (not all) replicas have failed, a sentence naming them (``/health``
        reports it with 200: the others serve); else None."""
        failed = self.failed_replicas()
        if not failed or len(failed) == len(self.replicas):
            return None
        return (f"{len(failed)} of {len(self.replicas)} data-parallel replicas failed, the "
                "others serve: " + "; ".join(failed.values()))

    def shutdown(self, drain: bool = True) -> None:
        """Shut every replica down concurrently (``drain`` as for ``Engine.shutdown``; a
        replica process exits)."""
        list(self._pool.map(lambda r: r.shutdown(drain), self.replicas))
        self._pool.shutdown(wait=False)

    def __enter__(self) -> "DataParallelEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
