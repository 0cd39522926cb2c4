"""The parallelism options of an engine, with SGLang's and vLLM's names.

================================  =================  ==========================================
option (flag)                     alias              meaning
================================  =================  ==========================================
``tp_size`` (``--tp-size``)       vLLM's             ranks that shard one engine's models
                                  ``--tensor-
                                  parallel-size``
``dp_size`` (``--dp-size``)                          engine replicas behind one front end
``nnodes`` (``--nnodes``)                            nodes the ``tp_size`` ranks spread over
``node_rank`` (``--node-rank``)                      this node (0 serves; others only compute)
``dist_init_addr``                                   ``host:port`` of node 0's rendezvous
(``--dist-init-addr``)                               (default: 127.0.0.1 and a free port, one
                                                     node only)
``dist_timeout``                                     seconds a rank waits for a peer before
(``--dist-timeout``)                                 the engine fails (default 60)
================================  =================  ==========================================

:meth:`ParallelOptions.dist_config` turns them into one rank's :class:`DistConfig` (its place in
the tensor-parallel group, what :func:`specdial.distributed.group.init_group` joins). Both are
plain typed settings of the bottom layer (see docs/ARCHITECTURE.md, "Layers"): no torch import
here, so the command line reads and checks them without loading it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only the annotation of DistConfig.torch_device
    import torch

__all__ = ["DEFAULT_STARTUP_TIMEOUT_S", "DEFAULT_TIMEOUT_S", "DistConfig", "ParallelOptions",
           "free_port", "parse_addr"]

#: Seconds a collective may wait for a peer before the rank gives up (SGLang's
#: ``--dist-timeout`` has no default and falls back to torch's 30 minutes; a serving engine that
#: must report a dead rank wants far less).
DEFAULT_TIMEOUT_S = 60.0

#: Seconds the start-up may take: the rendezvous (ranks still starting their interpreters) and
#: each rank loading its models (:mod:`specdial.distributed.liveness`). ``dist_timeout``
#: applies to every collective; a rank slower to start is not taken for a dead one.
DEFAULT_STARTUP_TIMEOUT_S = 600.0


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
    def torch_device(self) -> "torch.device":
        """This rank's device (CUDA: ``cuda:<rank % ranks_per_node>``); imports torch (this
        module does not, so that the command line reads the options without loading it)."""
        import torch

        if self.device == "cuda":
            return torch.device("cuda", self.rank % self.ranks_per_node)
        return torch.device("cpu")



def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class ParallelOptions:
    """Validated parallelism options (table in the module docstring).

    Raises ``ValueError`` naming the option for: sizes below 1, ``tp_size`` not a multiple of
    ``nnodes``, ``node_rank`` outside ``0..nnodes-1``, several nodes without
    ``dist_init_addr``, a malformed address, a non-positive timeout, or ``dp_size > 1`` with
    several nodes (replicas run on node 0).
    """

    tp_size: int = 1
    dp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("tp_size", "dp_size", "nnodes"):
            _positive_int(name, getattr(self, name))
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size ({self.tp_size}) must be a multiple of nnodes "
                             f"({self.nnodes}): every node runs tp_size / nnodes ranks")
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int) or not (
                0 <= self.node_rank < self.nnodes):
            raise ValueError(f"node_rank must be in 0..{self.nnodes - 1}, got {self.node_rank!r}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("dist_init_addr (host:port of node 0) is required with nnodes > 1")
        if self.dist_init_addr is not None:
            parse_addr(self.dist_init_addr)
        if isinstance(self.dist_timeout, bool) or not isinstance(
                self.dist_timeout, (int, float)) or not self.dist_timeout > 0:
            raise ValueError(f"dist_timeout must be a positive number of seconds, "
                             f"got {self.dist_timeout!r}")
        if self.dp_size > 1 and self.nnodes > 1:
            raise ValueError("dp_size > 1 runs its replicas on one node; use nnodes=1")

    @property
    def distributed(self) -> bool:
        """True when the models are sharded over more than one rank."""
        return self.tp_size > 1

    def dist_config(self, rank: int, device: str = "cpu", threads: int | None = 1,
                    init_addr: str | None = None) -> DistConfig:
        """The :class:`DistConfig` of ``rank``; ``init_addr`` overrides ``dist_init_addr``
        (rank 0 resolves a default address once with :meth:`resolve_addr` and passes it)."""
        addr = init_addr or self.dist_init_addr
        if addr is None:
            raise ValueError("no rendezvous address: call resolve_addr() first")
        return DistConfig(tp_size=self.tp_size, rank=rank, init_addr=addr, nnodes=self.nnodes,
                          node_rank=rank // (self.tp_size // self.nnodes),
                          timeout_s=float(self.dist_timeout), device=device, threads=threads)

    def resolve_addr(self) -> str:
        """``dist_init_addr``, or ``127.0.0.1:<a free port>`` on one node."""
        return self.dist_init_addr or f"127.0.0.1:{free_port()}"
