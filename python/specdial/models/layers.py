"""Llama-family building blocks over the paged KV pool.

Numerics follow transformers' Llama/Qwen2 exactly: RMSNorm in float32 then cast back and
scaled, rotary embedding with the ``rotate_half`` convention (cos/sin computed in float32,
cast to the activation dtype), SwiGLU MLP, GQA attention with optional biases.

Fused projections (issue 29: on a small model every torch op costs a few µs, whatever its
size): ``q/k/v_proj`` run as one matmul, ``gate/up_proj`` as one, over weights stored once,
concatenated and transposed (``[in, out]`` contiguous, see :func:`fuse_linears_`). The modules
keep transformers' names and parameters (checkpoints, ``state_dict``, tensor-parallel shards):
their weights are views of the fused storage. Where gradients are enabled (training the
built-in models) the forward calls the separate modules instead, so gradients reach them (and
so does :class:`MLP` for inputs with more than one leading dimension).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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
        if dtype == torch.float32:  # one call: torch's rms_norm, the same formula in float32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
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

    On the CPU both come from a table indexed by position (``[P, 2, head_dim]`` per dtype,
    :meth:`table`): one ``index_select`` per forward instead of ~12 small ops (issue 29; the
    values are the formula's, computed the same way per element, as vLLM's ``cos_sin_cache``).
    The table starts at ``max(TABLE_MIN, max_position_embeddings)`` positions, capped at
    ``TABLE_MAX``, and doubles when a forward reaches past it (a failed ``index_select``:
    nothing is checked per forward). Other devices run the formula per forward (no table
    read can fail inside a CUDA graph).
    """

    #: bounds of the first table's length; a longer one is built only when a position needs it
    TABLE_MIN = 4096
    TABLE_MAX = 32768

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.table_len = min(max(self.TABLE_MIN, config.max_position_embeddings),
                             self.TABLE_MAX)
        self._tables: dict[torch.dtype, torch.Tensor] = {}

    def _apply(self, fn, recurse=True):  # keep inv_freq float32; follow device moves only
        inv = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv.to(fn(inv).device)
        self._tables = {}  # built again on the new device, when needed
        return self

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The formula: ``[T, 2, head_dim]`` (``cos``, ``rot_sin``) in ``dtype`` for
        ``positions`` ``[T]`` (any integer dtype; float32 math, cast at the end)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        sin = emb.sin()
        sin[:, : sin.shape[-1] // 2].neg_()
        return torch.stack([emb.cos(), sin], 1).to(dtype)

    def table(self, dtype: torch.dtype, min_len: int = 0) -> torch.Tensor:
        """The CPU table ``[P, 2, head_dim]`` in ``dtype``: row ``p`` is :meth:`rotation` of
        position ``p``; rebuilt ``P``-doubled until ``P >= min_len``."""
        t = self._tables.get(dtype)
        if t is None or t.shape[0] < min_len:
            while self.table_len < min_len:
                self.table_len *= 2
            t = self.rotation(torch.arange(self.table_len, device=self.inv_freq.device), dtype)
            self._tables[dtype] = t
        return t

    def forward(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.device.type != "cpu" or self.inv_freq.device.type != "cpu":
            t = self.rotation(positions, dtype)
        else:
            try:
                t = self.table(dtype).index_select(0, positions)
            except IndexError:  # a position past the table (or negative: the formula)
                lo, hi = int(positions.min()), int(positions.max())
                t = (self.rotation(positions, dtype) if lo < 0
                     else self.table(dtype, hi + 1).index_select(0, positions))
        return t[:, :1], t[:, 1:]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, rot_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by :class:`RotaryEmbedding`'s ``cos`` /
    ``rot_sin`` ``[T, 1, head_dim]``: transformers' ``x * cos + rotate_half(x) * sin``,
    bit for bit (``rotate_half(x) = cat(-x2, x1)``, here ``x.roll(half) * rot_sin``)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * rot_sin


def fuse_linears_(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Store ``linears`` (same ``in_features``, on one device) as one transposed weight.

    Returns ``(wt, bias)``: ``wt`` ``[in, sum(out)]`` contiguous, the modules' output features
    side by side in the order given, so ``x @ wt`` (``x`` ``[T, in]``) is ``cat([l(x) for l in
    linears], -1)`` up to float rounding; ``bias`` ``[sum(out)]`` or None. Each module's
    ``weight`` (and ``bias``) becomes a Parameter *viewing* its columns (entries), its
    ``requires_grad`` kept: names, shapes, ``state_dict``, ``load_state_dict`` and in-place
    edits work as before and change the fused tensors too. Replacing a Parameter (or a
    module) breaks that link: call the owner's ``fuse_()`` again (the loaders do, through
    :func:`refuse_`). Why transposed: this CPU's GEMM (MKL) is faster on ``x @ wt`` than on
    ``x @ w.T`` (``F.linear``) over the same values: 190 -> 131 µs per decoder layer's four
    projections at 4 tokens, 358 -> 219 at 16 (BENCHMARKS, issue 29's per-op section; cuBLAS
    takes either layout). Raises
    ``ValueError`` when the modules differ in ``in_features`` or only some have a bias.
    """
    if len({m.in_features for m in linears}) != 1:
        raise ValueError(f"fused linears need one in_features, got {[m.in_features for m in linears]}")
    if len({m.bias is None for m in linears}) != 1:
        raise ValueError("fused linears must all have a bias or all have none")
    with torch.no_grad():
        wt = torch.cat([m.weight for m in linears], 0).t().contiguous()
        bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
        start = 0
        for m in linears:
            stop = start + m.out_features
            m.weight = nn.Parameter(wt[:, start:stop].t(), requires_grad=m.weight.requires_grad)
            if bias is not None:
                m.bias = nn.Parameter(bias[start:stop], requires_grad=m.bias.requires_grad)
            start = stop
    return wt, bias


def _mm(x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``[T, in]`` @ ``wt`` ``[in, out]`` (+ ``bias``): one op."""
    return torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt)


def _out_proj(h: torch.Tensor, module: nn.Linear, wt: torch.Tensor | None,
              residual: torch.Tensor | None) -> torch.Tensor:
    """``residual + module(h)`` (``module(h)`` without a residual). ``wt``: the module's
    transposed weight when it is a plain ``nn.Linear`` without bias, run as one op
    (``addmm`` adds the residual); None for other modules (a row-parallel one all-reduces
    before its bias and the residual), which are called."""
    if wt is not None:
        return torch.mm(h, wt) if residual is None else torch.addmm(residual, h, wt)
    y = module(h)
    return y if residual is None else residual + y


def _direct_t(module: nn.Linear) -> torch.Tensor | None:
    """``module``'s weight stored transposed (:func:`fuse_linears_`); returned when the module
    is a plain ``nn.Linear`` without bias (:func:`_out_proj` runs it as one op), else None."""
    wt, bias = fuse_linears_((module,))
    return wt if type(module) is nn.Linear and bias is None else None


class Fused(nn.Module):
    """Base of the modules whose projections are fused (:func:`fuse_linears_`): ``fuse_()``
    (re)builds the fused storage; it runs at construction, after every ``.to()`` / dtype /
    device move and after ``copy.deepcopy`` / unpickling (each copies every parameter
    separately)."""

    def fuse_(self) -> None:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.fuse_()
        return self

    def __setstate__(self, state) -> None:
        # copy.deepcopy and unpickling clone each Parameter on its own: fuse the copies again
        super().__setstate__(state)
        self.fuse_()


def refuse_(model: nn.Module) -> nn.Module:
    """Rebuild the fused storage of every :class:`Fused` module in ``model`` from its current
    parameters (after parameters or modules were replaced: loading, tensor-parallel
    sharding); returns ``model``."""
    for m in model.modules():
        if isinstance(m, Fused):
            m.fuse_()
    return model


def store_transposed_(param: torch.Tensor) -> None:
    """Give the 2-D ``param`` (``[out, in]``, e.g. an LM head's ``[vocab, hidden]``) the
    memory layout of its transpose on the CPU, in place: its values, shape and identity stay,
    its storage becomes ``[in, out]`` contiguous, so ``param.t()`` is a contiguous view and
    ``torch.mm(x, param.t())`` runs MKL's untransposed GEMM (:func:`fuse_linears_`'s reason;
    the built-in target's LM head over 4 rows: 411 -> 301 µs, over 17 rows 618 -> 543 µs,
    unchanged over one row, BENCHMARKS issue 29).
    ``param.data`` is replaced, not the Parameter, so every module sharing it keeps sharing
    it: a tied embedding then looks up strided rows (+1 µs per decode token; +0.4 ms per
    256 prompt tokens at the built-in vocabulary). On other devices the row-major layout is kept
    (restored after a move from the CPU): cuBLAS takes either layout and a GPU's strided
    embedding reads would be uncoalesced. The meta device is left alone. Idempotent."""
    if param.dim() != 2 or param.device.type == "meta":
        return
    with torch.no_grad():
        if param.device.type == "cpu":
            if not param.t().is_contiguous():
                param.data = param.data.t().contiguous().t()
        elif not param.is_contiguous():
            param.data = param.data.contiguous()


class LMHead(Fused, nn.Linear):
    """The LM head: ``nn.Linear(hidden, vocab)`` (``weight`` ``[vocab, hidden]``,
    transformers' name and layout in ``state_dict``) whose weight is stored transposed on the
    CPU (:func:`store_transposed_`). The weight stays one Parameter: tied to the embedding it
    *is* ``embed_tokens.weight`` (one source of truth; in-place edits, ``load_state_dict``
    and EAGLE heads sharing it see the same memory). ``fuse_()`` (re)applies the layout after
    the Parameter was replaced (loading, tying, sharding: :func:`refuse_`). Forward:
    ``x`` ``[N, hidden]`` -> ``[N, vocab]`` in the weight's dtype as ``torch.mm(x,
    weight.t())`` (what ``F.linear`` runs, on the stored layout); inputs with other than two
    dimensions, or a bias, go through ``F.linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        nn.Linear.__init__(self, in_features, out_features, bias=bias)
        self.fuse_()

    def fuse_(self) -> None:
        store_transposed_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.bias is None:
            return torch.mm(x, self.weight.t())
        return F.linear(x, self.weight, self.bias)


class MLP(Fused):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; gate and up as one matmul (module docstring)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.fuse_()

    def fuse_(self) -> None:
        """``gate_up_t`` ``[hidden, 2 * inter]`` (this rank's ``inter``), ``gate_up_bias``;
        ``down_t``: ``down_proj``'s weight, stored transposed too, run directly when the
        module is a plain ``nn.Linear`` without bias (else None: the module runs, e.g. a
        row-parallel one, which all-reduces)."""
        self.gate_up_t, self.gate_up_bias = fuse_linears_((self.gate_proj, self.up_proj))
        self.inter = self.gate_proj.out_features
        self.down_t = _direct_t(self.down_proj)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[T, hidden]`` (any leading dims where gradients are enabled) -> same shape;
        ``residual`` (same shape) is added to the output (by the down projection's GEMM)."""
        if torch.is_grad_enabled() or x.dim() != 2:  # training (gradients reach the modules)
            y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
            return y if residual is None else residual + y
        gu = _mm(x, self.gate_up_t, self.gate_up_bias)
        h = F.silu(gu[:, :self.inter]) * gu[:, self.inter:]
        return _out_proj(h, self.down_proj, self.down_t, residual)


class Attention(Fused):
    """GQA self-attention writing K/V for the new tokens to the pool, then reading it back.

    ``input_size``: width of the q/k/v projections' input (default ``hidden_size``; an EAGLE-3
    midlayer reads ``cat(embeds, hidden)``, ``2 * hidden_size``). The output is
    ``hidden_size`` wide either way. q, k and v run as one matmul (module docstring).
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
        self.fuse_()

    def fuse_(self) -> None:
        """``qkv_t`` ``[in, (heads + 2 * kv_heads) * head_dim]`` (this rank's heads),
        ``qkv_bias``; ``kv_t`` / ``kv_bias`` its k/v columns (views); ``o_t``: ``o_proj``'s
        weight, stored transposed too, run directly when the module is a plain ``nn.Linear``
        without bias (else None: the module runs, e.g. a row-parallel one, which
        all-reduces). Call it after replacing ``q/k/v/o_proj`` or their parameters."""
        self.qkv_t, self.qkv_bias = fuse_linears_((self.q_proj, self.k_proj, self.v_proj))
        q = self.q_proj.out_features
        self.kv_t = self.qkv_t[:, q:]
        self.kv_bias = None if self.qkv_bias is None else self.qkv_bias[q:]
        self.o_t = _direct_t(self.o_proj)

    def _kv(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in]`` -> ``[T, 2 * kv_heads, head_dim]``: k (unrotated), then v."""
        if torch.is_grad_enabled():
            kv = torch.cat([self.k_proj(x), self.v_proj(x)], -1)
        else:
            kv = _mm(x, self.kv_t, self.kv_bias)
        return kv.view(x.shape[0], 2 * self.num_kv_heads, self.head_dim)

    def write_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 batch: ForwardBatch, kv: KVPool) -> None:
        """Project, rotate and store K/V of ``x`` ``[T, hidden]`` at ``batch.out_loc``."""
        kvh = self.num_kv_heads
        k_v = self._kv(x)
        kv.write(self.layer_id, batch.out_loc, apply_rotary(k_v[:, :kvh], cos, sin), k_v[:, kvh:])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, kv: KVPool, backend: AttentionBackend,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[T, in]`` -> ``[T, hidden]`` (plus ``residual`` ``[T, hidden]`` if given,
        added by o_proj's GEMM); writes this layer's K/V at ``batch.out_loc``."""
        t, h, kvh = x.shape[0], self.num_heads, self.num_kv_heads
        grad = torch.is_grad_enabled()
        if grad:  # training: gradients reach q_proj, k_proj and v_proj
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        else:
            qkv = _mm(x, self.qkv_t, self.qkv_bias)
        qkv = qkv.view(t, h + 2 * kvh, self.head_dim)
        qk = apply_rotary(qkv[:, :h + kvh], cos, sin)  # one rotation for q and k
        kv.write(self.layer_id, batch.out_loc, qk[:, h:], qkv[:, h + kvh:])
        o = backend.forward(qk[:, :h], self.layer_id, kv, batch.attn, self.scale)
        return _out_proj(o.reshape(t, h * self.head_dim), self.o_proj,
                         None if grad else self.o_t, residual)


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
        x = self.self_attn(self.input_layernorm(x), cos, sin, batch, kv, backend, x)
        return self.mlp(self.post_attention_layernorm(x), x)

    def write_kv_only(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      batch: ForwardBatch, kv: KVPool) -> None:
        """Only what the KV cache needs: input norm, k/v projections, rope, KV write."""
        self.self_attn.write_kv(self.input_layernorm(x), cos, sin, batch, kv)
