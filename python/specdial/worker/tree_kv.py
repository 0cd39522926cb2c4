"""KV layout of draft trees (issue 29): key lists over chain slots plus scratch slots, and the
copy of the accepted path's KV into the chain slots.

Tree nodes share positions (siblings), so their KV (target and drafter) lives in *scratch*
slots outside the position-to-slot table; attention over them lists the request's chain slots
of positions ``0 .. P - 1`` and then its tree slots (:func:`tree_kv_indices`), under a tree
mask (:mod:`specdial.attention.base`). After acceptance the accepted path's KV moves to the
chain slots of positions ``L + 1 .. L + a`` (:func:`copy_slots`), so what follows is a chain's.
No host sync: invalid copies are routed to the pool's pad slot (whose content is never read).
"""

from __future__ import annotations

import numpy as np
import torch

from specdial.kv_pool import KVPool
from specdial.worker.runtime import RequestTables

__all__ = ["copy_rows", "copy_slots", "tree_kv_indices"]

I64 = torch.int64


def tree_kv_indices(tables: RequestTables, rows: np.ndarray | torch.Tensor,
                    prefix_lens: np.ndarray, extra: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys of ``B`` requests: the chain slots of positions ``0 .. prefix_lens[b] - 1`` of
    ``rows[b]`` (the tables), then ``extra[b]`` (``[B, t]`` int64 slots, e.g. the root's
    chain slot and the nodes' scratch slots). ``rows`` ``[B]`` int64, host (a numpy array:
    no sync) or a device tensor (copied to the host: one sync on a GPU); ``prefix_lens``
    host int64 ``[B]``. Returns ``(kv_indices [sum(prefix_lens) + B * t] int64 on the device,
    request after request; kv_lens [B] int64 on the host)``: host lengths, so an attention
    plan reading them never waits for the device.

    The index arithmetic runs on the host in numpy (a few microseconds for any batch), then
    one gather from the tables and one from ``[chain keys, extra]``: four device ops, where
    the same arithmetic in torch costs about twenty small ones per call (BENCHMARKS, issue
    29's host overhead)."""
    b, t = extra.shape
    dev = extra.device
    r = rows if isinstance(rows, np.ndarray) else rows.cpu().numpy()
    pl = np.ascontiguousarray(prefix_lens, np.int64)
    kv_lens = pl + t
    p_total = int(pl.sum())
    pl_start = np.cumsum(pl) - pl
    # chain keys: flat index into req_to_token, request after request
    chain_idx = np.repeat(r.astype(np.int64) * tables.width - pl_start, pl) + np.arange(p_total)
    # every key's index into [chain keys (p_total), extra (B * t)]
    req = np.repeat(np.arange(b), kv_lens)
    off = np.arange(p_total + b * t) - np.repeat(np.cumsum(kv_lens) - kv_lens, kv_lens)
    own = pl[req]
    order = np.where(off < own, pl_start[req] + off, p_total + req * t + off - own)
    chain = tables.req_to_token.view(-1)[torch.from_numpy(chain_idx).to(dev)]
    keys = torch.cat([chain, extra.reshape(-1)])[torch.from_numpy(order).to(dev)]
    return keys, torch.from_numpy(kv_lens)


def copy_slots(pool: KVPool, src: torch.Tensor, dst: torch.Tensor,
               valid: torch.Tensor) -> None:
    """Every layer's K/V of slots ``src`` into ``dst`` where ``valid`` (all ``[B, D]``; pairs
    that are not valid copy the pad slot onto itself). ``src`` and ``dst`` must be disjoint
    (scratch slots into chain slots)."""
    pad = pool.pad_slot
    s = torch.where(valid, src, pad).reshape(-1)
    d = torch.where(valid, dst, pad).reshape(-1)
    pool.k_buffer[:, d] = pool.k_buffer[:, s]
    pool.v_buffer[:, d] = pool.v_buffer[:, s]


def copy_rows(buf: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, valid: torch.Tensor,
              pad_row: int) -> None:
    """``buf[dst] = buf[src]`` (per-slot rows, e.g. EAGLE's target features ``[S, F]``)
    where ``valid``; the others copy ``pad_row`` onto itself."""
    s = torch.where(valid, src, pad_row).reshape(-1)
    d = torch.where(valid, dst, pad_row).reshape(-1)
    buf[d] = buf[s]
