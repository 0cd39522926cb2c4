"""The ``cuda_graph_bs`` option: SGLang's default capture sizes and the check of a user's list.

Settings, not machinery: :class:`~specdial.config.engine.EngineConfig` checks the option with
:func:`normalize_graph_bs` when it is built, the command line shows the defaults, and the worker
(:mod:`specdial.worker.graph_tables`) captures the graphs. No torch or numpy import here.
"""

from __future__ import annotations

import numbers
from typing import Iterable

__all__ = ["default_cuda_graph_bs", "normalize_graph_bs"]


def default_cuda_graph_bs(max_running_requests: int) -> list[int]:
    """SGLang's default CUDA-graph batch sizes, capped at ``max_running_requests``.

    Rule (SGLang ``ServerArgs._generate_cuda_graph_batch_sizes``, non-speculative branch):
    ``[1, 2, 4, 8, 12] + range(16, 257, 8) + range(272, 512, 16) + range(512, max + 1, 32)``,
    keeping sizes ``<= max_running_requests``. One deviation: ``max_running_requests`` itself is
    appended when the grid misses it, so a full batch still replays a graph (SGLang leaves the
    last sizes above its largest grid point to eager mode). Raises ``ValueError`` below 1.
    """
    if isinstance(max_running_requests, bool) or not isinstance(max_running_requests, int) \
            or max_running_requests < 1:
        raise ValueError(f"max_running_requests must be an int >= 1, got {max_running_requests!r}")
    grid = ([1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16))
            + list(range(512, max_running_requests + 1, 32)))
    sizes = [s for s in grid if s <= max_running_requests]
    if sizes[-1] != max_running_requests:
        sizes.append(max_running_requests)
    return sizes


def normalize_graph_bs(sizes: Iterable[int]) -> tuple[int, ...]:
    """Sorted, deduplicated batch sizes; ``ValueError`` for an empty list or a size < 1.

    Integers are Python ints or numpy integers (both are :class:`numbers.Integral`); bools are
    refused."""
    out = []
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1:
            raise ValueError(f"cuda_graph_bs: batch sizes must be ints >= 1, got {s!r}")
        out.append(int(s))
    if not out:
        raise ValueError("cuda_graph_bs is empty")
    return tuple(sorted(set(out)))
