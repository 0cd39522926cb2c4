"""What the worker keeps for the drafter: its valid length per row and the target features.

The drafter's length rules, in one place (the positions they talk about are described in
:mod:`specdial.worker.drafters`; ``L`` is a request's target length, which the scheduler's
plan gives every iteration and the worker never stores):

- ``draft_len[row]``: positions ``0 .. draft_len - 1`` of the row hold drafter KV computed
  from the true sequence. A row whose prefill chunk starts at position 0 restarts at 0
  (:meth:`DrafterState.restart`).
- Every catch-up (:meth:`DrafterState.catch_up`, KV only) runs the drafter over
  ``[draft_len, L)`` and sets ``draft_len = L``: after a prefill chunk (the drafter prefill),
  before drafting (only non-empty after skipped zero-step extends or deferred drafter
  prefills) and as the draft extend after a verify.
- After drafting ``k >= 1`` at ``L`` and a verify accepting ``a``, before the extend:
  ``draft_len = Drafter.draft_len_after_verify(L, k, a)``, each drafter's own rule (what its
  draft forwards wrote from true inputs; :mod:`specdial.worker.drafters`).
- At ``steps = 0`` with ``skip_zero_step_draft_extend`` (the engine's default; the plan's
  ``skip_extend`` carries it) nothing runs and ``draft_len`` lags; the next drafting iteration's catch-up covers the gap, in forwards
  of at most ``max_extend_tokens`` tokens; without it the extend runs every iteration (SGLang
  PR #23994).

Target features (EAGLE's input): ``features[kv_slot]`` is the target's feature of the token at
that KV slot, written by the prefill and verify forwards; row ``num_kv_slots`` is the pad
sentinel and row ``num_kv_slots + 1`` (:attr:`DrafterState.zero_row`) stays zero (the
``h_{-1}`` of position 0). Host arrays numpy int64; no per-request Python on the device path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from specdial.worker.drafters import Drafter
from specdial.worker.runtime import DecodeBatches, RequestTables
from specdial.worker.step_runner import StepRunner

__all__ = ["DrafterState"]


class DrafterState:
    """The drafter's per-row valid length and the per-KV-slot target features.

    - ``drafter``: the :class:`Drafter`; ``backend``: the attention backend of the passes.
    - ``max_bs``: rows; ``num_kv_slots``: KV slots of the pools (features get two more rows).
    - ``dtype`` / ``device``: of the features ``[num_kv_slots + 2, feature_size]`` (None when
      the drafter reads no target features).
    - ``max_extend_tokens``: most tokens of one catch-up forward (``ValueError`` if < 1).
    """

    def __init__(self, drafter: Drafter, backend: Any, *, max_bs: int, num_kv_slots: int,
                 dtype: torch.dtype, device: torch.device, max_extend_tokens: int) -> None:
        if max_extend_tokens < 1:
            raise ValueError(f"max_extend_tokens must be >= 1, got {max_extend_tokens}")
        self.drafter, self.backend = drafter, backend
        self.max_extend_tokens = max_extend_tokens
        #: positions of each row with valid drafter KV (host int64 ``[max_bs]``)
        self.draft_len = np.zeros(max_bs, np.int64)
        self.zero_row = num_kv_slots + 1
        self.features: torch.Tensor | None = None
        if drafter.feature_size is not None:
            self.features = torch.zeros(num_kv_slots + 2, drafter.feature_size, dtype=dtype,
                                        device=device)

    def restart(self, rows: np.ndarray) -> None:
        """Rows (re)starting at position 0 have no drafter KV."""
        self.draft_len[rows] = 0

    def store_features(self, kv_slots: torch.Tensor, feats: torch.Tensor | None) -> None:
        """Keep the target's features ``[N, F]`` of the tokens written to ``kv_slots``
        ``[N]`` (a prefill or verify forward's ``out_loc``)."""
        if self.features is not None and feats is not None:
            self.features.index_copy_(0, kv_slots, feats)

    def first_hidden(self, tables: RequestTables, batches: DecodeBatches) -> torch.Tensor | None:
        """EAGLE's ``h_{L-1}`` per request ``[B, F]`` (draft step 1's input), or None."""
        if self.features is None:
            return None
        prev = tables.req_to_token[batches.rows, batches.verify_positions[:, 0] - 1]
        return self.features[prev]

    def after_verify(self, rows: np.ndarray, target_len: np.ndarray,
                     steps: np.ndarray | int, accepted: np.ndarray) -> None:
        """The drafter's valid length after drafting ``steps`` levels per request (host
        ``[B]``, the verify budgets, or one value) at ``target_len`` and a verify accepting
        ``accepted`` (host ``[B]``)."""
        self.draft_len[rows] = self.drafter.draft_len_after_verify(target_len, steps, accepted)

    def catch_up(self, rows: np.ndarray, ends: np.ndarray, state: StepRunner,
                 batches: DecodeBatches | None = None) -> None:
        """Drafter over ``[draft_len, ends)`` of ``rows`` (``ends``: the rows' target lengths
        from the plan), KV only: one forward (through the runner's graph path when
        ``batches`` carry a KV layout), or, for a catch-up longer than ``max_extend_tokens``,
        eager forwards of at most that many tokens each, so its activations stay bounded like
        a prefill chunk's."""
        start, end = self.draft_len[rows], ends
        todo = end > start
        if not todo.any():
            return
        short = int((end - start)[todo].sum()) <= self.max_extend_tokens
        if short and batches is not None and batches.layout is not None:
            state.run_extend(batches, rows, start, end, self.features, self.zero_row)
            self.draft_len[rows] = np.maximum(start, end)
            return
        rows, start, end = rows[todo], start[todo], end[todo]
        while len(rows):
            stop = np.minimum(end, start + max(1, self.max_extend_tokens // len(rows)))
            self.extend_eager(rows, start, stop, state)
            left = stop < end
            rows, start, end = rows[left], stop[left], end[left]

    def extend_eager(self, rows: np.ndarray, start: np.ndarray, end: np.ndarray,
                     state: StepRunner) -> None:
        """One ragged drafter forward over ``[start, end)`` of ``rows`` (all non-empty)."""
        zero = None if self.features is None else self.zero_row
        batch, hidden_rows = state.prepare_ragged(rows, start, end, zero)
        feats = (None if hidden_rows is None or self.features is None
                 else self.features[hidden_rows])
        if int(start.max()) == 0:
            self.drafter.prefill(batch, self.backend, hidden_states=feats)
        else:
            self.drafter.extend(batch, self.backend, hidden_states=feats, kv_only=True)
        self.draft_len[rows] = end
