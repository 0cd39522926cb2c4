"""Starting a node's ranks: node 0 joins as rank 0 and starts its other local ranks; every
other node starts all of its ranks and waits for them.

Node ``k`` of ``nnodes`` holds ranks ``k * per_node .. (k + 1) * per_node - 1``
(``per_node = tp_size // nnodes``), all rendezvousing at node 0's ``dist_init_addr`` (SGLang's
``--nnodes`` / ``--node-rank`` / ``--dist-init-addr``). Nodes other than 0 run only worker
ranks: they serve no requests and end when their ranks end (rank 0's shutdown message, or a
:class:`~specdial.distributed.group.RankFailure` within ``dist_timeout`` when node 0 is gone).
"""

from __future__ import annotations

from typing import Any

from specdial.distributed.group import TensorParallel, init_group
from specdial.launch.launcher import RankProcesses, launch_ranks
from specdial.config.parallel import ParallelOptions

__all__ = ["start_rank0", "run_worker_node"]


def start_rank0(options: ParallelOptions, entry: str, args: dict[str, Any], *,
                device: str = "cpu", threads: int | None = 1,
                stderr: Any = None) -> tuple[TensorParallel, RankProcesses]:
    """Node 0: start local ranks ``1..per_node-1`` running ``entry(tp, config, **args)``
    and join the group as rank 0 (this process). Returns ``(tp, processes)``; the caller
    closes the processes when done. Raises :class:`~specdial.distributed.group.RankFailure`
    when the group does not form within ``dist_timeout`` (a local rank that dies during
    start-up fails it at once); the started ranks are stopped then."""
    if options.node_rank != 0:
        raise ValueError(f"start_rank0 runs on node 0, this is node {options.node_rank}")
    addr = options.resolve_addr()
    config = options.dist_config(0, device, threads, addr)
    procs = launch_ranks(config, config.local_ranks[1:], entry, args, stderr=stderr)
    try:
        tp = init_group(config, procs.failed)
    except BaseException:
        procs.close(grace_s=1.0)
        raise
    return tp, procs


def run_worker_node(options: ParallelOptions, entry: str, args: dict[str, Any], *,
                    device: str = "cpu", threads: int | None = 1) -> int:
    """Node ``node_rank > 0``: start all its ranks running ``entry`` and wait for them.
    Returns 0 when every rank exited with 0, else the first non-zero exit status (a rank that
    lost its peers exits with 2). Ctrl-C stops them."""
    if options.node_rank == 0:
        raise ValueError("run_worker_node runs on nodes 1..nnodes-1; node 0 serves")
    config = options.dist_config(options.node_rank * (options.tp_size // options.nnodes),
                                 device, threads)
    with launch_ranks(config, config.local_ranks, entry, args) as procs:
        codes = [p.wait() for p in procs.procs.values()]
    return next((c for c in codes if c), 0)
