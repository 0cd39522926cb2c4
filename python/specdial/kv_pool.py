"""Paged KV pool: one K and one V buffer per model, indexed by slot.

A slot holds the key and value of one token for every layer. The Rust core hands out slot
indices (KV pages); the target and the drafter each own a :class:`KVPool` and use the same slot
indices, so one allocation covers both.
"""

from __future__ import annotations

import torch


class KVPool:
    """Per-layer K/V buffers of ``num_slots`` token slots plus one padding sentinel slot.

    ``k_buffer`` / ``v_buffer``: ``[num_layers, num_slots + 1, num_kv_heads, head_dim]`` of
    ``dtype`` on ``device``, zero-initialised. Slot ``num_slots`` (:attr:`pad_slot`) is a
    sentinel: padded tokens (e.g. in CUDA-graph batches) write there and no attention read
    ever uses it. The buffers are modified in place, never reassigned (:meth:`layer` keeps
    views of them).

    Raises ``ValueError`` for non-positive sizes.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (("num_layers", num_layers), ("num_slots", num_slots),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if value <= 0:
                raise ValueError(f"KVPool: {name} must be positive, got {value}")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)
        self.k_buffer = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_buffer = torch.zeros(shape, dtype=dtype, device=self.device)
        # per-layer views for :meth:`layer` (used where gradients are disabled)
        self._layers = [(self.k_buffer[i], self.v_buffer[i]) for i in range(num_layers)]

    @property
    def pad_slot(self) -> int:
        """Index of the padding sentinel slot (``num_slots``)."""
        return self.num_slots

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[T, num_kv_heads, head_dim]``) of ``layer`` at slots ``loc``.

        ``loc``: ``[T]`` int64 on the pool's device; duplicates are allowed only for the pad
        slot (which one wins is unspecified). ``k``/``v`` are cast to the pool dtype.
        No Python-side validation (hot path; safe inside CUDA-graph capture).
        """
        if k.dtype != self.dtype or v.dtype != self.dtype:  # (a same-dtype cast: a dispatched no-op)
            k, v = k.to(self.dtype), v.to(self.dtype)
        kb, vb = self.layer(layer)
        kb.index_copy_(0, loc, k)
        vb.index_copy_(0, loc, v)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_buffer[layer], v_buffer[layer])`` ``[num_slots + 1, num_kv_heads, head_dim]``:
        views made once, at construction (a select per call is a dispatched op, 4 per decoder
        layer); fresh views where gradients are enabled (autograd tracks in-place writes
        through a view made after the previous write only)."""
        if torch.is_grad_enabled():
            return self.k_buffer[layer], self.v_buffer[layer]
        return self._layers[layer]

    @property
    def nbytes(self) -> int:
        """Bytes held by both buffers (sentinel slot included)."""
        return 2 * self.k_buffer.numel() * self.k_buffer.element_size()

    def __repr__(self) -> str:
        return (f"KVPool(num_layers={self.num_layers}, num_slots={self.num_slots}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, device={self.device})")
