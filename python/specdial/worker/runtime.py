"""The per-request tables and the decode batch a step runner prepares.

- :class:`RequestTables`: per running request (a *row*, ``0..max_bs-1``), the KV slot and the
  token id of every position (SGLang's ``req_to_token`` pool). Device tensors; the passes
  build their index tensors from them with gathers, no per-request Python.
- :class:`DecodeBatches`: the forward batches of one decode iteration, views of the buffers
  of a :class:`~specdial.worker.step_runner.StepRunner` (which replaced the former
  ``RuntimeState`` and ``CudaGraphRunner``: one object per steps value).
- :func:`load`, :func:`ragged_positions`: host -> device helpers.

Host arrays are numpy int64; device tensors int64. ``B`` requests in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdial.models.batch import ForwardBatch
from specdial.worker.step_buffers import KVLayout
from specdial.worker.verify_budgets import DraftLevels, PackedVerify

I64 = torch.int64


def load(buf: torch.Tensor, arr: np.ndarray) -> torch.Tensor:
    """Copy host ``arr`` (1-D int64) into the prefix of device buffer ``buf``; return the view.

    Falls back to a fresh device tensor when ``arr`` is longer than ``buf`` (rare paths such
    as a long catch-up extend). A CPU buffer is written through its numpy view (the same
    memory; no torch op but the slice: each small torch op of an iteration costs tens of µs
    in situ at batch 1)."""
    n = len(arr)
    if buf.device.type == "cpu" and n <= buf.numel() and buf.dim() == 1:
        buf.numpy()[:n] = arr
        return buf[:n]
    src = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64))
    if src.numel() > buf.numel():
        return src.to(buf.device)
    return buf[: src.numel()].copy_(src, non_blocking=True)


class RequestTables:
    """KV slot and token id of every position of every row.

    ``req_to_token`` / ``req_to_ids``: ``[max_bs, width]`` int64 on ``device``; ``width`` must
    cover the longest request plus a decode iteration's overshoot (``steps + 2``). Entries past
    a request's length are stale and never read.
    """

    def __init__(self, max_bs: int, width: int, device: torch.device) -> None:
        self.max_bs, self.width, self.device = max_bs, width, device
        self.req_to_token = torch.zeros(max_bs, width, dtype=I64, device=device)
        self.req_to_ids = torch.zeros(max_bs, width, dtype=I64, device=device)
        #: CPU tables: a numpy view of ``req_to_token`` (same memory), so the eager plans'
        #: slot lists are one numpy gather instead of several small torch ops
        self.host_token = (self.req_to_token.numpy() if self.req_to_token.device.type == "cpu"
                           else None)
        #: CPU tables: the same of ``req_to_ids``
        self.host_ids = None if self.host_token is None else self.req_to_ids.numpy()

    def write(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray,
              kv_slots: np.ndarray | None = None, ids: np.ndarray | None = None) -> None:
        """Set positions ``starts[b] .. starts[b] + counts[b] - 1`` of ``rows[b]`` to the flat
        ``kv_slots`` / ``ids`` (``[sum(counts)]``, request after request, from the plan): the
        tables mirror the plans incrementally, only the positions a plan names are written."""
        row_rep, pos = ragged_positions(rows, starts, starts + counts)
        if self.host_token is not None and self.host_ids is not None:  # CPU: numpy, no torch op
            if kv_slots is not None:
                self.host_token[row_rep, pos] = kv_slots
            if ids is not None:
                self.host_ids[row_rep, pos] = ids
            return
        r, p = torch.from_numpy(row_rep).to(self.device), torch.from_numpy(pos).to(self.device)
        if kv_slots is not None:
            self.req_to_token[r, p] = torch.from_numpy(kv_slots).to(self.device)
        if ids is not None:
            self.req_to_ids[r, p] = torch.from_numpy(ids).to(self.device)

    def kv_indices(self, rows: torch.Tensor, kv_lens: torch.Tensor, total: int) -> torch.Tensor:
        """KV slots of positions ``0..kv_lens[b]-1`` of ``rows[b]``, concatenated: ``[total]``.

        ``rows``/``kv_lens`` ``[B]`` on the device; ``total = sum(kv_lens)`` from the host so
        nothing syncs."""
        n = rows.numel()
        req = torch.repeat_interleave(torch.arange(n, device=self.device), kv_lens,
                                      output_size=total)
        starts = torch.cumsum(kv_lens, 0) - kv_lens
        pos = torch.arange(total, device=self.device) - starts[req]
        return self.req_to_token[rows[req], pos]

    def kv_indices_host(self, rows: np.ndarray, kv_lens: np.ndarray) -> torch.Tensor | None:
        """:meth:`kv_indices` from host ``rows`` / ``kv_lens`` (numpy int64 ``[B]``) on CPU
        tables: a fresh CPU tensor ``[sum(kv_lens)]`` (copied out of the table, which later
        iterations overwrite). None on other devices (use :meth:`kv_indices`, which keeps the
        arithmetic on the device)."""
        if self.host_token is None:
            return None
        if len(rows) == 1:
            return torch.from_numpy(self.host_token[int(rows[0]), : int(kv_lens[0])].copy())
        row_rep, pos = ragged_positions(np.asarray(rows, np.int64), np.zeros_like(kv_lens),
                                        kv_lens)
        return torch.from_numpy(self.host_token[row_rep, pos])


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
    """The forward batches of one decode iteration (views of a step runner's buffers).

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
    #: graph path only (a runner with a pool; else None): target lengths ``L`` (host), the KV
    #: layout of positions ``0 .. L + steps`` (shared by draft, verify and the draft extends of the iteration) and
    #: the plan's graph batch size; the batches' ``attn`` metadata is then None
    target_len: np.ndarray | None = None
    layout: KVLayout | None = None
    graph_bs: int | None = None
    #: eager path with per-request verify budgets below ``steps`` (else None): the packed
    #: verify (``verify`` then carries no metadata) and the requests of each draft level
    packed: PackedVerify | None = None
    levels: DraftLevels | None = None
