"""CUDA-graph capture sizes and the capture plan (which ``(steps, batch size)`` keys get graphs).

On a GPU the launch overhead of a decode iteration (hundreds of small kernels) decides whether
speculation pays, so serving engines replay CUDA graphs. The adaptive design adds two rules
(SGLang PR #24055): every steps value the policy can choose needs its graphs ready, and graphs
that no batch-size slot can reach are not captured (:class:`CapturePlan`, pruned with
``AdaptiveSpeculativeParams.cuda_graph_bs_for_step``).

- :func:`default_cuda_graph_bs`: SGLang's default capture sizes, capped at
  ``max_running_requests``; :func:`normalize_graph_bs` validates a user's list (both defined
  with the options, :mod:`specdial.config.cuda_graph`).
- :class:`CapturePlan`: per candidate steps value, the batch sizes to capture (largest first)
  and the passes per size: ``draft`` (``steps >= 1``), ``verify``, ``extend`` (draft extend,
  KV only; only with a drafter).

Pure tables: no tensors, no torch import (the CLI reads the defaults without loading torch).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from specdial._core import AdaptiveConfig, AdaptiveSpeculativeParams
# the option's defaults and check live with the options; re-exported for the worker's callers
from specdial.config.cuda_graph import default_cuda_graph_bs, normalize_graph_bs

#: the passes of one graph key, in replay order
PASSES = ("draft", "verify", "extend")


def _graph_sizes_of(policy: AdaptiveSpeculativeParams | AdaptiveConfig | Mapping | None,
                    graph_bs: tuple[int, ...], steps: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """Per steps value, the sizes whose batch-size slot can choose it (from the Rust policy)."""
    if isinstance(policy, AdaptiveSpeculativeParams):
        params = policy
    else:
        config = policy if isinstance(policy, AdaptiveConfig) else AdaptiveConfig.from_dict(
            dict(policy))  # type: ignore[arg-type]
        params = AdaptiveSpeculativeParams(config.candidate_steps[0], config)
        params.set_cuda_graph_bs(list(graph_bs))
    out: dict[int, tuple[int, ...]] = {}
    for s in steps:
        sizes = params.cuda_graph_bs_for_step(s)
        if sizes is None:
            raise ValueError("the policy has no CUDA-graph sizes: call "
                             "params.set_cuda_graph_bs(cuda_graph_bs) before building the plan")
        stray = set(sizes) - set(graph_bs)
        if stray:
            raise ValueError(f"the policy's CUDA-graph sizes include {sorted(stray)}, not in "
                             f"cuda_graph_bs {list(graph_bs)}: give both the same list")
        out[s] = tuple(sorted(sizes, reverse=True))
    return out


@dataclass(frozen=True)
class CapturePlan:
    """Which graphs to capture: per steps value the batch sizes, largest first.

    - ``graph_bs``: every capture size (ascending), the list the Rust side pads to.
    - ``sizes``: ``{steps: (bs, ...)}`` descending; with pruning only the sizes whose
      batch-size slot has ``steps`` among its candidates (a padded batch routes to the slot of
      its padded size), without pruning every size for every steps value.
    - ``pruned``, ``has_drafter`` (without a drafter only ``verify`` graphs exist).
    """

    graph_bs: tuple[int, ...]
    sizes: dict[int, tuple[int, ...]]
    pruned: bool
    has_drafter: bool = True

    @classmethod
    def build(cls, step_values: Iterable[int], graph_bs: Iterable[int],
              policy: AdaptiveSpeculativeParams | AdaptiveConfig | Mapping | None = None, *,
              prune: bool = True, has_drafter: bool = True) -> "CapturePlan":
        """Plan for ``step_values`` (the runtime states) and ``graph_bs``.

        ``policy``: the adaptive policy (its ``cuda_graph_bs_for_step`` prunes; an
        ``AdaptiveSpeculativeParams`` must already have ``set_cuda_graph_bs(graph_bs)``), an
        ``AdaptiveConfig`` / config dict (a private policy object is built for the query), or
        None (fixed steps: every size). Raises ``ValueError`` for bad sizes, negative steps,
        positive steps without a drafter, or a policy with other sizes.
        """
        steps = sorted(set(int(s) for s in step_values))
        if not steps or steps[0] < 0:
            raise ValueError(f"step values must be ints >= 0, got {steps}")
        if not has_drafter and steps != [0]:
            raise ValueError(f"without a drafter only steps 0 exists, got {steps}")
        sizes_all = normalize_graph_bs(graph_bs)
        if prune and policy is not None:
            sizes = _graph_sizes_of(policy, sizes_all, steps)
        else:
            sizes = {s: tuple(reversed(sizes_all)) for s in steps}
        return cls(sizes_all, sizes, bool(prune and policy is not None), has_drafter)

    @property
    def max_steps(self) -> int:
        return max(self.sizes)

    @property
    def max_bs(self) -> int:
        return self.graph_bs[-1]

    def passes(self, steps: int) -> tuple[str, ...]:
        """The graphs of one ``(steps, bs)`` key, in replay order."""
        if not self.has_drafter:
            return ("verify",)
        return (("draft",) if steps >= 1 else ()) + ("verify", "extend")

    def order(self) -> list[tuple[int, int]]:
        """Every ``(steps, bs)`` key to capture, largest batch first (then largest steps), so
        later, smaller graphs reuse the shared pool's blocks."""
        keys = [(s, bs) for s, sizes in self.sizes.items() for bs in sizes]
        return sorted(keys, key=lambda k: (-k[1], -k[0]))

    @property
    def num_graphs(self) -> int:
        return sum(len(self.passes(s)) for s, _ in self.order())

    def padded_bs(self, steps: int, batch_size: int) -> int | None:
        """Smallest captured size ``>= batch_size`` for ``steps``, None above (eager)."""
        sizes = sorted(self.sizes.get(steps, ()))
        i = bisect.bisect_left(sizes, batch_size)
        return sizes[i] if i < len(sizes) else None

    def to_dict(self) -> dict[str, Any]:
        return {"graph_bs": list(self.graph_bs), "pruned": self.pruned,
                "sizes": {str(s): list(v) for s, v in sorted(self.sizes.items())},
                "num_graphs": self.num_graphs}


