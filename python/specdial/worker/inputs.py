"""What the worker reads of a scheduler plan, as plain dataclasses of host int64 arrays.

:func:`worker_input` builds a :class:`PrefillInput` or a :class:`DecodeInput` from a
:class:`specdial._core.SchedulePlan` in one place; :meth:`SpecWorker.prefill` /
:meth:`SpecWorker.decode <specdial.worker.worker.SpecWorker.decode>` take either the plan or the
input. Tests (and tools) can build the inputs by hand and drive the worker without a scheduler;
the worker needs only that KV slots are distinct per position and rows unique per batch.

Layout (``B`` requests, numpy ``int64`` arrays, request after request):

- :class:`PrefillInput`: request ``b`` computes KV positions ``kv_lens[b] - qo_lens[b] ..
  kv_lens[b]`` of row ``rows[b]`` (a chunk starting at 0 restarts the row); ``input_ids`` and
  ``out_loc`` have ``sum(qo_lens)`` entries (tokens and the KV slots they are written to);
  ``sample_first[b]`` = 1 where the request samples its first token, from the logits at
  ``logits_indices`` (indices into ``input_ids``, one per such request). ``cached_lens[b]``:
  positions ``0 .. cached_lens[b]`` its admission took from the prefix cache (None: none);
  a chunk starting there is an admission: the row restarts and those positions' KV slots
  (``cached_kv``) and token ids (``cached_ids``, ``[sum(cached_lens)]`` each) are filled in;
  the first ``cached_draft_lens[b]`` of them are drafter-covered (their pages carry the
  drafter's KV; None: all of them), the drafter runs over the rest like over a deferred
  prefill.
- :class:`DecodeInput`: request ``b`` has ``positions[b]`` = ``L`` KV positions and feeds
  ``input_ids[b]`` at ``L``; ``out_loc`` ``[B * (steps + 1)]`` holds the KV slots of positions
  ``L ..= L + steps`` (the pad KV slot beyond ``steps_per_request[b]``); ``graph_bs`` is the
  padded CUDA-graph batch size (None: eager); ``skip_extend[b]`` = 1 where the request (verify
  budget 0) skips the draft extend (None: none does); ``min_survival`` the confidence stop's
  threshold in ``[0, 1)`` (0: no rule; :mod:`specdial.worker.confidence_stop`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def _i64(arr: Any) -> np.ndarray:
    """A writable int64 numpy copy (the plan's own buffers are read-only)."""
    return np.array(arr, dtype=np.int64).reshape(-1)


def _check_len(name: str, arr: np.ndarray, n: int) -> None:
    if len(arr) != n:
        raise ValueError(f"{name}: expected {n} entries, got {len(arr)}")


@dataclass(frozen=True, eq=False)
class PrefillInput:
    """One prefill chunk batch (see the module docstring). Raises ``ValueError`` naming the
    field whose length does not match."""

    rows: np.ndarray
    input_ids: np.ndarray
    out_loc: np.ndarray
    qo_lens: np.ndarray
    kv_lens: np.ndarray
    sample_first: np.ndarray
    logits_indices: np.ndarray
    cached_lens: np.ndarray | None = None
    cached_kv: np.ndarray | None = None
    cached_ids: np.ndarray | None = None
    cached_draft_lens: np.ndarray | None = None

    def __post_init__(self) -> None:
        b, n = len(self.rows), int(self.qo_lens.sum())
        for name in ("qo_lens", "kv_lens", "sample_first"):
            _check_len(name, getattr(self, name), b)
        _check_len("input_ids", self.input_ids, n)
        _check_len("out_loc", self.out_loc, n)
        _check_len("logits_indices", self.logits_indices, int(self.sample_first.sum()))
        if self.cached_lens is not None:
            _check_len("cached_lens", self.cached_lens, b)
            c = int(self.cached_lens.sum())
            for name in ("cached_kv", "cached_ids"):
                arr = getattr(self, name)
                if arr is None:
                    raise ValueError(f"{name}: required with cached_lens")
                _check_len(name, arr, c)
        if self.cached_draft_lens is not None:
            if self.cached_lens is None:
                raise ValueError("cached_draft_lens: given without cached_lens")
            _check_len("cached_draft_lens", self.cached_draft_lens, b)
            if ((self.cached_draft_lens < 0) | (self.cached_draft_lens > self.cached_lens)).any():
                raise ValueError("cached_draft_lens: each entry must be in 0 ..= cached_lens[b], "
                                 f"got {self.cached_draft_lens.tolist()} for cached_lens "
                                 f"{self.cached_lens.tolist()}")

    def restarts(self) -> np.ndarray:
        """``[B]`` bool: the chunks that are admissions (first position == cached length)."""
        cached = 0 if self.cached_lens is None else self.cached_lens
        return self.kv_lens - self.qo_lens == cached


@dataclass(frozen=True, eq=False)
class DecodeInput:
    """One decode batch at ``steps`` drafts (see the module docstring). Raises ``ValueError``
    naming the field whose length does not match."""

    steps: int
    graph_bs: int | None
    rows: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    out_loc: np.ndarray
    steps_per_request: np.ndarray
    skip_extend: np.ndarray | None = None
    min_survival: float = 0.0

    def __post_init__(self) -> None:
        b = len(self.rows)
        for name in ("input_ids", "positions", "steps_per_request"):
            _check_len(name, getattr(self, name), b)
        _check_len("out_loc", self.out_loc, b * (self.steps + 1))
        if self.skip_extend is not None:
            _check_len("skip_extend", self.skip_extend, b)
            if ((self.skip_extend != 0) & (self.steps_per_request != 0)).any():
                raise ValueError("skip_extend: only a request at verify budget 0 may skip its "
                                 "draft extend")
        if not 0.0 <= self.min_survival < 1.0:
            raise ValueError(f"min_survival must be in [0, 1) (0: no confidence stop), got "
                             f"{self.min_survival}")


def worker_input(plan: Any, pad_slot: int) -> PrefillInput | DecodeInput:
    """The worker's input of a :class:`specdial._core.SchedulePlan` (``pad_slot``: the KV
    pools' sentinel KV slot, written by a decode request's positions beyond its own steps)."""
    if plan.is_prefill:
        return PrefillInput(_i64(plan.rows), _i64(plan.input_ids), _i64(plan.out_loc),
                            _i64(plan.qo_lens), _i64(plan.kv_lens), _i64(plan.sample_first),
                            _i64(plan.logits_indices), _i64(plan.cached_lens),
                            _i64(plan.cached_kv_indices), _i64(plan.cached_ids),
                            _i64(plan.cached_draft_lens))
    return DecodeInput(int(plan.steps), None if plan.graph_bs is None else int(plan.graph_bs),
                       _i64(plan.rows), _i64(plan.input_ids), _i64(plan.positions),
                       _i64(plan.out_loc_padded(pad_slot)), _i64(plan.steps_per_request),
                       _i64(plan.skip_extend), float(plan.min_survival))
