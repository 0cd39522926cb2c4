"""The tensor-parallel process group: rendezvous, collectives with a deadline.

One :class:`DistConfig` (a typed setting of the bottom layer, :mod:`specdial.config.parallel`,
re-exported here for the group's callers) describes a rank's place in the group: ``tp_size`` ranks in all, spread
over ``nnodes`` nodes (``tp_size // nnodes`` ranks per node, rank ``r`` on node
``r // (tp_size // nnodes)``), meeting at ``init_addr`` (``host:port``, the TCP store rank 0
serves). :func:`init_group` joins the group with torch.distributed (gloo for CPU tensors, NCCL
for CUDA: existing transports, none of our own) and returns a :class:`TensorParallel`, the only
object model code sees: its :meth:`~TensorParallel.all_reduce` and
:meth:`~TensorParallel.all_gather` turn a peer that died or hung into :class:`RankFailure`
within ``timeout_s`` seconds (gloo's and NCCL's own collective timeout, set at rendezvous) and
can time the collectives (:class:`CollectiveTimer`).

Nothing here reads environment variables; NCCL's error handling is switched on through torch's
documented variable just before the group is created (see :func:`init_group`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from specdial.config.parallel import DEFAULT_TIMEOUT_S, DistConfig, free_port, parse_addr

__all__ = ["DistConfig", "TensorParallel", "RankFailure", "RankDivergence", "CollectiveTimer", "init_group",
           "free_port", "parse_addr", "DEFAULT_TIMEOUT_S"]


class RankFailure(RuntimeError):
    """A tensor-parallel peer died, hung past the timeout, or the group could not be formed.

    The message says which collective failed, after how long, and the transport's reason.
    """


class RankDivergence(RuntimeError):
    """Ranks computed different values where they must agree (e.g. the accepted tokens of an
    iteration); the engine cannot continue consistently."""


@dataclass
class CollectiveTimer:
    """Wall time spent inside collectives (seconds, ``time.perf_counter``) and their count.

    On the CPU (gloo) a collective returns when it is done, so the time is the real cost. On
    CUDA (NCCL) a collective is queued on the stream and the time measured here is only the
    launch; use a profiler there.
    """

    enabled: bool = False
    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0

    def reset(self) -> None:
        self.seconds, self.calls, self.bytes = 0.0, 0, 0


@dataclass
class TensorParallel:
    """A rank's view of its tensor-parallel group (what sharded modules hold).

    ``rank`` / ``size``: this rank and the group size; ``group``: the torch process group
    (None: the default group); ``timeout_s``: the deadline collectives were created with;
    ``timer``: :class:`CollectiveTimer`. ``size == 1`` never calls torch.distributed.
    ``config``: the :class:`DistConfig` it was joined with and ``store``: the rendezvous's
    ``torch.distributed.TCPStore`` (None for a group built by hand; the start-up barriers and
    heartbeats of :mod:`specdial.distributed.liveness` use them).
    """

    rank: int
    size: int
    group: dist.ProcessGroup | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    timer: CollectiveTimer = field(default_factory=CollectiveTimer)
    config: DistConfig | None = field(default=None, repr=False)
    store: Any = field(default=None, repr=False)

    def _fail(self, op: str, started: float, error: BaseException) -> RankFailure:
        waited = time.monotonic() - started
        return RankFailure(
            f"tensor-parallel {op} on rank {self.rank} of {self.size} failed after "
            f"{waited:.1f}s (dist_timeout {self.timeout_s:g}s): a peer rank died or hung "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group in place and return it (any shape and float dtype).

        Raises :class:`RankFailure` when a peer is gone or past the timeout.
        """
        if self.size == 1:
            return t
        started = time.monotonic()
        t0 = time.perf_counter()
        try:
            dist.all_reduce(t, group=self.group)
        except (RuntimeError, ValueError) as e:  # gloo/NCCL report peer loss as RuntimeError
            raise self._fail("all_reduce", started, e) from e
        self._count(t0, t)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``t`` (same shape on all ranks) along ``dim``, rank order.

        Returns a new tensor ``size`` times as wide along ``dim``. Raises :class:`RankFailure`
        like :meth:`all_reduce`.
        """
        if self.size == 1:
            return t
        started = time.monotonic()
        t0 = time.perf_counter()
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        try:
            dist.all_gather(parts, t, group=self.group)
        except (RuntimeError, ValueError) as e:
            raise self._fail("all_gather", started, e) from e
        self._count(t0, t)
        return torch.cat(parts, dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``t`` on every rank with rank ``src``'s ``t`` (in place; returned)."""
        if self.size == 1:
            return t
        started = time.monotonic()
        t0 = time.perf_counter()
        try:
            dist.broadcast(t, src=src, group=self.group)
        except (RuntimeError, ValueError) as e:
            raise self._fail("broadcast", started, e) from e
        self._count(t0, t)
        return t

    def broadcast_object(self, obj: object = None, src: int = 0) -> object:
        """Rank ``src``'s picklable ``obj`` on every rank (pickled; for small control data)."""
        if self.size == 1:
            return obj
        started = time.monotonic()
        t0 = time.perf_counter()
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=src, group=self.group)
        except (RuntimeError, ValueError) as e:
            raise self._fail("broadcast", started, e) from e
        self._count(t0, None)
        return box[0]

    def check_same(self, t: torch.Tensor, what: str) -> None:
        """Raise :class:`RankDivergence` naming ``what`` unless every rank holds the same
        integer tensor ``t`` (compared by a 2-number fingerprint: one small all-gather).
        Raises :class:`RankFailure` like :meth:`all_reduce`."""
        if self.size == 1:
            return
        v = t.detach().reshape(-1).to("cpu", torch.int64)
        weights = torch.arange(1, v.numel() + 1, dtype=torch.int64)
        mine = torch.stack([v.sum(), (v * weights).sum()]).to(self._device)
        every = self.all_gather(mine[None], 0).cpu()
        if not bool((every == every[0]).all()):
            raise RankDivergence(f"tensor-parallel ranks disagree on {what}: fingerprints "
                                 f"{every.tolist()} (rank order)")

    @property
    def _device(self) -> torch.device:
        backend = dist.get_backend(self.group) if self.size > 1 else "gloo"
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
            else torch.device("cpu")

    def _count(self, t0: float, t: torch.Tensor | None) -> None:
        timer = self.timer
        if timer.enabled:
            timer.seconds += time.perf_counter() - t0
            timer.calls += 1
            if t is not None:
                timer.bytes += t.numel() * t.element_size()


#: A group of one: what tp_size=1 code holds (never touches torch.distributed).
SINGLE = TensorParallel(rank=0, size=1)


def init_group(config: DistConfig,
               peers_failed: Callable[[], str | None] | None = None) -> TensorParallel:
    """Join the group ``config`` describes (blocks until all ``tp_size`` ranks arrive).

    Rank 0 serves the TCP store at ``config.init_addr``. The rendezvous waits at most
    ``config.startup_s`` for every rank to reach the store (ranks still starting their
    interpreters on a busy machine are not dead), then forms the group, whose collectives wait
    at most ``config.timeout_s`` for a peer. ``peers_failed``
    (rank 0's :meth:`RankProcesses.failed`): polled while waiting, so a worker rank that
    dies during start-up fails the rendezvous at once with its exit status. Sets this rank's
    torch threads (``config.threads``) and, on CUDA, its device and NCCL's asynchronous error
    handling (``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, torch's documented switch, so a hung
    collective raises instead of blocking forever). Raises :class:`RankFailure` when the
    rendezvous fails or times out, ``RuntimeError`` when a default group already exists.
    """
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed default group already exists in this process; "
                           "one tensor-parallel engine per process")
    if config.threads is not None and config.device == "cpu":
        torch.set_num_threads(config.threads)
    if config.device == "cuda":
        torch.cuda.set_device(config.torch_device)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    host, port = parse_addr(config.init_addr)
    started = time.monotonic()

    def fail(why: str) -> RankFailure:
        return RankFailure(f"rank {config.rank} of {config.tp_size} could not join the group at "
                           f"{config.init_addr} within {time.monotonic() - started:.1f}s "
                           f"(start-up timeout {config.startup_s:g}s, dist_timeout "
                           f"{config.timeout_s:g}s): {why}")

    outcome: list[BaseException | None] = []
    stores: list[Any] = []

    def rendezvous() -> None:
        try:
            startup = timedelta(seconds=config.startup_s)
            store = dist.TCPStore(host, port, config.tp_size, config.rank == 0, startup,
                                  wait_for_workers=False)
            stores.append(store)
            # every rank reaches the store before any joins the group: the group's own
            # rendezvous then waits for no straggler under the (short) collective timeout
            store.set(f"specdial/joined/{config.rank}", "1")
            store.wait([f"specdial/joined/{r}" for r in range(config.tp_size)], startup)
            dist.init_process_group(
                backend=config.backend, store=store, world_size=config.tp_size,
                rank=config.rank, timeout=timedelta(seconds=config.timeout_s))
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            outcome.append(e)

    thread = threading.Thread(target=rendezvous, name="specdial-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        why = peers_failed() if peers_failed is not None and thread.is_alive() else None
        if why is not None:
            raise fail(why)  # the rendezvous thread gives up on its own at the timeout
    error = outcome[0] if outcome else RuntimeError("rendezvous thread ended without a result")
    if error is not None:
        raise fail(f"{type(error).__name__}: {error}") from error
    return TensorParallel(rank=config.rank, size=config.tp_size, timeout_s=config.timeout_s,
                          config=config, store=stores[0])


def destroy_group() -> None:
    """Leave the default group if this process joined one (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
