"""Runtime states: everything bound to one ``steps`` value, plus the per-request tables.

- :class:`RequestTables`: per running request (a *row*, ``0..max_bs-1``), the KV slot and the
  token id of every position (SGLang's ``req_to_token`` pool). Device tensors; the passes
  build their index tensors from them with gathers, no per-request Python.
- :class:`RuntimeState`: one per candidate ``steps`` value, built once at engine start and
  swapped as a unit when the chosen steps change (DESIGN.md "runtime state"). It owns the
  input buffers of the draft and verify passes sized for the maximum batch
  (``(steps + 1) * max_bs`` tokens), fills them in place every iteration and plans the
  attention metadata. A CUDA-graph runner subclasses it and overrides :meth:`run_verify` /
  :meth:`run_draft` (replay instead of eager calls, graph key ``(steps, padded bs)``); a
  flashinfer backend plugs in through the ``backend`` object (its ``plan`` fills its own
  workspace). The passes in :mod:`specdial.worker.worker` do not change for either.

Host arrays are numpy int64; device tensors int64. ``B`` requests in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdial.attention.base import AttentionBackend
from specdial.kv_pool import KVPool
from specdial.models.batch import ForwardBatch

I64 = torch.int64


def load(buf: torch.Tensor, arr: np.ndarray) -> torch.Tensor:
    """Copy host ``arr`` (1-D int64) into the prefix of device buffer ``buf``; return the view.

    Falls back to a fresh device tensor when ``arr`` is longer than ``buf`` (rare paths such
    as a long catch-up extend)."""
    src = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64))
    if src.numel() > buf.numel():
        return src.to(buf.device)
    return buf[: src.numel()].copy_(src, non_blocking=True)


class RequestTables:
    """Slot and token id of every position of every row.

    ``req_to_token`` / ``req_to_ids``: ``[max_bs, width]`` int64 on ``device``; ``width`` must
    cover the longest request plus a decode iteration's overshoot (``steps + 2``). Entries past
    a request's length are stale and never read.
    """

    def __init__(self, max_bs: int, width: int, device: torch.device) -> None:
        self.max_bs, self.width, self.device = max_bs, width, device
        self.req_to_token = torch.zeros(max_bs, width, dtype=I64, device=device)
        self.req_to_ids = torch.zeros(max_bs, width, dtype=I64, device=device)

    def write(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray,
              slots: np.ndarray | None = None, ids: np.ndarray | None = None) -> None:
        """Set positions ``starts[b] .. starts[b] + counts[b] - 1`` of ``rows[b]`` to the flat
        ``slots`` / ``ids`` (``[sum(counts)]``, request after request)."""
        row_rep, pos = ragged_positions(rows, starts, starts + counts)
        r, p = torch.from_numpy(row_rep).to(self.device), torch.from_numpy(pos).to(self.device)
        if slots is not None:
            self.req_to_token[r, p] = torch.from_numpy(slots).to(self.device)
        if ids is not None:
            self.req_to_ids[r, p] = torch.from_numpy(ids).to(self.device)

    def kv_indices(self, rows: torch.Tensor, kv_lens: torch.Tensor, total: int) -> torch.Tensor:
        """Slots of positions ``0..kv_lens[b]-1`` of ``rows[b]``, concatenated: ``[total]``.

        ``rows``/``kv_lens`` ``[B]`` on the device; ``total = sum(kv_lens)`` from the host so
        nothing syncs."""
        n = rows.numel()
        req = torch.repeat_interleave(torch.arange(n, device=self.device), kv_lens,
                                      output_size=total)
        starts = torch.cumsum(kv_lens, 0) - kv_lens
        pos = torch.arange(total, device=self.device) - starts[req]
        return self.req_to_token[rows[req], pos]


def ragged_positions(rows: np.ndarray, starts: np.ndarray,
                     ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(row of each token, position of each token)`` for the ranges ``[starts, ends)``."""
    counts = ends - starts
    offsets = np.cumsum(counts) - counts
    rep = np.repeat(np.arange(len(rows)), counts)
    pos = np.arange(int(counts.sum()), dtype=np.int64) - offsets[rep] + starts[rep]
    return rows[rep].astype(np.int64), pos


@dataclass
class DecodeBatches:
    """The forward batches of one decode iteration (views of a :class:`RuntimeState`).

    ``verify``: ``B * (steps + 1)`` tokens ``[x_L, d_1..d_k]`` per request; ``draft[i]``: ``B``
    tokens at positions ``L + i`` (``i < steps``); ``rows``/``target_len`` ``[B]`` on device;
    ``verify_positions`` ``[B, steps + 1]``; ``verify_ids`` ``[B, steps + 1]`` (view of the
    verify input ids: drafts are copied into columns ``1..k``).
    """

    verify: ForwardBatch
    draft: list[ForwardBatch]
    rows: torch.Tensor
    verify_positions: torch.Tensor
    verify_ids: torch.Tensor


class RuntimeState:
    """Buffers, metadata planning and pass runners for one ``steps`` value.

    Preallocated on ``device`` (int64): verify ``input_ids``/``positions``/``out_loc``
    ``[(steps + 1) * max_bs]``; draft ``input_ids``/``positions`` ``[steps, max_bs]``;
    extend ``positions``/``rows`` ``[(steps + 1) * max_bs]`` (enough for every extend after a
    verify; longer catch-ups allocate); ``rows``, ``ragged_rows``, ``kv_lens`` ``[max_bs]``.
    """

    def __init__(self, steps: int, max_bs: int, tables: RequestTables,
                 backend: AttentionBackend) -> None:
        self.steps, self.max_bs, self.tables, self.backend = steps, max_bs, tables, backend
        n, dev = (steps + 1) * max_bs, tables.device
        z = lambda *shape: torch.zeros(*shape, dtype=I64, device=dev)  # noqa: E731
        self.verify_input_ids, self.verify_positions, self.verify_out_loc = z(n), z(n), z(n)
        self.draft_input_ids, self.draft_positions = z(steps, max_bs), z(steps, max_bs)
        self.draft_out_loc = z(steps, max_bs)
        self.extend_positions, self.extend_rows = z(n), z(n)
        self.rows, self.ragged_rows, self.kv_lens = z(max_bs), z(max_bs), z(max_bs)
        self.graphs: dict[int, object] = {}  # padded bs -> captured graph (GPU issue)

    @property
    def num_draft_tokens(self) -> int:
        return self.steps + 1

    def _plan(self, rows: torch.Tensor, qo_lens: np.ndarray, kv_lens: np.ndarray):
        kv_d = load(self.kv_lens, kv_lens)
        kv_indices = self.tables.kv_indices(rows, kv_d, int(kv_lens.sum()))
        return self.backend.plan(torch.from_numpy(qo_lens), torch.from_numpy(kv_lens),
                                 kv_indices)

    def prepare_decode(self, rows: np.ndarray, target_len: np.ndarray) -> DecodeBatches:
        """Fill the buffers for requests ``rows`` at ``target_len`` ``L`` (``[B]`` host).

        The slots of positions ``L..L+steps`` must already be in the tables. Verify input
        column 0 gets ``x_L``; draft step 1 input gets ``x_L``; later columns are filled by the
        draft pass."""
        b, n, k = len(rows), self.steps + 1, self.steps
        if b > self.max_bs:
            raise ValueError(f"batch of {b} requests exceeds max_running_requests {self.max_bs}")
        rows_d = load(self.rows, rows)
        pos2d = target_len[:, None] + np.arange(n, dtype=np.int64)[None, :]
        positions = load(self.verify_positions, pos2d.reshape(-1)).view(b, n)
        t = self.tables
        out_loc = self.verify_out_loc[: b * n].view(b, n)
        out_loc.copy_(t.req_to_token[rows_d[:, None], positions])
        ids = self.verify_input_ids[: b * n].view(b, n)
        ids[:, 0] = t.req_to_ids[rows_d, positions[:, 0]]
        verify = ForwardBatch(ids.view(-1), positions.view(-1), out_loc.view(-1),
                              self._plan(rows_d, np.full(b, n, np.int64), target_len + n))
        draft = []
        if k:
            self.draft_positions[:, :b].copy_(positions[:, :k].T)
            self.draft_out_loc[:, :b].copy_(out_loc[:, :k].T)
            self.draft_input_ids[0, :b].copy_(ids[:, 0])
            ones = np.ones(b, np.int64)
            for i in range(k):
                draft.append(ForwardBatch(self.draft_input_ids[i, :b], self.draft_positions[i, :b],
                                          self.draft_out_loc[i, :b],
                                          self._plan(rows_d, ones, target_len + i + 1)))
        return DecodeBatches(verify, draft, rows_d, positions, ids)

    def prepare_ragged(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                       hidden_rows: int | None = None
                       ) -> tuple[ForwardBatch, torch.Tensor | None]:
        """Forward batch over positions ``[starts[b], ends[b])`` of ``rows[b]`` (all
        ``ends > starts``), token ids and slots read from the tables; used for prefill, draft
        extend and catch-up. With ``hidden_rows`` (the zero row of the target-hidden buffer)
        also returns, per token at position ``p``, the hidden-buffer row of position ``p - 1``
        (``hidden_rows`` for ``p = 0``): EAGLE's input feature index."""
        row_rep, pos = ragged_positions(rows, starts, ends)
        t = self.tables
        pos_d = load(self.extend_positions, pos)
        rows_d = load(self.extend_rows, row_rep)
        batch = ForwardBatch(t.req_to_ids[rows_d, pos_d], pos_d, t.req_to_token[rows_d, pos_d],
                             self._plan(load(self.ragged_rows, rows), ends - starts, ends))
        if hidden_rows is None:
            return batch, None
        prev = t.req_to_token[rows_d, (pos_d - 1).clamp_min(0)]
        return batch, torch.where(pos_d > 0, prev, hidden_rows)

    # Pass runners: eager here; a CUDA-graph runner overrides these two (same signatures).
    def run_verify(self, target, kv: KVPool, batch: ForwardBatch) -> torch.Tensor:
        """Target forward of the verify pass -> final hidden ``[B * (steps + 1), H]``."""
        return target(batch, kv, self.backend)

    def run_draft(self, drafter, batches: DecodeBatches, **kwargs):
        """All ``steps`` draft forwards -> ``(tokens [B, k], probs [B, k, V] | None)``."""
        return drafter.draft(self.steps, batches.draft, self.backend, **kwargs)
