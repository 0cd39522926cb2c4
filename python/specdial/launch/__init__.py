"""Running one engine over several processes or replicas: above the engine, below the server's
and the CLI's entry points (docs/ARCHITECTURE.md, "Layers").

- :mod:`specdial.launch.launcher`: :func:`launch_ranks` (worker ranks as
  ``python -m specdial.launch.rank`` subprocesses that exit when rank 0 does);
- :mod:`specdial.launch.node`: a node's ranks (node 0 joins as rank 0, other nodes only compute);
- :mod:`specdial.launch.tp_engine`: the tensor-parallel engine (rank 0's runtime, the worker
  ranks' entry);
- :mod:`specdial.launch.data_parallel`: ``dp_size`` replicas behind one front end, routed by
  :mod:`specdial.launch.routing`; each replica a process
  (:mod:`specdial.launch.replica_main`, reached through
  :mod:`specdial.launch.replica_client` over :mod:`specdial.launch.replica_wire`; what each
  gets: :mod:`specdial.launch.replica_setup`);
- :mod:`specdial.launch.check` (``python -m specdial.launch.check``) and
  :mod:`specdial.launch.probe`: consistency checks and collective probes.

The group itself and its collectives are below the models, in :mod:`specdial.distributed`.
"""

from specdial.launch.launcher import RankProcesses, launch_ranks

__all__ = ["RankProcesses", "launch_ranks"]
