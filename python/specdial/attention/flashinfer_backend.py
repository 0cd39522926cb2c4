"""flashinfer attention over the paged :class:`~specdial.kv_pool.KVPool` (optional, CUDA only).

The pool is a paged KV cache with **page size 1** in flashinfer's ``NHD`` layout: layer ``l``'s
``k_buffer[l]`` ``[num_slots + 1, kvh, d]`` viewed as ``[num_slots + 1, 1, kvh, d]`` is
``[num_pages, page_size, num_kv_heads, head_dim]``, so a slot index *is* a page index,
``kv_indices`` are flashinfer's ``paged_kv_indices`` unchanged, ``paged_kv_indptr`` is the CSR
``kv_indptr`` and ``paged_kv_last_page_len`` is all ones.

- Batches whose requests all have one query token (draft steps, the trivial verify at
  ``steps = 0``, plain decoding) run ``flashinfer.BatchDecodeWithPagedKVCacheWrapper``.
- Everything else (prefill, verify with ``k + 1`` query tokens per request, draft extend) runs
  ``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True``; flashinfer aligns the
  causal mask bottom-right, i.e. query ``i`` of a request sits at position
  ``kv_len - qo_len + i``, which is this project's convention (:mod:`specdial.attention.base`).

flashinfer needs the model's head counts, head dim, dtypes and softmax scale at ``plan`` time,
while :meth:`AttentionBackend.plan` only sees the batch layout. So :meth:`FlashInferAttentionBackend.plan`
records the layout, and the wrapper ``plan`` runs at the first :meth:`forward` of each *head
signature* ``(num_qo_heads, num_kv_heads, head_dim, q dtype, kv dtype, scale)`` for that
metadata (once per forward pass, not per layer; a target and an EAGLE head of the same width
share one). That host work never syncs. CUDA-graph metadata
(:class:`FlashInferStaticAttention`) plans every signature it has seen before each replay instead,
because ``plan`` cannot run inside a captured graph.

Dtypes: flashinfer's kernels take float16/bfloat16 queries and KV; a float32 model raises
``TypeError`` at the first forward (``specdial.attention.select.select_backend`` picks the torch
backend for float32). ``flashinfer`` is imported when the backend is constructed, so importing
this module never needs it; the package is ``flashinfer-python`` (``pip install 'specdial[cuda]'``).

API used (flashinfer >= 0.2, checked against 0.7's documentation): the wrappers'
``__init__(float_workspace_buffer, kv_layout, use_cuda_graph, ...buffers)``,
``plan(...)`` with positional layout arguments then ``causal``/``sm_scale``/``q_data_type``/
``kv_data_type`` keywords, and ``run(q, (k_cache, v_cache))``. CUDA-graph mode follows SGLang's
flashinfer backend: one wrapper per captured batch size with fixed ``*_buf`` tensors, re-planned
before each replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specdial.attention.base import (AttentionBackend, AttentionMetadata, indptr,
                                     check_static_plan, tree_key_mask,
                                     expand_kv_indices)  # noqa: F401 (re-exported)
from specdial.kv_pool import KVPool

#: Shared float workspace of all wrappers of one backend (split-kv partial results). SGLang's
#: default ``flashinfer_workspace_size`` (384 MiB); flashinfer raises "Out of workspace memory"
#: in ``plan`` when a batch needs more, then raise ``workspace_bytes``.
DEFAULT_WORKSPACE_BYTES = 384 << 20

#: GQA group size from which the decode wrapper uses tensor cores (flashinfer fuses the head group
#: with the token dimension; SGLang's ``should_use_tensor_core`` uses the same bound).
TENSOR_CORE_GROUP_SIZE = 4

INSTALL_HINT = ("the flashinfer attention backend needs the 'flashinfer-python' package: "
                "pip install 'specdial[cuda]' (or pip install flashinfer-python); "
                "without it use the torch backend (select_backend(prefer='torch'))")

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)

#: ``(num_qo_heads, num_kv_heads, head_dim, q dtype, kv dtype, sm_scale)``
HeadKey = tuple[int, int, int, torch.dtype, torch.dtype, float]




@dataclass(kw_only=True)
class FlashInferMetadata(AttentionMetadata):
    """:class:`AttentionMetadata` plus what flashinfer's ``plan`` takes.

    Unlike the base class, ``qo_lens``/``kv_lens``/``qo_indptr``/``kv_indptr`` are **host**
    int64 tensors (flashinfer plans on the host); ``kv_indices`` is on the device.

    - ``decode``: every request has one query token (decode wrapper), else prefill (causal).
    - ``qo_indptr_i32`` / ``kv_indptr_i32`` ``[B + 1]``, ``last_page_len_i32`` ``[B]`` (ones):
      host int32; ``kv_indices_i32`` ``[sum(kv_lens)]`` device int32.
    - ``static``: the :class:`FlashInferStaticAttention` owning this metadata (CUDA-graph mode:
      own wrappers, planned before each replay) or None (eager: the backend's shared wrappers).
    """

    decode: bool
    qo_indptr_i32: torch.Tensor
    kv_indptr_i32: torch.Tensor
    last_page_len_i32: torch.Tensor
    kv_indices_i32: torch.Tensor
    #: draft trees: flashinfer's ``custom_mask`` (bool ``[sum(qo_len * kv_len)]``, request
    #: by request, row-major; the prefill wrapper then ignores ``causal``), or None (causal)
    custom_mask: torch.Tensor | None = None
    static: "FlashInferStaticAttention | None" = None
    graph_bs: int = 0
    wrappers: dict[HeadKey, Any] = field(default_factory=dict)


def packed_custom_mask(qo_lens: torch.Tensor, kv_lens: torch.Tensor, tree_mask: torch.Tensor,
                       device: torch.device | str) -> torch.Tensor:
    """flashinfer's ``custom_mask`` for a tree mask (:mod:`specdial.attention.base`): bool
    ``[sum(qo_len * kv_len)]`` on ``device``, request after request, each request's
    ``[qo_len, kv_len]`` visibility flattened row-major (query, then key), as
    ``BatchPrefillWithPagedKVCacheWrapper.plan(custom_mask=...)`` takes it. ``qo_lens`` /
    ``kv_lens``: host int64 ``[B]``. Raises ``ValueError`` as :func:`tree_key_mask`."""
    max_kv = int(kv_lens.max()) if kv_lens.numel() else 0
    dense = tree_key_mask(qo_lens, kv_lens, tree_mask.to(device), max_kv)  # [B, n, max_kv]
    # the flat positions of the valid keys, found on the host (no device sync), then gathered
    valid = (torch.arange(max_kv)[None, :] < kv_lens[:, None])[:, None, :].expand(dense.shape)
    # a ragged tree's padded query rows (i >= qo_len) are no queries
    valid = valid & (torch.arange(dense.shape[1])[None, :, None] < qo_lens[:, None, None])
    flat = valid.reshape(-1).nonzero().squeeze(1).to(device, non_blocking=True)
    return dense.reshape(-1)[flat]


class FlashInferAttentionBackend(AttentionBackend):
    """flashinfer paged attention (page size 1, ``NHD``) behind :class:`AttentionBackend`.

    - ``device``: where the workspace and the metadata live (a CUDA device in practice).
    - ``workspace_bytes``: the float workspace shared by every wrapper (uint8, zero-filled:
      flashinfer's decode wrapper wants it zeroed before first use).
    - ``use_tensor_cores``: decode wrapper setting; None = ``num_qo_heads // num_kv_heads >=``
      :data:`TENSOR_CORE_GROUP_SIZE`.

    Raises ``ImportError`` (naming ``pip install 'specdial[cuda]'``) when flashinfer is missing.
    Each wrapper also allocates flashinfer's own 8 MiB int workspace (device) and an 8 MiB
    pinned host buffer: two eager wrappers per head signature, plus one per captured graph batch
    size and attention call site under CUDA graphs (SGLang's per-batch-size wrappers).
    """

    def __init__(self, device: torch.device | str = "cuda", *,
                 workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
                 use_tensor_cores: bool | None = None) -> None:
        try:
            import flashinfer
        except ImportError as e:  # pragma: no cover - exercised with a missing module in tests
            raise ImportError(INSTALL_HINT) from e
        if workspace_bytes <= 0:
            raise ValueError(f"workspace_bytes must be positive, got {workspace_bytes}")
        self.flashinfer = flashinfer
        self.device = torch.device(device)
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.use_tensor_cores = use_tensor_cores
        self._eager: dict[tuple[bool, HeadKey], Any] = {}
        self._owner: dict[tuple[bool, HeadKey], FlashInferMetadata] = {}

    # ------------------------------------------------------------------ planning
    def plan(self, qo_lens: torch.Tensor, kv_lens: torch.Tensor,
             kv_indices: torch.Tensor, tree_mask: torch.Tensor | None = None
             ) -> FlashInferMetadata:
        """Record the layout (host lens, int32 CSR); the wrapper plans at the first forward.
        A ``tree_mask`` (draft trees) becomes flashinfer's packed-by-request ``custom_mask``
        and always uses the prefill wrapper (the decode wrapper takes no mask)."""
        qo = qo_lens.to("cpu", torch.int64)
        kv = kv_lens.to("cpu", torch.int64)
        kv_indices = kv_indices.to(self.device, torch.int64).contiguous()
        AttentionMetadata.check_lens(qo, kv, kv_indices)
        qo_indptr, kv_indptr = indptr(qo), indptr(kv)
        custom = None if tree_mask is None else packed_custom_mask(qo, kv, tree_mask,
                                                                   self.device)
        return FlashInferMetadata(
            qo_lens=qo, kv_lens=kv, kv_indices=kv_indices, qo_indptr=qo_indptr,
            kv_indptr=kv_indptr, custom_mask=custom,
            decode=custom is None and bool(qo.numel()) and bool((qo == 1).all()),
            qo_indptr_i32=qo_indptr.to(torch.int32), kv_indptr_i32=kv_indptr.to(torch.int32),
            last_page_len_i32=torch.ones(qo.numel(), dtype=torch.int32),
            kv_indices_i32=kv_indices.to(torch.int32))

    def make_static_attention(self, max_bs: int, qo_per_request: int,
                              kv_capacity: int) -> "FlashInferStaticAttention":
        """CUDA-graph metadata for batches of up to ``max_bs`` requests with
        ``qo_per_request`` query tokens each and at most ``kv_capacity`` KV positions each."""
        return FlashInferStaticAttention(self, max_bs, qo_per_request, kv_capacity)

    def head_key(self, q: torch.Tensor, kv_pool: KVPool, scale: float) -> HeadKey:
        """The head signature of a forward; raises ``TypeError`` for float32 (unsupported)."""
        if q.dtype not in _SUPPORTED_DTYPES or kv_pool.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"flashinfer attention supports float16/bfloat16 queries and KV, got "
                            f"q {q.dtype} and KV {kv_pool.dtype}; use the torch backend for "
                            "float32 (select_backend picks it)")
        return (int(q.shape[1]), kv_pool.num_kv_heads, int(q.shape[2]), q.dtype,
                kv_pool.dtype, float(scale))

    def _tensor_cores(self, key: HeadKey) -> bool:
        if self.use_tensor_cores is not None:
            return self.use_tensor_cores
        return key[0] // key[1] >= TENSOR_CORE_GROUP_SIZE

    def new_wrapper(self, decode: bool, key: HeadKey, buffers: dict[str, torch.Tensor] | None):
        """A flashinfer wrapper over the shared workspace; ``buffers`` (CUDA-graph mode) holds
        ``qo_indptr``, ``kv_indptr``, ``kv_indices`` and ``last_page_len`` int32 tensors of
        lengths ``bs + 1``, ``bs + 1``, capacity and ``bs``."""
        fi = self.flashinfer
        if decode:
            kw: dict[str, Any] = {}
            if buffers is not None:
                kw = dict(use_cuda_graph=True, paged_kv_indptr_buffer=buffers["kv_indptr"],
                          paged_kv_indices_buffer=buffers["kv_indices"],
                          paged_kv_last_page_len_buffer=buffers["last_page_len"])
            return fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=self._tensor_cores(key), **kw)
        kw = {}
        if buffers is not None:
            kw = dict(use_cuda_graph=True, qo_indptr_buf=buffers["qo_indptr"],
                      paged_kv_indptr_buf=buffers["kv_indptr"],
                      paged_kv_indices_buf=buffers["kv_indices"],
                      paged_kv_last_page_len_buf=buffers["last_page_len"])
        return fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", **kw)

    @staticmethod
    def plan_wrapper(wrapper, meta: FlashInferMetadata, key: HeadKey) -> None:
        """Run flashinfer's ``plan`` for ``meta``'s layout and head signature ``key``."""
        heads, kv_heads, head_dim, q_dtype, kv_dtype, scale = key
        if meta.decode:
            wrapper.plan(meta.kv_indptr_i32, meta.kv_indices_i32, meta.last_page_len_i32,
                         heads, kv_heads, head_dim, 1, sm_scale=scale, q_data_type=q_dtype,
                         kv_data_type=kv_dtype)
        else:
            tree = {} if meta.custom_mask is None else {"custom_mask": meta.custom_mask}
            wrapper.plan(meta.qo_indptr_i32, meta.kv_indptr_i32, meta.kv_indices_i32,
                         meta.last_page_len_i32, heads, kv_heads, head_dim, 1,
                         causal=meta.custom_mask is None, sm_scale=scale, q_data_type=q_dtype,
                         kv_data_type=kv_dtype, **tree)

    def _wrapper_for(self, meta: FlashInferMetadata, key: HeadKey):
        if meta.static is not None:
            wrapper = meta.wrappers.get(key)
            if wrapper is None:
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError("flashinfer CUDA-graph metadata met a new head signature "
                                       "during capture; run the pass once (warm-up) first")
                wrapper = meta.wrappers[key] = meta.static.wrapper(meta.graph_bs, meta.decode,
                                                                   key)
                self.plan_wrapper(wrapper, meta, key)
            return wrapper
        slot = (meta.decode, key)
        wrapper = self._eager.get(slot)
        if wrapper is None:
            wrapper = self._eager[slot] = self.new_wrapper(meta.decode, key, None)
        if self._owner.get(slot) is not meta:
            self.plan_wrapper(wrapper, meta, key)
            self._owner[slot] = meta
        return wrapper

    # ------------------------------------------------------------------ attention
    def forward(self, q: torch.Tensor, layer_id: int, kv_pool: KVPool,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not isinstance(meta, FlashInferMetadata):
            raise TypeError("FlashInferAttentionBackend needs metadata from its own plan()")
        wrapper = self._wrapper_for(meta, self.head_key(q, kv_pool, scale))
        k = kv_pool.k_buffer[layer_id].unsqueeze(1)  # [num_slots + 1, page_size 1, kvh, d]
        v = kv_pool.v_buffer[layer_id].unsqueeze(1)
        return wrapper.run(q.contiguous(), (k, v))


class FlashInferStaticAttention:
    """CUDA-graph attention metadata of one call site (verify, one draft step, extend).

    Fixed int32 buffers on the backend's device: ``qo_indptr``/``kv_indptr`` ``[max_bs + 1]``,
    ``last_page_len`` ``[max_bs]`` (ones), ``kv_indices`` ``[max_bs * kv_capacity]``. A padded
    batch of ``g`` requests uses views of their prefixes; one metadata object and one wrapper per
    ``(g, head signature)`` (flashinfer fixes the batch size of a CUDA-graph wrapper), re-planned
    by :meth:`plan` before every replay. Padded requests have ``qo_per_request`` query tokens and
    as many KV entries, all the pool's pad slot.
    """

    def __init__(self, backend: FlashInferAttentionBackend, max_bs: int, qo_per_request: int,
                 kv_capacity: int) -> None:
        if min(max_bs, qo_per_request, kv_capacity) < 1:
            raise ValueError("max_bs, qo_per_request and kv_capacity must be >= 1")
        self.backend, self.max_bs, self.n = backend, max_bs, qo_per_request
        self.kv_capacity = kv_capacity
        dev = backend.device
        self.qo_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self.kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self.last_page_len = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.kv_indices = torch.zeros(max_bs * kv_capacity, dtype=torch.int32, device=dev)
        self.metas: dict[int, FlashInferMetadata] = {}

    def wrapper(self, g: int, decode: bool, key: HeadKey):
        """A new CUDA-graph wrapper for padded batch size ``g`` over this site's buffers."""
        bufs = {"qo_indptr": self.qo_indptr[: g + 1], "kv_indptr": self.kv_indptr[: g + 1],
                "kv_indices": self.kv_indices, "last_page_len": self.last_page_len[:g]}
        return self.backend.new_wrapper(decode, key, bufs)

    def plan(self, g: int, flat: torch.Tensor, flat_lens: np.ndarray, kv_lens: np.ndarray,
             valid_lens: np.ndarray, pad_slot: int) -> FlashInferMetadata:
        """Lay out ``g`` requests (host ``[g]`` arrays, padded requests included, see
        :func:`expand_kv_indices`) and re-plan every wrapper of batch size ``g``; returns the
        same metadata object for every call with this ``g``. Raises ``ValueError`` when a
        request exceeds ``kv_capacity``."""
        check_static_plan(g, kv_lens, self.max_bs, self.kv_capacity)
        idx, _, _ = expand_kv_indices(flat, flat_lens, kv_lens, valid_lens, pad_slot)
        qo = torch.full((g,), self.n, dtype=torch.int64)
        kv = torch.from_numpy(np.asarray(kv_lens, np.int64))
        qo_indptr, kv_indptr = indptr(qo), indptr(kv)
        meta = self.metas.get(g)
        fields_: dict[str, Any] = dict(qo_lens=qo, kv_lens=kv, kv_indices=idx,
                                       qo_indptr=qo_indptr,
                       kv_indptr=kv_indptr, decode=self.n == 1,
                       qo_indptr_i32=qo_indptr.to(torch.int32),
                       kv_indptr_i32=kv_indptr.to(torch.int32),
                       last_page_len_i32=torch.ones(g, dtype=torch.int32),
                       kv_indices_i32=idx.to(torch.int32))
        if meta is None:
            meta = self.metas[g] = FlashInferMetadata(static=self, graph_bs=g, **fields_)
        else:
            for name, value in fields_.items():
                setattr(meta, name, value)
        for key, wrapper in meta.wrappers.items():
            self.backend.plan_wrapper(wrapper, meta, key)
        return meta
