"""Running past one device: tensor-parallel process groups, worker-rank processes, and data
parallel replicas behind one front end.

- :mod:`specdial.distributed.group`: :class:`DistConfig`, :func:`init_group`,
  :class:`TensorParallel` (collectives with a deadline), :class:`RankFailure`;
- :mod:`specdial.distributed.launcher`: :func:`launch_ranks` (worker ranks as
  ``python -m specdial.distributed.rank`` subprocesses that exit when rank 0 does);
- :mod:`specdial.models.tensor_parallel`: how the models are sharded.
"""

from specdial.distributed.group import (DEFAULT_TIMEOUT_S, DistConfig, RankFailure,
                                        TensorParallel, init_group)
from specdial.distributed.launcher import RankProcesses, launch_ranks

__all__ = ["DEFAULT_TIMEOUT_S", "DistConfig", "RankFailure", "TensorParallel", "init_group",
           "RankProcesses", "launch_ranks"]
