"""Runtime states: everything bound to one ``steps`` value, plus the per-request tables.

- :class:`RequestTables`: per running request (a *row*, ``0..max_bs-1``), the KV slot and the
  token id of every position (SGLang's ``req_to_token`` pool). Device tensors; the passes
  build their index tensors from them with gathers, no per-request Python.
- :class:`RuntimeState`: one per candidate ``steps`` value, built once at engine start and
  swapped as a unit when the chosen steps change (DESIGN.md "runtime state"). It owns the
  input buffers of the draft and verify passes sized for the maximum batch
  (``(steps + 1) * max_bs`` tokens), fills them in place every iteration and plans the
  attention metadata. With CUDA graphs the state holds a
  :class:`~specdial.worker.cuda_graphs.CudaGraphRunner` (:attr:`RuntimeState.runner`):
  :meth:`run_draft`, :meth:`run_verify` and :meth:`run_extend` then replay the graph of key
  ``(steps, padded bs)`` (the runner falls back to eager passes, counted in its ``stats``,
  above the largest captured size, for uncaptured keys, sampling drafts and long catch-ups)
  and :meth:`prepare_decode` plans no eager metadata. A flashinfer backend plugs in through the
  ``backend`` object (its ``plan`` fills its own workspace).

Host arrays are numpy int64; device tensors int64. ``B`` requests in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specdial.attention.base import AttentionBackend
from specdial.kv_pool import KVPool
from specdial.worker.cuda_graphs import KVLayout, VerifyOutput
from specdial.worker.drafters import run_target

if TYPE_CHECKING:
    from specdial.worker.cuda_graphs import CudaGraphRunner
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
    #: runner path only (else None): target lengths ``L`` (host), the KV layout of positions
    #: ``0 .. L + steps`` (shared by draft, verify and the draft extends of the iteration) and
    #: the plan's graph batch size; the batches' ``attn`` metadata is then None
    target_len: np.ndarray | None = None
    layout: KVLayout | None = None
    graph_bs: int | None = None


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
        #: the CUDA-graph runner of this steps value (None: eager passes)
        self.runner: CudaGraphRunner | None = None

    @property
    def num_draft_tokens(self) -> int:
        return self.steps + 1

    def _plan(self, rows: torch.Tensor, qo_lens: np.ndarray, kv_lens: np.ndarray):
        kv_d = load(self.kv_lens, kv_lens)
        kv_indices = self.tables.kv_indices(rows, kv_d, int(kv_lens.sum()))
        return self.backend.plan(torch.from_numpy(qo_lens), torch.from_numpy(kv_lens),
                                 kv_indices)

    def uses_graphs(self, batch_size: int, graph_bs: int | None) -> bool:
        """True when a decode batch of ``batch_size`` requests goes through :attr:`runner`
        with a captured graph (then no eager metadata is planned)."""
        return self.runner is not None and self.runner.enabled and \
            self.runner.padded_bs(batch_size, graph_bs) is not None

    def prepare_decode(self, rows: np.ndarray, target_len: np.ndarray,
                       graph_bs: int | None = None) -> DecodeBatches:
        """Fill the buffers for requests ``rows`` at ``target_len`` ``L`` (``[B]`` host).

        The slots of positions ``L..L+steps`` must already be in the tables. Verify input
        column 0 gets ``x_L``; draft step 1 input gets ``x_L``; later columns are filled by the
        draft pass. With a :attr:`runner` no eager metadata is planned here (``attn`` None):
        the batches carry the KV layout and ``graph_bs`` (the plan's) and the passes go through
        the runner, which replays the graph of the padded size (:meth:`uses_graphs`) or plans
        its own eager metadata when it falls back (counted in its ``stats``)."""
        b, n, k = len(rows), self.steps + 1, self.steps
        if b > self.max_bs:
            raise ValueError(f"batch of {b} requests exceeds max_running_requests {self.max_bs}")
        graphs = self.runner is not None
        rows_d = load(self.rows, rows)
        pos2d = target_len[:, None] + np.arange(n, dtype=np.int64)[None, :]
        positions = load(self.verify_positions, pos2d.reshape(-1)).view(b, n)
        t = self.tables
        out_loc = self.verify_out_loc[: b * n].view(b, n)
        out_loc.copy_(t.req_to_token[rows_d[:, None], positions])
        ids = self.verify_input_ids[: b * n].view(b, n)
        ids[:, 0] = t.req_to_ids[rows_d, positions[:, 0]]
        layout = None
        if self.runner is not None:
            lens = target_len + n
            layout = KVLayout(self.tables.kv_indices(rows_d, load(self.kv_lens, lens),
                                                     int(lens.sum())), lens)
        meta: Any = None if graphs else self._plan(rows_d, np.full(b, n, np.int64),
                                                   target_len + n)
        verify = ForwardBatch(ids.view(-1), positions.view(-1), out_loc.view(-1), meta)
        draft = []
        if k:
            self.draft_positions[:, :b].copy_(positions[:, :k].T)
            self.draft_out_loc[:, :b].copy_(out_loc[:, :k].T)
            self.draft_input_ids[0, :b].copy_(ids[:, 0])
            ones = np.ones(b, np.int64)
            for i in range(k):
                draft.append(ForwardBatch(
                    self.draft_input_ids[i, :b], self.draft_positions[i, :b],
                    self.draft_out_loc[i, :b],
                    meta if graphs else self._plan(rows_d, ones, target_len + i + 1)))
        if self.runner is None:
            return DecodeBatches(verify, draft, rows_d, positions, ids)
        return DecodeBatches(verify, draft, rows_d, positions, ids,
                             np.asarray(target_len, np.int64), layout, graph_bs)

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

    def ragged_inputs(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                      hidden_rows: int | None = None):
        """Like :meth:`prepare_ragged` without planning metadata (``starts <= ends``; empty
        ranges allowed): ``(input_ids, positions, out_loc, hidden index or None)``, packed
        request after request."""
        row_rep, pos = ragged_positions(rows, starts, ends)
        t = self.tables
        pos_d = load(self.extend_positions, pos)
        rows_d = load(self.extend_rows, row_rep)
        ids, loc = t.req_to_ids[rows_d, pos_d], t.req_to_token[rows_d, pos_d]
        if hidden_rows is None:
            return ids, pos_d, loc, None
        prev = t.req_to_token[rows_d, (pos_d - 1).clamp_min(0)]
        return ids, pos_d, loc, torch.where(pos_d > 0, prev, hidden_rows)

    # Pass runners: eager, or through :attr:`runner` when the batches carry a KV layout.
    def run_verify(self, target, kv: KVPool, batch: ForwardBatch,
                   batches: DecodeBatches | None = None, drafter=None) -> VerifyOutput:
        """Target forward of the verify pass -> final hidden ``[B * (steps + 1), H]``, the
        ``drafter``'s features (:func:`~specdial.worker.drafters.run_target`) and, through the
        runner, the logits (graph-pool tensors: consume them before the next replay); eager:
        logits None (the caller computes them)."""
        if self.runner is not None and batches is not None and batches.layout is not None:
            assert batches.target_len is not None
            return self.runner.verify(batch.input_ids, batch.positions, batch.out_loc,
                                      batches.layout, batches.target_len,
                                      graph_bs=batches.graph_bs)
        hidden, feats = run_target(target, drafter, batch, kv, self.backend)
        return VerifyOutput(hidden, None, feats)

    def run_draft(self, drafter, batches: DecodeBatches, **kwargs):
        """All ``steps`` draft forwards -> ``(tokens [B, k], probs [B, k, V] | None)``."""
        if self.runner is not None and batches.layout is not None:
            assert batches.target_len is not None
            b, k = len(batches.target_len), self.steps
            return self.runner.draft(self.draft_input_ids[0, :b], self.draft_positions[:k, :b],
                                     self.draft_out_loc[:k, :b], batches.layout,
                                     batches.target_len, graph_bs=batches.graph_bs, **kwargs)
        return drafter.draft(self.steps, batches.draft, self.backend, **kwargs)

    def run_extend(self, batches: DecodeBatches, rows: np.ndarray, starts: np.ndarray,
                   ends: np.ndarray, hidden: torch.Tensor | None,
                   zero_row: int | None) -> None:
        """Drafter KV-only extend over ``[starts[b], ends[b])`` of the decode batch's requests
        (``rows`` all of them, in plan order; empty ranges allowed) through :attr:`runner`
        (``batches`` from :meth:`prepare_decode` with a runner). ``hidden``: the worker's
        target-hidden buffer (EAGLE) with ``zero_row``, else None."""
        assert self.runner is not None and batches.layout is not None
        counts = np.maximum(ends - starts, 0)
        ends = starts + counts
        ids, pos, loc, hidx = self.ragged_inputs(rows, starts, ends,
                                                 None if hidden is None else zero_row)
        feats = None if hidden is None or hidx is None else hidden[hidx]
        self.runner.draft_extend(ids, pos, loc, batches.layout, starts, counts, feats,
                                 graph_bs=batches.graph_bs)
