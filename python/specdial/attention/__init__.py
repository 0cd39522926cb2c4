"""Attention backends over the paged KV pool."""

from specdial.attention.base import AttentionBackend, AttentionMetadata
from specdial.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend",
           "TorchAttentionMetadata"]
