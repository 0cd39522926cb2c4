"""Choosing the attention backend: flashinfer on CUDA when it is installed, torch otherwise.

``select_backend(device, prefer=None, dtype=None)``:

- ``prefer=None`` (automatic): :class:`~specdial.attention.flashinfer_backend.FlashInferAttentionBackend`
  when ``device`` is CUDA, ``flashinfer`` imports and ``dtype`` is float16/bfloat16 (or not
  given); :class:`~specdial.attention.torch_backend.TorchAttentionBackend` otherwise (CPU, no
  flashinfer, float32 models: flashinfer's kernels have no float32 path).
- ``prefer="torch"``: always the torch backend.
- ``prefer="flashinfer"``: the flashinfer backend, or a clear error: ``ValueError`` off CUDA
  or for float32, ``ImportError`` naming ``pip install 'specdial[cuda]'`` when flashinfer is
  missing.

Anything else for ``prefer`` raises ``ValueError``. :func:`flashinfer_available` tells whether
the module imports (cached; the import is attempted once).

``make_static_attention(backend, max_bs, qo_per_request, kv_capacity, device)``: the
fixed-shape (CUDA-graph) metadata of either backend.
"""

from __future__ import annotations

import functools
import importlib

import torch

from specdial.attention.base import AttentionBackend
from specdial.attention.flashinfer_backend import INSTALL_HINT
from specdial.attention.torch_backend import TorchAttentionBackend, TorchStaticAttention

BACKENDS = ("torch", "flashinfer")
_FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def flashinfer_available() -> bool:
    """True when ``import flashinfer`` succeeds (any exception counts as unavailable)."""
    try:
        importlib.import_module("flashinfer")
    except Exception:  # noqa: BLE001 - a broken install is as good as a missing one here
        return False
    return True


def backend_name(device: torch.device | str, prefer: str | None = None,
                 dtype: torch.dtype | None = None) -> str:
    """The name :func:`select_backend` would pick (same errors), without constructing it."""
    dev = torch.device(device)
    if prefer is not None and prefer not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)} or None "
                         f"(automatic); got {prefer!r}")
    if prefer == "torch":
        return "torch"
    if prefer == "flashinfer":
        if dev.type != "cuda":
            raise ValueError(f"the flashinfer attention backend needs a CUDA device, got {dev}")
        if dtype is not None and dtype not in _FLASHINFER_DTYPES:
            raise ValueError(f"the flashinfer attention backend supports float16/bfloat16 "
                             f"models, got {dtype}; use the torch backend")
        if not flashinfer_available():
            raise ImportError(INSTALL_HINT)
        return "flashinfer"
    if dev.type == "cuda" and (dtype is None or dtype in _FLASHINFER_DTYPES) \
            and flashinfer_available():
        return "flashinfer"
    return "torch"


def select_backend(device: torch.device | str, prefer: str | None = None,
                   dtype: torch.dtype | None = None, **kwargs) -> AttentionBackend:
    """Construct the attention backend for ``device`` (see the module docstring).

    ``kwargs`` go to the flashinfer backend (``workspace_bytes``, ``use_tensor_cores``).
    """
    name = backend_name(device, prefer, dtype)
    if name == "flashinfer":
        from specdial.attention.flashinfer_backend import FlashInferAttentionBackend
        return FlashInferAttentionBackend(device, **kwargs)
    return TorchAttentionBackend(device)


def make_static_attention(backend: AttentionBackend, max_bs: int, qo_per_request: int,
                          kv_capacity: int, device: torch.device | str):
    """Fixed-shape attention metadata for ``backend`` (torch: :class:`TorchStaticAttention`;
    a backend with ``make_static_attention``, e.g. flashinfer: its own). ``TypeError`` else."""
    if isinstance(backend, TorchAttentionBackend):
        return TorchStaticAttention(max_bs, qo_per_request, kv_capacity, device)
    make = getattr(backend, "make_static_attention", None)
    if make is None:
        raise TypeError(f"{type(backend).__name__} has no CUDA-graph metadata "
                        "(make_static_attention)")
    return make(max_bs, qo_per_request, kv_capacity)
