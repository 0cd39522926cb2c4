"""Megatron-style tensor parallelism for the Llama-family modules (target, draft model, EAGLE).

:func:`shard_modules_` rewrites a model built on the meta device (before its weights are
loaded) so that rank ``r`` of a :class:`~specdial.distributed.group.TensorParallel` group of
``n`` ranks holds only its shard (Shoeybi et al. 2019, "Megatron-LM", section 3):

- attention: ``q_proj`` / ``k_proj`` / ``v_proj`` column-parallel (this rank's heads), the KV
  cache holds this rank's key/value heads only, ``o_proj`` row-parallel followed by an
  all-reduce (its bias added once, after the sum). With fewer key/value heads ``K`` than ranks
  (GQA), each rank keeps one key/value head, head ``r // (n // K)``, which serves exactly this
  rank's query heads (vLLM's ``QKVParallelLinear`` replication rule);
- MLP: ``gate_proj`` / ``up_proj`` column-parallel, ``down_proj`` row-parallel + all-reduce;
- fused projections (:func:`specdial.models.layers.fuse_linears_`): each rank fuses its own
  q/k/v (gate/up) shards, so the fused matmul yields this rank's heads (intermediate
  features) in the layout the unfused modules would;
- the vocabulary: ``embed_tokens`` split by rows (each rank looks up the ids it holds, zeros
  elsewhere, then an all-reduce) and ``lm_head`` split by rows with the logits all-gathered,
  so every rank sees the full ``[N, vocab]`` logits (identical bits on every rank, which the
  identical sampling on every rank relies on); a vocabulary that does not divide evenly is
  padded with zero rows on the last rank and the padding is cut from the logits. Tied
  embeddings stay one Parameter (the same rows on both ends).

Everything else (norms, EAGLE's ``fc``, rotary) is replicated. Which rows or columns of each
checkpoint tensor a rank reads is recorded on its module (:class:`Shard`), so the loader reads
only that slice from the safetensors file (:func:`read_shard`, ``safe_open(...).get_slice``).
Requirements (``ValueError`` naming the sizes otherwise): ``num_attention_heads`` and
``intermediate_size`` divisible by ``n``; ``num_key_value_heads`` divisible by ``n`` or
dividing ``n``. A group of one is never sharded: ``tp_size=1`` runs the unmodified modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdial.distributed.group import TensorParallel
from specdial.models.layers import MLP, Attention, LMHead

__all__ = ["Shard", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "ParallelLMHead", "shard_modules_", "param_shard", "read_shard", "slice_shard",
           "full_shape", "kv_head_range"]


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor one rank holds.

    ``dim``: 0 (rows: output features, vocabulary entries) or 1 (columns: input features);
    ``start`` / ``stop``: the range along ``dim``; ``full``: the checkpoint tensor's shape;
    ``pad``: zero rows appended after the slice (a short last vocabulary shard).
    """

    dim: int
    start: int
    stop: int
    full: tuple[int, ...]
    pad: int = 0


def slice_shard(t: torch.Tensor, shard: Shard) -> torch.Tensor:
    """This rank's part of the full tensor ``t`` (``t.shape == shard.full``), padding included."""
    part = t.narrow(shard.dim, shard.start, shard.stop - shard.start)
    if shard.pad:
        part = torch.cat([part, part.new_zeros((shard.pad,) + tuple(part.shape[1:]))], 0)
    return part


def read_shard(f: Any, name: str, shard: Shard) -> torch.Tensor:
    """Read only ``shard`` of tensor ``name`` from an open ``safetensors.safe_open`` handle
    (``get_slice``: the other rows/columns are never read). Returns a CPU tensor."""
    sl = f.get_slice(name)
    part = sl[shard.start:shard.stop] if shard.dim == 0 else sl[:, shard.start:shard.stop]
    if shard.pad:
        part = torch.cat([part, part.new_zeros((shard.pad,) + tuple(part.shape[1:]))], 0)
    return part


class ColumnParallelLinear(nn.Linear):
    """``nn.Linear`` holding rows ``shards["weight"]`` of the full weight (and bias): its output
    is this rank's slice of the full output features. No communication."""

    def __init__(self, in_features: int, full_out: int, start: int, stop: int, bias: bool,
                 tp: TensorParallel) -> None:
        super().__init__(in_features, stop - start, bias=bias)
        self.tp = tp
        self.shards = {"weight": Shard(0, start, stop, (full_out, in_features))}
        if bias:
            self.shards["bias"] = Shard(0, start, stop, (full_out,))


class RowParallelLinear(nn.Linear):
    """``nn.Linear`` over columns ``[start, stop)`` of the full weight's input features; the
    partial products are summed over the group (all-reduce), then the bias (replicated) is
    added once. Input: this rank's slice ``[..., stop - start]``; output ``[..., out]``."""

    def __init__(self, full_in: int, out_features: int, start: int, stop: int, bias: bool,
                 tp: TensorParallel) -> None:
        super().__init__(stop - start, out_features, bias=bias)
        self.tp = tp
        self.shards = {"weight": Shard(1, start, stop, (out_features, full_in))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def _vocab_range(vocab: int, tp: TensorParallel) -> tuple[int, int, int]:
    """``(start, stop, pad)`` of this rank's vocabulary rows: chunks of ``ceil(vocab / n)``."""
    chunk = -(-vocab // tp.size)
    start = min(vocab, tp.rank * chunk)
    stop = min(vocab, start + chunk)
    return start, stop, chunk - (stop - start)


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows ``[vocab_start, vocab_start + num_embeddings)`` of a ``vocab``-row table;
    ids outside the range embed to zero and the group's all-reduce fills them in.
    ``ids`` int64 any shape -> ``[..., embedding_dim]``."""

    def __init__(self, vocab: int, dim: int, tp: TensorParallel) -> None:
        start, stop, pad = _vocab_range(vocab, tp)
        super().__init__(stop - start + pad, dim)
        self.tp, self.vocab, self.vocab_start = tp, vocab, start
        self.shards = {"weight": Shard(0, start, stop, (vocab, dim), pad)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(inside, local, 0), self.weight)
        return self.tp.all_reduce(out * inside.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(LMHead):
    """LM head holding vocabulary rows ``[vocab_start, ...)``; ``forward`` gathers every rank's
    logits: ``[N, hidden]`` -> ``[N, vocab]`` (padding rows cut), identical on all ranks.
    Each rank's shard is stored transposed on the CPU, as :class:`LMHead`'s weight (a tied
    shard is also this rank's embedding rows, which then read strided)."""

    def __init__(self, hidden: int, vocab: int, tp: TensorParallel) -> None:
        start, stop, pad = _vocab_range(vocab, tp)
        super().__init__(hidden, stop - start + pad, bias=False)
        self.tp, self.vocab, self.vocab_start = tp, vocab, start
        self.shards = {"weight": Shard(0, start, stop, (vocab, hidden), pad)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(super().forward(x), -1)[..., :self.vocab]


def full_shape(module: nn.Module) -> tuple[int, ...]:
    """The unsharded weight shape of an embedding / linear (its own shape when not sharded)."""
    shards = getattr(module, "shards", None)
    return shards["weight"].full if shards else tuple(module.weight.shape)


def kv_head_range(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """``[first, stop)`` key/value heads rank ``tp.rank`` holds (one replicated head when
    there are fewer heads than ranks). Raises ``ValueError`` when neither divides the other."""
    n = tp.size
    if num_kv_heads >= n:
        if num_kv_heads % n:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) must be divisible by "
                             f"tp_size ({n}), or divide it")
        per = num_kv_heads // n
        return tp.rank * per, (tp.rank + 1) * per
    if n % num_kv_heads:
        raise ValueError(f"tp_size ({n}) must be a multiple of num_key_value_heads "
                         f"({num_kv_heads}) when it is larger")
    head = tp.rank // (n // num_kv_heads)
    return head, head + 1


def _shard_attention(attn: Attention, tp: TensorParallel) -> None:
    heads, d = attn.num_heads, attn.head_dim
    if heads % tp.size:
        raise ValueError(f"num_attention_heads ({heads}) must be divisible by tp_size "
                         f"({tp.size})")
    per = heads // tp.size
    q0, q1 = tp.rank * per * d, (tp.rank + 1) * per * d
    k0, k1 = kv_head_range(attn.num_kv_heads, tp)
    in_f, hidden = attn.q_proj.in_features, attn.o_proj.out_features
    qkv_bias, o_bias = attn.q_proj.bias is not None, attn.o_proj.bias is not None
    full_kv = attn.num_kv_heads * d
    attn.q_proj = ColumnParallelLinear(in_f, heads * d, q0, q1, qkv_bias, tp)
    attn.k_proj = ColumnParallelLinear(in_f, full_kv, k0 * d, k1 * d, qkv_bias, tp)
    attn.v_proj = ColumnParallelLinear(in_f, full_kv, k0 * d, k1 * d, qkv_bias, tp)
    attn.o_proj = RowParallelLinear(heads * d, hidden, q0, q1, o_bias, tp)
    attn.num_heads, attn.num_kv_heads = per, k1 - k0
    attn.fuse_()  # this rank's q/k/v shards, fused (the loader fuses again once loaded)


def _shard_mlp(mlp: MLP, tp: TensorParallel) -> None:
    hidden, inter = mlp.gate_proj.in_features, mlp.gate_proj.out_features
    if inter % tp.size:
        raise ValueError(f"intermediate_size ({inter}) must be divisible by tp_size ({tp.size})")
    per = inter // tp.size
    i0, i1 = tp.rank * per, (tp.rank + 1) * per
    bias = mlp.gate_proj.bias is not None
    mlp.gate_proj = ColumnParallelLinear(hidden, inter, i0, i1, bias, tp)
    mlp.up_proj = ColumnParallelLinear(hidden, inter, i0, i1, bias, tp)
    mlp.down_proj = RowParallelLinear(inter, hidden, i0, i1, mlp.down_proj.bias is not None, tp)
    mlp.fuse_()  # this rank's gate/up shards, fused (the loader fuses again once loaded)


def shard_modules_(model: nn.Module, tp: TensorParallel) -> nn.Module:
    """Shard ``model`` in place for rank ``tp.rank`` (see the module docstring); returns it.

    Call it on a model built on the meta device, before loading. Every :class:`Attention` and
    :class:`MLP` inside is sharded, and the model's own (registered) ``embed_tokens`` /
    ``lm_head`` are split by vocabulary rows; an EAGLE head's shared target modules are not
    registered on it and stay the target's (already sharded) ones. ``tp.size == 1`` returns
    ``model`` untouched. Raises ``ValueError`` for sizes the group cannot split.
    """
    if tp.size == 1:
        return model
    device = next(model.parameters()).device
    with torch.device(device):
        for module in list(model.modules()):
            if isinstance(module, Attention):
                _shard_attention(module, tp)
            elif isinstance(module, MLP):
                _shard_mlp(module, tp)
        emb = model._modules.get("embed_tokens")
        head = model._modules.get("lm_head")
        tied = emb is not None and head is not None and head.weight is emb.weight
        if isinstance(emb, nn.Embedding):
            model.embed_tokens = VocabParallelEmbedding(emb.num_embeddings, emb.embedding_dim, tp)
        if isinstance(head, nn.Linear):
            if head.bias is not None:
                raise ValueError("an lm_head with a bias cannot be split over the vocabulary")
            model.lm_head = ParallelLMHead(head.in_features, head.out_features, tp)
        if tied:
            model.lm_head.weight = model.embed_tokens.weight
            model.lm_head.fuse_()  # the LM head's layout (the loader ties and lays out again)
    return model


def param_shard(model: nn.Module, name: str) -> Shard | None:
    """The :class:`Shard` of parameter ``name`` (dotted, as in ``named_parameters``), or None
    when the parameter is replicated (read whole)."""
    owner, _, attr = name.rpartition(".")
    shards = getattr(model.get_submodule(owner), "shards", None)
    return shards.get(attr) if shards else None
