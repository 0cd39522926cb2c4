"""The tensor-parallel process group: typed settings, rendezvous, collectives with a deadline.

One :class:`DistConfig` describes a rank's place in the group: ``tp_size`` ranks in all, spread
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
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from specdial.engine.config import EngineConfig

__all__ = ["DistConfig", "TensorParallel", "RankFailure", "RankDivergence", "CollectiveTimer", "init_group",
           "free_port", "parse_addr", "DEFAULT_TIMEOUT_S"]

#: Seconds a collective may wait for a peer before the rank gives up (SGLang's
#: ``--dist-timeout`` has no default and falls back to torch's 30 minutes; a serving engine that
#: must report a dead rank wants far less).
DEFAULT_TIMEOUT_S = 60.0

#: Seconds the start-up may take: the rendezvous (ranks still starting their interpreters) and
#: each rank loading its models (:mod:`specdial.distributed.liveness`). ``dist_timeout``
#: applies to every collective; a rank slower to start is not taken for a dead one.
DEFAULT_STARTUP_TIMEOUT_S = 600.0


class RankFailure(RuntimeError):
    """A tensor-parallel peer died, hung past the timeout, or the group could not be formed.

    The message says which collective failed, after how long, and the transport's reason.
    """


class RankDivergence(RuntimeError):
    """Ranks computed different values where they must agree (e.g. the accepted tokens of an
    iteration); the engine cannot continue consistently."""


def parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; ``ValueError`` naming ``dist_init_addr`` otherwise.

    IPv6 hosts go in brackets (``[::1]:5000``), as in SGLang's ``--dist-init-addr``.
    """
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"dist_init_addr must be 'host:port' with a port in 1..65535, "
                         f"got {addr!r}")
    return host.strip("[]"), int(port)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it; a race is possible but
    the rendezvous then fails loudly rather than joining a stranger)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class DistConfig:
    """Where one rank stands in a tensor-parallel group.

    - ``tp_size``: ranks in the group (>= 1); ``rank``: this rank, ``0 <= rank < tp_size``;
      rank 0 owns the scheduler and serves the TCP store.
    - ``init_addr``: ``host:port`` of rank 0's TCP store (SGLang's ``--dist-init-addr``).
    - ``nnodes`` / ``node_rank``: nodes in all and this node's index; ``tp_size`` must be a
      multiple of ``nnodes`` and ranks ``node_rank * per_node ..`` live on this node.
    - ``timeout_s``: seconds a rendezvous or collective waits for a peer (``--dist-timeout``).
    - ``device``: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL; rank ``r`` uses GPU ``r % per_node``).
    - ``threads``: torch intra-op threads for this rank on the CPU (None: leave torch's).
    - ``startup_timeout_s``: seconds the rendezvous and each start-up barrier wait for the
      slowest rank (at least ``timeout_s`` is used; default
      :data:`DEFAULT_STARTUP_TIMEOUT_S`).

    Raises ``ValueError`` naming the field for any value outside these ranges.
    """

    tp_size: int
    rank: int
    init_addr: str
    nnodes: int = 1
    node_rank: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S
    device: str = "cpu"
    threads: int | None = 1
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("tp_size", "nnodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size ({self.tp_size}) must be a multiple of nnodes "
                             f"({self.nnodes}): each node runs the same number of ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank must be in 0..{self.tp_size - 1}, got {self.rank}")
        if self.rank // self.ranks_per_node != self.node_rank:
            raise ValueError(f"rank {self.rank} does not live on node {self.node_rank} "
                             f"({self.ranks_per_node} ranks per node)")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"dist_timeout must be a positive number of seconds, "
                             f"got {self.timeout_s!r}")
        if not (isinstance(self.startup_timeout_s, (int, float))
                and self.startup_timeout_s > 0):
            raise ValueError(f"startup_timeout_s must be a positive number of seconds, "
                             f"got {self.startup_timeout_s!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' for tensor parallelism, "
                             f"got {self.device!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be a positive integer or None, got {self.threads!r}")
        parse_addr(self.init_addr)

    @property
    def startup_s(self) -> float:
        """Seconds a start-up wait may take: ``max(startup_timeout_s, timeout_s)``."""
        return float(max(self.startup_timeout_s, self.timeout_s))

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The ranks that run on this node."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    @property
    def backend(self) -> str:
        """``"nccl"`` on CUDA, ``"gloo"`` on the CPU."""
        return "nccl" if self.device == "cuda" else "gloo"

    @property
    def torch_device(self) -> torch.device:
        """This rank's device (CUDA: ``cuda:<rank % ranks_per_node>``)."""
        if self.device == "cuda":
            return torch.device("cuda", self.rank % self.ranks_per_node)
        return torch.device("cpu")


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
