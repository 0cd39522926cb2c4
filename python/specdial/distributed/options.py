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
"""

from __future__ import annotations

from dataclasses import dataclass

from specdial.distributed.group import DEFAULT_TIMEOUT_S, DistConfig, free_port, parse_addr

__all__ = ["ParallelOptions"]


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
