"""Attention-backend interface over a paged :class:`~specdial.kv_pool.KVPool`.

A forward batch holds ``B`` requests. Request ``b`` contributes ``qo_lens[b]`` new tokens
(queries) and has ``kv_lens[b]`` tokens in the KV cache *including* the new ones (their K/V
are written to the pool before attention runs). ``kv_indices`` lists, request after request,
the slot of each cached token at positions ``0 .. kv_len - 1`` in order. Query ``i`` of
request ``b`` sits at position ``kv_lens[b] - qo_lens[b] + i`` and attends causally to all
positions ``<=`` its own. Queries are packed: ``q`` is ``[sum(qo_lens), H, D]`` in request order.

Tree attention (draft trees, issue 29): ``plan(..., tree_mask=m)`` with ``m`` ``[B, n, t]`` bool
replaces the causal rule. Every request then has ``qo_len == n`` queries and ``t <= kv_len``;
its first ``kv_len - t`` keys (the prefix) are visible to every query, and key
``kv_len - t + j`` is visible to query ``i`` iff ``m[b, i, j]`` (a node sees itself and its
ancestors; :func:`tree_key_mask`). Positions then come from the forward batch (siblings share
one), not from the layout. Ragged trees (a per-request node budget, issue 29 item 5): with a
square ``m`` (``n == t``) a request may have ``qo_len < n`` queries; its tree part is then its
last ``qo_len`` keys and ``m[b, :qo_len, :qo_len]`` (the torch backend only).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np
import torch

from specdial.kv_pool import KVPool


def indptr(lens: torch.Tensor) -> torch.Tensor:
    """CSR row starts of ``lens`` (int64 ``[B]``): int64 ``[B + 1]`` ``[0, cumsum(lens)]`` on
    ``lens``'s device (flashinfer's ``qo_indptr`` / ``kv_indptr``)."""
    zero = torch.zeros(1, dtype=torch.int64, device=lens.device)
    return torch.cat([zero, torch.cumsum(lens, 0)])


def host_indptr(lens: np.ndarray) -> np.ndarray:
    """:func:`indptr` of host int64 ``lens`` ``[B]``: numpy int64 ``[B + 1]``."""
    out = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=out[1:])
    return out


def check_host_lens(qo_lens: np.ndarray, kv_lens: np.ndarray, kv_indices: torch.Tensor) -> None:
    """:meth:`AttentionMetadata.check_lens` over host int64 lens ``[B]`` (numpy): the same
    rules and ``ValueError`` messages, no torch op (a plan runs several per iteration)."""
    if qo_lens.ndim != 1 or kv_lens.ndim != 1 or kv_indices.dim() != 1:
        raise ValueError("qo_lens, kv_lens and kv_indices must be 1-D tensors")
    if len(qo_lens) != len(kv_lens):
        raise ValueError(f"qo_lens has {len(qo_lens)} requests, kv_lens {len(kv_lens)}")
    if (qo_lens < 0).any() or (qo_lens > kv_lens).any():
        raise ValueError("every request needs 0 <= qo_len <= kv_len")
    total = int(kv_lens.sum())
    if total != kv_indices.numel():
        raise ValueError(f"kv_indices has {kv_indices.numel()} entries, "
                         f"sum(kv_lens) is {total}")


@dataclass
class AttentionMetadata:
    """Per-batch attention layout (flashinfer-style CSR), shared by all layers.

    Fields (all int64):
      - ``qo_lens`` ``[B]``: new tokens per request.
      - ``kv_lens`` ``[B]``: cached tokens per request, new tokens included.
      - ``kv_indices`` ``[sum(kv_lens)]``: slot of each cached token, request by request,
        positions ``0 .. kv_len - 1`` in order.
      - ``qo_indptr`` ``[B + 1]``: ``[0, cumsum(qo_lens)]``.
      - ``kv_indptr`` ``[B + 1]``: ``[0, cumsum(kv_lens)]``.

    Backends subclass this to carry precomputed masks / gather indices.
    """

    qo_lens: torch.Tensor
    kv_lens: torch.Tensor
    kv_indices: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.qo_lens.numel()

    @staticmethod
    def check_lens(qo_lens: torch.Tensor, kv_lens: torch.Tensor, kv_indices: torch.Tensor) -> None:
        """Validate shapes and lengths (:func:`check_host_lens` on the lens copied to the
        host); raises ``ValueError``. Syncs if the lens are on a GPU."""
        check_host_lens(qo_lens.detach().cpu().numpy(), kv_lens.detach().cpu().numpy(), kv_indices)

    @classmethod
    def from_lens(cls, qo_lens: torch.Tensor, kv_lens: torch.Tensor,
                  kv_indices: torch.Tensor) -> "AttentionMetadata":
        """Build the base metadata (lens cast to int64, indptrs derived); raises ``ValueError``."""
        qo_lens, kv_lens, kv_indices = (t.to(torch.int64).contiguous()
                                        for t in (qo_lens, kv_lens, kv_indices))
        cls.check_lens(qo_lens, kv_lens, kv_indices)
        return AttentionMetadata(qo_lens, kv_lens, kv_indices, indptr(qo_lens), indptr(kv_lens))


def tree_key_mask(qo_lens: torch.Tensor, kv_lens: torch.Tensor, tree_mask: torch.Tensor,
                  max_kv: int) -> torch.Tensor:
    """Dense visibility ``[B, n, max_kv]`` bool (on ``tree_mask``'s device) of a tree mask
    ``[B, n, t]`` over host int64 ``qo_lens`` / ``kv_lens`` ``[B]``: key ``j < kv_len - t``
    visible to all, key ``kv_len - t + c`` iff ``tree_mask[b, i, c]``, keys ``>= kv_len``
    never. Ragged (``n == t`` and some ``qo_len < n``, module docstring): request ``b``'s tree
    part is its last ``w = qo_len`` keys, key ``kv_len - w + c`` visible iff
    ``tree_mask[b, i, c]`` (rows ``i >= w`` are padding: they see the prefix). Raises
    ``ValueError`` naming the bound when ``qo_lens`` is neither ``n`` everywhere nor a ragged
    ``1..n`` of a square mask, or a tree part is longer than ``kv_len``."""
    if tree_mask.dim() != 3 or tree_mask.shape[0] != qo_lens.numel():
        raise ValueError(f"tree_mask must be [B={qo_lens.numel()}, n, t] bool, got "
                         f"{list(tree_mask.shape)}")
    b, n, t = tree_mask.shape
    qo, kv_host = qo_lens.cpu().numpy(), kv_lens.cpu().numpy()
    ragged = bool((qo != n).any())
    width = qo if ragged else np.full(b, t, np.int64)
    if (ragged and (n != t or (qo < 1).any() or (qo > n).any())) or (kv_host < width).any():
        raise ValueError(f"tree_mask [B, n={n}, t={t}] needs qo_len == n and kv_len >= t for "
                         f"every request (ragged: n == t, qo_len in 1..n, kv_len >= qo_len), "
                         f"got qo_lens {qo_lens.tolist()}, kv_lens {kv_lens.tolist()}")
    # index arithmetic on the host (numpy); two small copies and one gather on the device
    dev, kv = tree_mask.device, kv_host
    j = np.arange(max_kv)[None, :]
    rel = j - (kv[:, None] - width[:, None])  # [B, max_kv]: index into the tree part
    rel_d = torch.from_numpy(np.clip(rel, 0, t - 1)).to(dev)
    prefix = torch.from_numpy(rel < 0).to(dev)[:, None, :]
    valid = torch.from_numpy(j < kv[:, None]).to(dev)[:, None, :]
    tree_part = tree_mask.bool().gather(2, rel_d[:, None, :].expand(b, n, max_kv))
    return (tree_part | prefix) & valid


class AttentionBackend(abc.ABC):
    """Runs paged attention for every layer of a forward batch.

    ``plan`` is called once per forward batch (it may do host work, allocate and sync);
    ``forward`` once per layer and must not sync, so it can be captured in a CUDA graph.
    """

    @abc.abstractmethod
    def plan(self, qo_lens: torch.Tensor, kv_lens: torch.Tensor,
             kv_indices: torch.Tensor, tree_mask: torch.Tensor | None = None
             ) -> AttentionMetadata:
        """Precompute the batch layout. Inputs: int64 ``[B]``, ``[B]``, ``[sum(kv_lens)]``;
        ``tree_mask`` ``[B, n, t]`` bool or None (causal; see the module docstring).

        Raises ``ValueError`` on inconsistent lengths or a tree mask that does not fit them.
        """

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, layer_id: int, kv_pool: KVPool,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention of packed queries ``q`` ``[T, H, D]`` over layer ``layer_id`` of ``kv_pool``.

        ``H`` is a multiple of ``kv_pool.num_kv_heads`` (GQA: query head ``h`` reads kv head
        ``h // (H // num_kv_heads)``). Returns ``[T, H, D]`` in ``q.dtype``.
        """


def check_static_plan(g: int, kv_lens: np.ndarray, max_bs: int, kv_capacity: int) -> None:
    """The bounds of a static (graph-capturable) attention plan: ``g`` requests (padded
    included), ``1 <= g <= max_bs``, one KV length per request, none over ``kv_capacity``
    positions. Raises ``ValueError`` naming the bound."""
    if not 1 <= g <= max_bs or len(kv_lens) != g:
        raise ValueError(f"static attention: batch {len(kv_lens)} padded to {g} "
                         f"(max {max_bs})")
    if int(np.max(kv_lens)) > kv_capacity:
        raise ValueError(f"a request has {int(np.max(kv_lens))} KV positions, over the "
                         f"static capacity {kv_capacity}")


def expand_kv_indices(flat: torch.Tensor, flat_lens: np.ndarray, kv_lens: np.ndarray,
                      valid_lens: np.ndarray, pad_slot: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-request slot lists of length ``kv_lens``, read from a flat layout, padded.

    - ``flat`` ``[sum(flat_lens)]`` int64 (device): request ``b``'s slots of positions
      ``0 .. flat_lens[b] - 1``, request after request (a ``KVLayout``'s ``indices``).
    - ``flat_lens``, ``kv_lens``, ``valid_lens``: host int64 ``[B]`` with
      ``valid_lens <= flat_lens`` and ``valid_lens <= kv_lens``.

    Returns ``(indices, req, pos)``, each ``[sum(kv_lens)]`` int64 on ``flat.device``: entry
    ``(b, j)`` is ``flat[offset_b + j]`` for ``j < valid_lens[b]`` and ``pad_slot`` beyond;
    ``req``/``pos`` give ``b``/``j`` of every entry. Host arithmetic plus one host-to-device
    copy; never syncs. Raises ``ValueError`` for inconsistent lengths.
    """
    flat_lens, kv_lens, valid_lens = (np.asarray(a, np.int64) for a in
                                      (flat_lens, kv_lens, valid_lens))
    if not (flat_lens.shape == kv_lens.shape == valid_lens.shape) or flat_lens.ndim != 1:
        raise ValueError("flat_lens, kv_lens and valid_lens must be 1-D arrays of one length")
    if (valid_lens < 0).any() or (valid_lens > flat_lens).any() or (valid_lens > kv_lens).any():
        raise ValueError("every request needs 0 <= valid_len <= min(flat_len, kv_len); got "
                         f"valid {valid_lens.tolist()}, flat {flat_lens.tolist()}, "
                         f"kv {kv_lens.tolist()}")
    if int(flat_lens.sum()) != flat.numel():
        raise ValueError(f"flat layout has {flat.numel()} slots, sum(flat_lens) is "
                         f"{int(flat_lens.sum())}")
    dev, b, total = flat.device, len(kv_lens), int(kv_lens.sum())
    offsets = np.cumsum(flat_lens) - flat_lens
    starts = np.cumsum(kv_lens) - kv_lens
    host = torch.from_numpy(np.concatenate([kv_lens, offsets, starts, valid_lens]))
    kv_d, off_d, start_d, valid_d = host.to(dev, non_blocking=True).view(4, b)
    req = torch.repeat_interleave(torch.arange(b, device=dev), kv_d, output_size=total)
    pos = torch.arange(total, device=dev) - start_d[req]
    if flat.numel() == 0:
        return torch.full((total,), pad_slot, dtype=torch.int64, device=dev), req, pos
    src = (off_d[req] + pos).clamp_(max=flat.numel() - 1)
    idx = torch.where(pos < valid_d[req], flat[src], pad_slot)
    return idx, req, pos
