"""Reference attention backend: plain torch, CPU or GPU, no per-request Python loop."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdial.attention.base import AttentionBackend, AttentionMetadata, _indptr
from specdial.kv_pool import KVPool


@dataclass(kw_only=True)
class TorchAttentionMetadata(AttentionMetadata):
    """:class:`AttentionMetadata` plus the padded layout used by :class:`TorchAttentionBackend`.

    - ``max_qo_len`` / ``max_kv_len``: padded query / key lengths.
    - ``q_dst`` ``[T]`` int64: row of each packed query in the padded ``[B * max_qo_len]`` layout.
    - ``kv_gather`` ``[B, max_kv_len]`` int64: slot of each padded key (padding reads a valid
      slot of the batch and is masked out).
    - ``mask`` ``[B, 1, max_qo_len, max_kv_len]`` bool: True where a query may attend.
    """

    max_qo_len: int
    max_kv_len: int
    q_dst: torch.Tensor
    kv_gather: torch.Tensor
    mask: torch.Tensor


class TorchAttentionBackend(AttentionBackend):
    """Gathers K/V into a padded ``[B, max_kv, kvh, D]`` tensor and runs SDPA with a mask.

    ``device``: where the metadata tensors live (default: the device of ``kv_indices``).
    ``plan`` does its index arithmetic on the host; if the lens are GPU tensors it syncs once.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None

    def plan(self, qo_lens: torch.Tensor, kv_lens: torch.Tensor,
             kv_indices: torch.Tensor) -> TorchAttentionMetadata:
        dev = self.device if self.device is not None else kv_indices.device
        qo = qo_lens.to("cpu", torch.int64)
        kv = kv_lens.to("cpu", torch.int64)
        kv_indices = kv_indices.to(dev, torch.int64).contiguous()
        AttentionMetadata.check_lens(qo, kv, kv_indices)
        b = qo.numel()
        max_q = int(qo.max()) if b else 0
        max_kv = int(kv.max()) if b else 0
        qo_indptr, kv_indptr = _indptr(qo), _indptr(kv)

        # packed token t of request r, i-th query -> padded row r * max_q + i
        req = torch.repeat_interleave(torch.arange(b), qo)
        q_dst = req * max_q + (torch.arange(req.numel()) - qo_indptr[req])

        j = torch.arange(max_kv)
        kv_valid = j[None, :] < kv[:, None]  # [B, max_kv]
        flat = torch.where(kv_valid, kv_indptr[:-1, None] + j[None, :], 0)
        kv_gather = kv_indices[flat.to(dev)] if kv_indices.numel() else flat.to(dev)

        q_pos = (kv - qo)[:, None] + torch.arange(max_q)[None, :]  # [B, max_q]
        # padded query rows (i >= qo_len) see every valid key: no all-masked rows, no NaNs
        mask = kv_valid[:, None, :] & (j[None, None, :] <= q_pos[:, :, None])

        return TorchAttentionMetadata(
            qo_lens=qo.to(dev), kv_lens=kv.to(dev), kv_indices=kv_indices,
            qo_indptr=qo_indptr.to(dev), kv_indptr=kv_indptr.to(dev),
            max_qo_len=max_q, max_kv_len=max_kv, q_dst=q_dst.to(dev),
            kv_gather=kv_gather, mask=mask[:, None].to(dev),
        )

    def forward(self, q: torch.Tensor, layer_id: int, kv_pool: KVPool,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not isinstance(meta, TorchAttentionMetadata):
            raise TypeError("TorchAttentionBackend needs metadata from its own plan()")
        t, h, d = q.shape
        b, max_q = meta.batch_size, meta.max_qo_len
        qp = q.new_zeros(b * max_q, h, d).index_copy_(0, meta.q_dst, q)
        qp = qp.view(b, max_q, h, d).transpose(1, 2)  # [B, H, max_q, D]
        k = kv_pool.k_buffer[layer_id][meta.kv_gather].transpose(1, 2)  # [B, kvh, max_kv, D]
        v = kv_pool.v_buffer[layer_id][meta.kv_gather].transpose(1, 2)
        rep = h // k.shape[1]
        if rep != 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(qp, k.to(q.dtype), v.to(q.dtype),
                                             attn_mask=meta.mask, scale=scale)
        return out.transpose(1, 2).reshape(b * max_q, h, d)[meta.q_dst]
