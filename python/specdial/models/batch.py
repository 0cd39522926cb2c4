"""Inputs of one model forward over the paged KV pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdial.attention.base import AttentionMetadata


@dataclass
class ForwardBatch:
    """One forward pass: ``T`` new tokens packed request after request.

    - ``input_ids`` ``[T]`` int64: token ids.
    - ``positions`` ``[T]`` int64: position of each token in its sequence (rotary input);
      must agree with ``attn`` (query ``i`` of request ``b`` at ``kv_len - qo_len + i``).
    - ``out_loc`` ``[T]`` int64: KV slot each new token's K/V is written to (padding tokens
      may target the pool's pad slot).
    - ``attn``: the backend's :class:`AttentionMetadata` for this batch (same ``T``).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_loc: torch.Tensor
    attn: AttentionMetadata

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()
