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


def tree_kv_indices(tables: RequestTables, rows: torch.Tensor, prefix_lens: np.ndarray,
                    extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys of ``B`` requests: the chain slots of positions ``0 .. prefix_lens[b] - 1`` of
    ``rows[b]`` (the tables), then ``extra[b]`` (``[B, t]`` int64 slots, e.g. the root's
    chain slot and the nodes' scratch slots). ``rows`` ``[B]`` device int64; ``prefix_lens``
    host int64 ``[B]``. Returns ``(kv_indices [sum(prefix_lens) + B * t] int64 on the device,
    request after request; kv_lens [B] int64 on the host)``: host lengths, so an attention
    plan reading them never waits for the device."""
    b, t = extra.shape
    dev = extra.device
    prefix = torch.from_numpy(np.ascontiguousarray(prefix_lens, np.int64)).to(dev)
    kv_lens = prefix + t
    total = int(np.sum(prefix_lens)) + b * t
    req = torch.repeat_interleave(torch.arange(b, device=dev), kv_lens, output_size=total)
    pos = torch.arange(total, device=dev) - (torch.cumsum(kv_lens, 0) - kv_lens)[req]
    chain = tables.req_to_token[rows[req], pos.clamp(max=tables.width - 1)]
    tree = extra[req, (pos - prefix[req]).clamp(min=0, max=max(t - 1, 0))] if t else chain
    host = torch.from_numpy(np.ascontiguousarray(prefix_lens, np.int64) + t)
    return torch.where(pos < prefix[req], chain, tree), host


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
