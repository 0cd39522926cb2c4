"""An :class:`specdial.Engine` whose models are sharded over ``tp_size`` ranks.

Rank 0 is the process that constructs ``Engine(tp_size=N)``: it starts its node's other ranks
(:func:`~specdial.launch.node.start_rank0`, entry :func:`worker_rank`), loads its shard
of the target and drafter, and owns the Rust scheduler and the engine loop. Its worker is
wrapped (:class:`~specdial.distributed.mirror.Mirrored`): each ``prefill`` / ``decode`` call
is turned into the worker's plain input once (:func:`specdial.worker.inputs.worker_input`,
the decision already made), sent to the worker ranks, then run here; the sampling generator
travels as a placeholder because every rank holds one seeded the same way and makes the same
draws from identical (gathered) logits. After each call the emitted tokens and accepted
counts are compared across ranks (``RankDivergence`` on a mismatch). Worker ranks build the
same engine from the same options (their scheduler is never used) and replay the calls
(:func:`~specdial.distributed.mirror.replay`).

Start-up (:mod:`~specdial.distributed.liveness`): every rank waits at a start-up barrier after
loading its models (``"loaded"``) and after building its engine (``"ready"``), under
``startup_timeout_s``; rank 0's Engine takes requests only after ``"ready"``, so the first
collective never waits for a rank that is still loading. Each rank also runs a store heartbeat
(:class:`~specdial.distributed.liveness.Heartbeat`) from the start: rank 0 learns that a worker
rank stopped beating (also on another node; during start-up this fails the barrier within
``dist_timeout``) and reports it as its :attr:`TensorParallelRuntime.failure`; a worker rank
whose rank 0 stopped beating, or whose store is gone, exits.

While the engine is idle a heartbeat goes out every ``dist_timeout / 6`` seconds (a worker rank
waiting for its next call gives up after ``dist_timeout``). A rank that dies or hangs makes
the next call fail with :class:`~specdial.distributed.group.RankFailure` within
``dist_timeout``; the engine loop aborts that iteration's requests with the message, every
later iteration fails at once (no collective), and ``Engine.failure`` carries the message
(``/health`` answers 503).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any

import numpy as np
import torch

from specdial.distributed.channel import Leader
from specdial.distributed.group import DistConfig, RankFailure, TensorParallel, destroy_group
from specdial.launch.launcher import RankProcesses
from specdial.distributed.liveness import Heartbeat, startup_barrier
from specdial.distributed.mirror import Mirrored, replay
from specdial.launch.node import start_rank0
from specdial.config.parallel import ParallelOptions
from specdial.worker.grammar_masks import GrammarOnWire

__all__ = ["TensorParallelRuntime", "worker_rank", "rank_options", "start_worker_node"]

METHODS = ("prefill", "decode")
GENERATOR = "<this rank's generator>"
ENTRY = "specdial.launch.tp_engine:worker_rank"


def _tokens(out: Any) -> torch.Tensor:
    """What must agree across ranks after a pass: emitted tokens, then accepted counts."""
    parts = [np.asarray(out.tokens, dtype=np.int64).reshape(-1)]
    if getattr(out, "accepted", None) is not None:
        parts.append(np.asarray(out.accepted, dtype=np.int64).reshape(-1))
    return torch.from_numpy(np.concatenate(parts + [np.zeros(1, np.int64)]))


CHECKS = {"prefill": _tokens, "decode": _tokens}


def _wire(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call as sent: the generator as a placeholder, and a batch's grammar (its matchers
    stay on rank 0) as its shape (:class:`~specdial.worker.grammar_masks.GrammarOnWire`)."""
    sampling = args[1]
    if sampling is not None and sampling.grammar is not None:
        sampling = dataclasses.replace(sampling, grammar=sampling.grammar.wire())
    return (args[0], sampling, GENERATOR) + tuple(args[3:]), kwargs


#: EngineConfig fields the worker ranks do not take: rank 0 resolves the models, device and
#: dtype and sends them apart; the trace, logging and parallel layout are rank 0's business.
_RANK0_ONLY = frozenset({"model_path", "draft_model_path", "speculative_algorithm", "device",
                         "dtype", "record_trace", "log_interval_s", "tp_size", "dp_size",
                         "nnodes", "node_rank", "dist_init_addr", "dist_timeout",
                         "cpu_threads"})  # ranks run one torch thread each


def rank_options(config: Any) -> dict[str, Any]:
    """The options of an :class:`~specdial.config.EngineConfig` as the worker ranks
    need them (JSON-serialisable keyword arguments of ``Engine.from_modules``): what shapes
    the worker is kept (a callable steps schedule becomes ``[0]``: the worker then builds the
    same runtime states, one per steps value). Raises ``ValueError`` naming an option that
    cannot be sent."""
    out: dict[str, Any] = {}
    for key, value in config.to_dict().items():
        if key in _RANK0_ONLY:
            continue
        if key == "steps_schedule" and value is not None:
            value = [0] if callable(value) else [int(v) for v in value]
        try:
            json.dumps(value)
        except TypeError:
            raise ValueError(f"{key}={value!r} cannot be sent to the tensor-parallel worker "
                             "ranks; pass plain values") from None
        out[key] = value
    return out


class TensorParallelRuntime:
    """Rank 0's side of a tensor-parallel engine: the group, the worker-rank processes, the
    control channel and the heartbeat thread."""

    def __init__(self, tp: TensorParallel, procs: RankProcesses) -> None:
        self.tp, self.procs = tp, procs
        self.leader = Leader(tp)
        self.mirrored: Mirrored | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self.liveness = Heartbeat(tp, on_failure=self._peer_failed).start() \
            if tp.config is not None else None

    @classmethod
    def start(cls, options: ParallelOptions, rank_args: dict[str, Any],
              device: str) -> "TensorParallelRuntime":
        """Start this node's worker ranks (:func:`worker_rank`), join the group as rank 0 and
        send every rank ``rank_args`` (ranks on other nodes, started by
        :func:`start_worker_node`, get them the same way). Raises :class:`RankFailure` when
        the group does not form."""
        tp, procs = start_rank0(options, ENTRY, {}, device=device)
        try:
            tp.broadcast_object(rank_args)
        except BaseException:
            procs.close(grace_s=1.0)
            raise
        return cls(tp, procs)

    def _peer_failed(self, message: str) -> None:
        """A worker rank stopped its heartbeat: later calls fail at once (the call in flight,
        if any, fails by its collective's timeout)."""
        if self.mirrored is not None and self.mirrored.failure is None:
            self.mirrored.failure = message

    def barrier(self, name: str) -> None:
        """Wait for every rank at the start-up barrier ``name`` (``"loaded"``, ``"ready"``)
        under ``startup_timeout_s``; this node's ranks that exit fail it at once, a rank whose
        heartbeat stops (one on another node) within ``dist_timeout``. Raises
        :class:`RankFailure` naming the rank and the cause."""
        startup_barrier(self.tp, name, self.procs.failed, self.liveness)

    def attach(self, worker: Any) -> Any:
        """Wrap rank 0's ``worker`` (returns the wrapper the engine loop must call) and start
        the heartbeats."""
        from specdial.worker.inputs import worker_input

        mirrored = Mirrored(worker, self.leader, METHODS, CHECKS, wire=_wire)
        self.mirrored = mirrored
        pad = worker.pad_kv_slot

        class _Rank0Worker:
            """The worker as the loop sees it: plans become plain inputs before mirroring;
            the masks of a batch's grammar, made here, are broadcast to the other ranks."""

            grammar_share = staticmethod(self.tp.broadcast)

            def __getattr__(self, name: str) -> Any:
                fn = getattr(mirrored, name)
                if name not in METHODS:
                    return fn
                return lambda plan, *rest, **kw: fn(worker_input(plan, pad), *rest, **kw)

        self.barrier("ready")  # every rank built its engine: collectives may run from here
        self.leader.heartbeat_now()
        self._beat = threading.Thread(target=self._heartbeats, name="specdial-tp-heartbeat",
                                      daemon=True)
        self._beat.start()
        return _Rank0Worker()

    def _heartbeats(self) -> None:
        assert self.mirrored is not None
        while not self._stop.wait(self.tp.timeout_s / 6):
            with self.mirrored.lock:
                if self.mirrored.failure is None and self.leader.heartbeat_due():
                    try:
                        self.leader.heartbeat()
                    except RankFailure as e:
                        self.mirrored.failure = str(e)

    @property
    def failure(self) -> str | None:
        """The group's failure message, or None while every rank is well: a failed call, a
        local worker rank's exit, or a worker rank's stopped heartbeat."""
        parts = [self.procs.failed(), None if self.liveness is None else self.liveness.failure]
        causes = [p for p in parts if p is not None]
        if self.mirrored is not None and self.mirrored.failure is not None:
            failed = self.mirrored.failure
            return "; ".join([failed] + [c for c in causes if c != failed])
        return None if not causes else f"{'; '.join(causes)}; the engine cannot run its passes"

    def close(self) -> None:
        """Stop the worker ranks (a shutdown message when the group is healthy) and leave."""
        self._stop.set()
        if self.liveness is not None:
            self.liveness.stop()
        if self._beat is not None:
            self._beat.join()
        healthy = self.mirrored is None or self.mirrored.failure is None
        if healthy and self.procs.failed() is None:
            try:
                with self.mirrored.lock if self.mirrored else threading.Lock():
                    self.leader.shutdown()
                self.procs.close(exit_first_s=10.0)
                destroy_group()
                return
            except RankFailure:
                pass
        self.procs.close(grace_s=1.0)
        # leave the broken group so that this process can start another engine; its teardown
        # can block on a hung peer, so it gets a few seconds in a thread, then is left as is
        # (a later tensor-parallel Engine here then fails with a clear error)
        leave = threading.Thread(target=destroy_group, name="specdial-tp-leave", daemon=True)
        leave.start()
        leave.join(5.0)


def start_worker_node(options: ParallelOptions, device: str = "cpu") -> int:
    """A node other than 0 (``serve --node-rank K``): run its ranks of the engine that node
    0's ``Engine`` leads until it shuts down; returns the exit status (0: clean)."""
    from specdial.launch.node import run_worker_node

    return run_worker_node(options, ENTRY, {}, device=device)


def worker_rank(tp: TensorParallel, config: DistConfig) -> None:
    """Entry of ranks ``1..tp_size-1``: receive the engine's options from rank 0, build the
    same engine on this rank's shard, and replay rank 0's worker calls until it shuts down.
    Exits the process (status 2) when rank 0 stops its heartbeat or its store is gone."""
    from specdial.launch.rank import exit_rank_failure

    liveness = Heartbeat(tp, on_failure=exit_rank_failure).start()
    try:
        args = tp.broadcast_object(None)
        _serve_rank(tp, config, liveness, **args)
    finally:
        liveness.stop()


def _serve_rank(tp: TensorParallel, config: DistConfig, liveness: Heartbeat, model_path: str,
                draft_model_path: str | None, algorithm: str | None, dtype: str,
                options: dict[str, Any]) -> None:
    from specdial.engine import Engine
    from specdial.models import load_engine_modules

    target, drafter, tokenizer = load_engine_modules(
        model_path, draft_model_path, algorithm, dtype=getattr(torch, dtype),
        device=config.torch_device, tp=tp)
    startup_barrier(tp, "loaded", liveness=liveness)
    engine = Engine.from_modules(target, drafter, tokenizer, log_interval_s=None, **options)
    worker, generator = engine.worker, engine.generator
    startup_barrier(tp, "ready", liveness=liveness)

    def local(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        sampling = args[1]
        if sampling is not None and isinstance(sampling.grammar, GrammarOnWire):
            # rank 0 broadcasts each mask its matchers make, in the pass's order
            sampling.grammar = sampling.grammar.follower(tp.broadcast, worker.device)
        return (args[0], sampling, generator) + tuple(args[3:]), kwargs

    try:
        replay(tp, worker, METHODS, CHECKS, local=local)
        liveness.stop()  # rank 0 shut down: its store may go before this rank exits
    finally:
        engine.shutdown(drain=False)
