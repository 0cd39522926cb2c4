"""Reference attention backend: plain torch, CPU or GPU, no per-request Python loop."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from specdial.attention.base import (AttentionBackend, AttentionMetadata, check_host_lens,
                                     check_static_plan, expand_kv_indices, host_indptr,
                                     tree_key_mask)
from specdial.kv_pool import KVPool


I64 = torch.int64


@dataclass(kw_only=True)
class TorchAttentionMetadata(AttentionMetadata):
    """:class:`AttentionMetadata` plus the padded layout used by :class:`TorchAttentionBackend`.

    - ``max_qo_len`` / ``max_kv_len``: padded query / key lengths.
    - ``q_dst`` ``[T]`` int64: row of each packed query in the padded ``[B * max_qo_len]`` layout.
    - ``kv_gather`` ``[B, max_kv_len]`` int64: slot of each padded key (padding reads a valid
      slot of the batch and is masked out); ``kv_flat`` (derived, not an argument) the same
      ``[B * max_kv_len]``, a view when ``kv_gather`` is contiguous (in-place updates show).
    - ``mask`` ``[B, 1, max_qo_len, max_kv_len]`` bool: True where a query may attend; None
      on the CPU when every query may attend to every key (one query per request, no padded
      keys: a draft step at batch size 1 or of equal lengths), where SDPA's result is the
      same.
    - ``dense``: every request has ``max_qo_len`` queries (a decode batch: one token per draft
      step, ``steps + 1`` per verify), so ``q_dst`` is ``arange(T)`` and the padded layout is
      the packed one: the forward skips the scatter into it and the gather back (the same
      values; a per-layer cost that does not shrink with the batch).
    - ``kv_run``: ``(first, stop)`` when the padded key table is the consecutive slots
      ``first..stop - 1`` (no padded keys; at batch size 1 the usual case, the page pool
      handing out pages in order): the forward reads K/V as a slice of the pool, a view,
      instead of gathering a copy of every key per layer; None otherwise (and under CUDA
      graphs, whose tables change in place).
    """

    max_qo_len: int
    max_kv_len: int
    q_dst: torch.Tensor
    kv_gather: torch.Tensor
    mask: torch.Tensor | None
    dense: bool = False
    kv_run: tuple[int, int] | None = None
    kv_flat: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.kv_flat = self.kv_gather.reshape(-1)


class TorchAttentionBackend(AttentionBackend):
    """Gathers K/V into a padded ``[B, max_kv, kvh, D]`` tensor and runs SDPA with a mask.

    ``device``: where the metadata tensors live (default: the device of ``kv_indices``).
    ``plan`` does its index arithmetic on the host; if the lens are GPU tensors it syncs once.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        #: (qo_lens, qo_indptr, q_dst) of one request with one query, on the CPU
        self._ones: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def plan(self, qo_lens: torch.Tensor, kv_lens: torch.Tensor,
             kv_indices: torch.Tensor, tree_mask: torch.Tensor | None = None
             ) -> TorchAttentionMetadata:
        """The padded layout of a batch (:class:`TorchAttentionMetadata`).

        Index arithmetic on the host in numpy (a few µs per array, where each small torch op
        costs several: a decode iteration plans 4-5 batches), then one gather of the key slots
        on ``kv_indices``'s device; when every request has the same KV length the padded key
        table is ``kv_indices`` itself, viewed ``[B, max_kv]`` (no gather). Raises
        ``ValueError`` on inconsistent lengths (:func:`check_host_lens`)."""
        dev = self.device if self.device is not None else kv_indices.device
        qo_t = qo_lens.to("cpu", torch.int64)
        kv_t = kv_lens.to("cpu", torch.int64)
        qo, kv = qo_t.numpy(), kv_t.numpy()
        kv_indices = kv_indices.to(dev, torch.int64).contiguous()
        check_host_lens(qo, kv, kv_indices)
        b = len(qo)
        max_q = int(qo.max()) if b else 0
        max_kv = int(kv.max()) if b else 0
        qo_indptr, kv_indptr = host_indptr(qo), host_indptr(kv)
        dense = int(qo_indptr[-1]) == b * max_q
        if dense:  # every request has max_q queries: the padded layout is the packed one
            q_dst = np.arange(b * max_q, dtype=np.int64)
        else:  # packed token t of request r, i-th query -> padded row r * max_q + i
            req = np.repeat(np.arange(b, dtype=np.int64), qo)
            q_dst = req * max_q + (np.arange(len(req), dtype=np.int64) - qo_indptr[req])

        j = np.arange(max_kv, dtype=np.int64)
        kv_valid = j[None, :] < kv[:, None]  # [B, max_kv]
        same_kv = bool(b) and bool((kv == max_kv).all())
        if same_kv:  # no padded keys: row r is kv_indices' r-th run
            kv_gather = kv_indices.view(b, max_kv)
        else:
            flat = torch.from_numpy(np.where(kv_valid, kv_indptr[:-1, None] + j[None, :], 0))
            kv_gather = kv_indices[flat.to(dev)] if kv_indices.numel() else flat.to(dev)

        kv_run = None
        if same_kv and dev.type == "cpu" and kv_indices.numel():  # one run of slots?
            idx = kv_indices.numpy()
            if int(idx[-1]) - int(idx[0]) == idx.size - 1 and bool((np.diff(idx) == 1).all()):
                kv_run = (int(idx[0]), int(idx[-1]) + 1)

        mask: torch.Tensor | None = None
        if tree_mask is None:
            # one query per request, no padded keys: every query sees every key, and on the
            # CPU SDPA without a mask gives the same values (its GPU kernels may differ)
            if max_q > 1 or not same_kv or dev.type != "cpu":
                q_pos = (kv - qo)[:, None] + np.arange(max_q, dtype=np.int64)[None, :]
                # padded query rows (i >= qo_len) see every valid key: no all-masked rows
                mask = torch.from_numpy(kv_valid[:, None, :]
                                        & (j[None, None, :] <= q_pos[:, :, None]))
        else:  # draft trees: prefix + ancestors (base module docstring)
            # (ragged: the padded layout has max(qo_len) query rows, maybe fewer than n)
            mask = tree_key_mask(qo_t, kv_t, tree_mask.to("cpu"), max_kv)[:, :max_q]

        return TorchAttentionMetadata(
            qo_lens=qo_t.to(dev), kv_lens=kv_t.to(dev), kv_indices=kv_indices,
            qo_indptr=torch.from_numpy(qo_indptr).to(dev),
            kv_indptr=torch.from_numpy(kv_indptr).to(dev),
            max_qo_len=max_q, max_kv_len=max_kv, q_dst=torch.from_numpy(q_dst).to(dev),
            kv_gather=kv_gather, mask=None if mask is None else mask[:, None].to(dev),
            dense=dense, kv_run=kv_run,
        )

    def draft_step_plans(self, verify: TorchAttentionMetadata, k: int
                         ) -> list[TorchAttentionMetadata] | None:
        """The metadata of a chain's ``k`` draft steps, derived from its verify's at batch
        size 1 on the CPU (one request: ``n = steps + 1`` queries over ``L + n`` keys):
        step ``i`` (0-based) has one query over the first ``L + i + 1`` keys, i.e. a prefix
        of the verify's key table (a view), the prefix of its slot run, and no mask (one
        query, no padded keys: what :meth:`plan` gives for those lengths). Saves ``k`` plans
        per iteration (~40-70 µs each at batch 1). None (plan each step) at other batch sizes,
        off the CPU, for a packed or tree verify, or ``k`` not below the verify's queries."""
        if (verify.batch_size != 1 or not verify.dense or verify.kv_gather.device.type != "cpu"
                or not 0 < k < verify.max_qo_len):
            return None
        ones = self._ones
        if ones is None:
            ones = self._ones = (torch.ones(1, dtype=I64), torch.tensor([0, 1], dtype=I64),
                                 torch.zeros(1, dtype=I64))
        base = verify.max_kv_len - verify.max_qo_len  # L: keys before the verify's queries
        lens = torch.arange(base + 1, base + k + 1, dtype=I64)
        run = verify.kv_run
        out = []
        for i in range(k):
            m = base + i + 1
            indices = verify.kv_indices[:m]
            out.append(TorchAttentionMetadata(
                qo_lens=ones[0], kv_lens=lens[i:i + 1], kv_indices=indices, qo_indptr=ones[1],
                kv_indptr=torch.tensor([0, m], dtype=I64), max_qo_len=1, max_kv_len=m,
                q_dst=ones[2], kv_gather=indices.view(1, m), mask=None, dense=True,
                kv_run=None if run is None else (run[0], run[0] + m)))
        return out

    def forward(self, q: torch.Tensor, layer_id: int, kv_pool: KVPool,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not isinstance(meta, TorchAttentionMetadata):
            raise TypeError("TorchAttentionBackend needs metadata from its own plan()")
        t, h, d = q.shape
        b, max_q = meta.batch_size, meta.max_qo_len
        qp = q if meta.dense else q.new_zeros(b * max_q, h, d).index_copy_(0, meta.q_dst, q)
        qp = qp.view(b, max_q, h, d).transpose(1, 2)  # [B, H, max_q, D]
        # K/V rows of every padded key: index_select over the flat key table (the same rows as
        # indexing with kv_gather; a plain row gather, 2-3x faster here than advanced indexing)
        kvh = kv_pool.num_kv_heads
        shape = (b, meta.max_kv_len, kvh, d)
        kb, vb = kv_pool.layer(layer_id)
        # consecutive slots: a view of the pool, no copy (not where gradients are enabled:
        # autograd would see later layers' KV writes change what this layer saved)
        if meta.kv_run is not None and not torch.is_grad_enabled():
            kb, vb = kb[meta.kv_run[0]:meta.kv_run[1]], vb[meta.kv_run[0]:meta.kv_run[1]]
        else:
            kb, vb = kb.index_select(0, meta.kv_flat), vb.index_select(0, meta.kv_flat)
        k = kb.view(shape).transpose(1, 2)  # [B, kvh, max_kv, D]
        v = vb.view(shape).transpose(1, 2)
        rep = h // kvh
        # GQA: on the CPU, SDPA maps the query heads to their K/V head itself (the same
        # values, without copying K/V rep times); elsewhere the heads are repeated, as the
        # GPU kernels that take a mask do not all take enable_gqa
        gqa = rep != 1 and q.device.type == "cpu"
        if rep != 1 and not gqa:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=meta.mask, scale=scale,
                                             enable_gqa=gqa)
        out = out.transpose(1, 2).reshape(b * max_q, h, d)
        return out if meta.dense else out[meta.q_dst]


class TorchStaticAttention:
    """Fixed-shape metadata for :class:`TorchAttentionBackend` under CUDA graphs.

    One call site (verify, a draft step, extend) with ``n`` query tokens per request. Buffers
    on ``device``: ``kv_gather`` ``[max_bs, kv_capacity]`` int64 (slot of every key position;
    beyond a request's valid length its position-0 slot again, masked or seen by its padded
    queries only, so real rows never touch the pad slot, whose content may be anything;
    padded requests read only the pad slot), ``mask`` ``[max_bs, 1, n, kv_capacity]`` bool
    (key ``j`` visible to query ``i`` iff ``j < kv_len`` and ``j <= kv_len - n + i``),
    ``q_dst`` = ``arange(max_bs * n)``. :meth:`plan` fills the prefix of ``g`` requests in place
    and returns a :class:`TorchAttentionMetadata` of views (``max_kv_len = kv_capacity``), the
    same object for every call with that ``g``. In that metadata ``kv_indices`` is the flattened
    ``[g, kv_capacity]`` slot table and ``kv_indptr`` its row starts (unlike eager metadata).
    Cost: attention over ``kv_capacity`` keys per request, whatever the lengths.
    """

    def __init__(self, max_bs: int, qo_per_request: int, kv_capacity: int,
                 device: torch.device | str) -> None:
        if min(max_bs, qo_per_request, kv_capacity) < 1:
            raise ValueError("max_bs, qo_per_request and kv_capacity must be >= 1")
        dev = torch.device(device)
        self.max_bs, self.n, self.kv_capacity, self.device = max_bs, qo_per_request, kv_capacity, dev
        n, cap = qo_per_request, kv_capacity
        self.kv_gather = torch.zeros(max_bs, cap, dtype=I64, device=dev)
        self.mask = torch.zeros(max_bs, 1, n, cap, dtype=torch.bool, device=dev)
        self.kv_lens = torch.zeros(max_bs, dtype=I64, device=dev)
        self.qo_lens = torch.full((max_bs,), n, dtype=I64, device=dev)
        self.q_dst = torch.arange(max_bs * n, dtype=I64, device=dev)
        self.qo_indptr = torch.arange(0, (max_bs + 1) * n, n, dtype=I64, device=dev)
        self.kv_indptr = torch.arange(0, (max_bs + 1) * cap, cap, dtype=I64, device=dev)
        self._j = torch.arange(cap, dtype=I64, device=dev)
        self._i = torch.arange(n, dtype=I64, device=dev)
        self.metas: dict[int, TorchAttentionMetadata] = {}

    def plan(self, g: int, flat: torch.Tensor, flat_lens: np.ndarray, kv_lens: np.ndarray,
             valid_lens: np.ndarray, pad_slot: int) -> TorchAttentionMetadata:
        """Fill the metadata of ``g`` requests (host ``[g]`` arrays, see
        :func:`~specdial.attention.base.expand_kv_indices`); no sync."""
        check_static_plan(g, kv_lens, self.max_bs, self.kv_capacity)
        valid_lens = np.asarray(valid_lens, np.int64)
        idx, req, pos = expand_kv_indices(flat, flat_lens, valid_lens, valid_lens, pad_slot)
        gather = self.kv_gather[:g]
        gather.fill_(pad_slot)
        gather[req, pos] = idx
        host = torch.from_numpy(np.concatenate([np.asarray(kv_lens, np.int64), valid_lens]))
        kv_valid = host.to(self.device, non_blocking=True)
        kv = self.kv_lens[:g]
        kv.copy_(kv_valid[:g])
        # keys past the valid length repeat the request's first slot (pad slot if it has none)
        gather.copy_(torch.where(self._j[None, :] < kv_valid[g:, None], gather, gather[:, :1]))
        q_pos = (kv - self.n)[:, None] + self._i[None, :]  # [g, n]
        j = self._j[None, None, :]
        self.mask[:g, 0] = (j < kv[:, None, None]) & (j <= q_pos[:, :, None])
        meta = self.metas.get(g)
        if meta is None:
            meta = self.metas[g] = TorchAttentionMetadata(
                qo_lens=self.qo_lens[:g], kv_lens=kv, kv_indices=gather.view(-1),
                qo_indptr=self.qo_indptr[: g + 1], kv_indptr=self.kv_indptr[: g + 1],
                max_qo_len=self.n, max_kv_len=self.kv_capacity, q_dst=self.q_dst[: g * self.n],
                kv_gather=gather, mask=self.mask[:g])
        return meta
