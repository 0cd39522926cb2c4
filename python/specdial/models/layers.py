"""Llama-family building blocks over the paged KV pool.

Numerics follow transformers' Llama/Qwen2 exactly: RMSNorm in float32 then cast back and
scaled, rotary embedding with the ``rotate_half`` convention (cos/sin computed in float32,
cast to the activation dtype), SwiGLU MLP, GQA attention with optional biases.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specdial.attention.base import AttentionBackend
from specdial.kv_pool import KVPool
from specdial.models.batch import ForwardBatch
from specdial.models.config import ModelConfig


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``; x ``[..., hidden]`` any float dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # no casts (each a dispatched no-op, per layer)
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim // 2]`` float32 on CPU (llama3 scaling applied)."""
    dim = config.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta ** exponent)
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Computes the rotation ``(cos, rot_sin)`` ``[T, 1, head_dim]`` for positions ``[T]``,
    once per forward, in the form :func:`apply_rotary` takes.

    ``cos``/``sin`` are transformers' (``emb = cat(freqs, freqs)``, computed in float32, cast
    to ``dtype``); ``rot_sin`` is ``sin`` with its first half negated, so that
    ``rotate_half(x) * sin == x.roll(head_dim // 2, -1) * rot_sin`` exactly (negation is exact
    in floating point): the rotation then costs 4 ops instead of 7. ``inv_freq`` stays float32
    even if the module is cast to another dtype.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def _apply(self, fn, recurse=True):  # keep inv_freq float32; follow device moves only
        inv = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv.to(fn(inv).device)
        return self

    def forward(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        sin = emb.sin().to(dtype)
        half = sin.shape[-1] // 2
        sin[:, :half].neg_()
        return emb.cos().to(dtype)[:, None, :], sin[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, rot_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by :class:`RotaryEmbedding`'s ``cos`` /
    ``rot_sin`` ``[T, 1, head_dim]``: transformers' ``x * cos + rotate_half(x) * sin``,
    bit for bit (``rotate_half(x) = cat(-x2, x1)``, here ``x.roll(half) * rot_sin``)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * rot_sin


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """GQA self-attention writing K/V for the new tokens to the pool, then reading it back.

    ``input_size``: width of the q/k/v projections' input (default ``hidden_size``; an EAGLE-3
    midlayer reads ``cat(embeds, hidden)``, ``2 * hidden_size``). The output is
    ``hidden_size`` wide either way.
    """

    def __init__(self, config: ModelConfig, layer_id: int, input_size: int | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d = config.head_dim
        self.scale = d ** -0.5
        h = config.hidden_size
        i = input_size or h
        self.q_proj = nn.Linear(i, self.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(i, self.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(i, self.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.o_bias)

    def write_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 batch: ForwardBatch, kv: KVPool) -> None:
        """Project, rotate and store K/V of ``x`` ``[T, hidden]`` at ``batch.out_loc``."""
        t = x.shape[0]
        k = apply_rotary(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        kv.write(self.layer_id, batch.out_loc, k, v)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, kv: KVPool, backend: AttentionBackend) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        q = self.q_proj(x).view(t, h, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        qk = apply_rotary(torch.cat([q, k], 1), cos, sin)  # one rotation for q and k
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        kv.write(self.layer_id, batch.out_loc, qk[:, h:], v)
        o = backend.forward(qk[:, :h], self.layer_id, kv, batch.attn, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    ``layer_id`` is the layer's index in the KV pool it reads and writes. ``input_norm=False``
    replaces the input RMSNorm by the identity (no parameter): the first layer of the EAGLE-1
    heads SGLang and vLLM load (``LlamaForCausalLMEagle`` / ``EagleLlamaForCausalLM``), as in
    the EAGLE reference code, which drops that norm.
    """

    def __init__(self, config: ModelConfig, layer_id: int, *, input_norm: bool = True) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_id)
        self.mlp = MLP(config)
        self.input_layernorm: nn.Module = (RMSNorm(config.hidden_size, config.rms_norm_eps)
                                           if input_norm else nn.Identity())
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, kv: KVPool, backend: AttentionBackend) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]``; writes this layer's K/V."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, kv, backend)
        return x + self.mlp(self.post_attention_layernorm(x))

    def write_kv_only(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      batch: ForwardBatch, kv: KVPool) -> None:
        """Only what the KV cache needs: input norm, k/v projections, rope, KV write."""
        self.self_attn.write_kv(self.input_layernorm(x), cos, sin, batch, kv)
