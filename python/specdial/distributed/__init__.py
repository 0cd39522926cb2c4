"""The tensor-parallel group and what travels over it: the collectives the sharded models call,
and rank 0's one control message per iteration. A low layer (docs/ARCHITECTURE.md, "Layers"):
it imports only :mod:`specdial.config`, as SGLang's and vLLM's ``distributed`` packages hold
their process groups and collectives.

- :mod:`specdial.distributed.group`: :func:`init_group`, :class:`TensorParallel` (collectives
  with a deadline), :class:`RankFailure`, :class:`RankDivergence`; the group's settings,
  :class:`DistConfig`, live in :mod:`specdial.config.parallel`;
- :mod:`specdial.distributed.channel`: rank 0's control messages (:class:`Leader`);
- :mod:`specdial.distributed.mirror`: rank 0's worker calls, replayed on the other ranks;
- :mod:`specdial.distributed.liveness`: start-up barriers and heartbeats.

Starting rank processes, the tensor-parallel engine and the data-parallel replicas are above the
engine, in :mod:`specdial.launch`; how the models are sharded is
:mod:`specdial.models.tensor_parallel`.
"""

from specdial.distributed.group import (DEFAULT_TIMEOUT_S, DistConfig, RankFailure,
                                        TensorParallel, init_group)

__all__ = ["DEFAULT_TIMEOUT_S", "DistConfig", "RankFailure", "TensorParallel", "init_group"]
