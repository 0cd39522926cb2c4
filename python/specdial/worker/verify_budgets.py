"""Per-request verify budgets (issue 28): a packed verify and draft levels per request.

A decode plan at ``steps = k`` gives each request its verify budget ``v_r`` in ``0..k``
(``steps_per_request``; 0 is a plain decode through verify) and KV slots for its own
``v_r + 1`` tokens only. The worker keeps the padded ``[B, k + 1]`` layout for what is cheap
(the input buffers, acceptance, the emitted tokens) and removes the padding from what costs:

- :class:`PackedVerify`: the target runs only each request's ``v_r + 1`` tokens
  (``qo_lens = v_r + 1``, ``kv_lens = L + v_r + 1``; no padding through the model, not only
  through attention). The packed tokens are gathered from the padded inputs after drafting,
  and the outputs are scattered back to the padded layout with each request's columns beyond
  ``v_r`` repeating column ``v_r`` (never read for what it emits:
  :func:`~specdial.worker.sampling.speculative_accept` with ``limits``).
- :class:`DraftLevels`: draft level ``j`` (1-based) runs only for the requests with
  ``v_r >= j``, so a request with ``v_r = 0`` runs no draft forward and the batch drafts only
  up to ``max(v_r)`` levels. A level's forward runs over its requests only; its logits are
  scattered into the full batch, so sampling, processors and seeded keys see the same
  ``[B, V]`` rows as before (the draws' shapes do not change).

Both are eager-path tools: the CUDA-graph path stays keyed by ``(steps, padded batch size)``
and replays a heterogeneous batch padded; a batch no graph serves runs packed (see
``docs/ARCHITECTURE.md``, "Verify budgets").
Host arrays numpy int64, device tensors int64; no device sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specdial.models.batch import ForwardBatch

__all__ = ["DraftLevels", "PackedVerify"]


@dataclass
class PackedVerify:
    """The packed verify of a batch whose budgets are not all ``k``.

    ``index`` ``[T]`` (``T = sum(v_r + 1)``): flat index of each packed token into the padded
    ``[B * (k + 1)]`` verify inputs; ``unpack`` ``[B * (k + 1)]``: the packed row each padded
    column reads (column ``j`` of request ``b`` reads ``min(j, v_b)``); ``attn``: the
    metadata planned for ``qo_lens = v + 1``, ``kv_lens = L + v + 1``.
    """

    index: torch.Tensor
    unpack: torch.Tensor
    attn: Any

    @staticmethod
    def indices(budgets: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``(index [sum(v + 1)], unpack [B * n])`` host int64 for budgets ``v`` ``[B]`` in
        ``0..n - 1`` (see the class docstring)."""
        v = np.asarray(budgets, np.int64)
        cols = np.arange(n, dtype=np.int64)[None, :]
        flat = np.arange(len(v) * n, dtype=np.int64).reshape(len(v), n)
        index = flat[cols <= v[:, None]]
        starts = np.cumsum(v + 1) - (v + 1)
        unpack = starts[:, None] + np.minimum(cols, v[:, None])
        return index, unpack.reshape(-1)

    def batch(self, padded: ForwardBatch) -> ForwardBatch:
        """The packed forward batch of the padded verify inputs (read after drafting)."""
        i = self.index
        return ForwardBatch(padded.input_ids[i], padded.positions[i], padded.out_loc[i],
                            self.attn)

    def expand(self, packed: torch.Tensor | None) -> torch.Tensor | None:
        """Packed outputs ``[T, ...]`` -> padded ``[B * n, ...]`` (None stays None)."""
        return None if packed is None else packed.index_select(0, self.unpack)


@dataclass
class DraftLevels:
    """Which requests draft each level: ``active[i]`` ``[B_i]`` device indices into the batch
    of the requests with ``v_r > i`` (level ``i + 1``; ascending), ``levels`` = ``max(v_r)``
    (the draft forwards that run), ``first_ids`` ``[B]``: every request's ``x_L`` (the
    processors' history of level 1)."""

    active: list[torch.Tensor]
    levels: int
    first_ids: torch.Tensor

    @staticmethod
    def members(budgets: np.ndarray, k: int) -> list[np.ndarray]:
        """Host indices of the requests drafting each level ``1..max(v)`` (at most ``k``)."""
        v = np.asarray(budgets, np.int64)
        top = int(min(k, v.max(initial=0)))
        return [np.flatnonzero(v > i) for i in range(top)]
