"""Llama-family causal LM (Llama 2/3, Qwen2) over the paged KV pool."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import torch
from torch import nn

from specdial.attention.base import AttentionBackend
from specdial.kv_pool import KVPool
from specdial.models.batch import ForwardBatch
from specdial.models.config import ModelConfig
from specdial.models.layers import DecoderLayer, LMHead, RMSNorm, RotaryEmbedding


def run_layers(layers: nn.ModuleList, rotary: RotaryEmbedding, x: torch.Tensor,
               batch: ForwardBatch, kv: KVPool, backend: AttentionBackend,
               kv_only: bool, capture: Sequence[int] = (),
               captured: list[torch.Tensor] | None = None) -> torch.Tensor | None:
    """Run ``layers`` over ``x`` ``[T, hidden]``; ``kv_only``: the last layer only writes K/V.

    ``capture``: residual-stream indices to append to ``captured``, in ascending order:
    index ``i < len(layers)`` is the input of layer ``i`` (0: the embeddings), index
    ``len(layers)`` the last layer's output (before any final norm).
    """
    cos, sin = rotary(batch.positions, x.dtype)
    last = len(layers) - 1
    for i, layer in enumerate(cast(Iterable[DecoderLayer], layers)):
        if captured is not None and i in capture:
            captured.append(x)
        if kv_only and i == last:
            layer.write_kv_only(x, cos, sin, batch, kv)
            return None
        x = layer(x, cos, sin, batch, kv, backend)
    if captured is not None and len(layers) in capture:
        captured.append(x)
    return x


class LlamaForCausalLM(nn.Module):
    """Llama-family decoder: ``embed_tokens -> layers -> norm``, plus ``lm_head``.

    Serves ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` checkpoints (Qwen2: q/k/v bias, see
    :class:`ModelConfig`). With ``tie_word_embeddings`` ``lm_head.weight`` *is*
    ``embed_tokens.weight`` (one Parameter, :meth:`tie_lm_head_`); ``lm_head`` is an
    :class:`~specdial.models.layers.LMHead` (its weight stored transposed on the CPU).
    Parameter names are HF's without the ``model.`` prefix. Layer ``i`` uses layer ``i`` of the :class:`KVPool`, which must have
    ``num_hidden_layers`` layers, ``num_key_value_heads`` heads (this rank's share under tensor
    parallelism) and ``head_dim``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Linear = LMHead(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.tie_lm_head_()
        self.rotary = RotaryEmbedding(config)

    def tie_lm_head_(self) -> None:
        """Make ``lm_head.weight`` *be* ``embed_tokens.weight`` (one Parameter), stored in
        the LM head's layout (:class:`~specdial.models.layers.LMHead`: transposed on the
        CPU, so the embedding's rows are strided there). Call it after replacing either."""
        self.lm_head.weight = self.embed_tokens.weight
        if isinstance(self.lm_head, LMHead):
            self.lm_head.fuse_()

    def forward(self, batch: ForwardBatch, kv: KVPool, backend: AttentionBackend, *,
                input_embeds: torch.Tensor | None = None,
                kv_only: bool = False) -> torch.Tensor | None:
        """Run the batch, writing every layer's K/V at ``batch.out_loc``.

        ``input_embeds`` ``[T, hidden]`` replaces ``embed_tokens(batch.input_ids)``.
        Returns the final hidden states after the final norm, ``[T, hidden]`` in the model
        dtype; with ``kv_only=True`` only the K/V writes happen (the last layer skips its
        attention, o_proj and MLP) and None is returned.
        """
        x = self.embed_tokens(batch.input_ids) if input_embeds is None else input_embeds
        x = run_layers(self.layers, self.rotary, x, batch, kv, backend, kv_only)
        return None if x is None else self.norm(x)

    def forward_with_aux(self, batch: ForwardBatch, kv: KVPool, backend: AttentionBackend,
                         aux_layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`, also returning the residual stream at ``aux_layers`` (EAGLE-3).

        ``aux_layers``: distinct indices in ``0..num_hidden_layers``, ascending: index ``i`` is
        the input of layer ``i`` (the output of layer ``i - 1``; 0 is the embeddings), index
        ``num_hidden_layers`` the last layer's output before the final norm. This is where
        SGLang and vLLM capture EAGLE-3's auxiliary hidden states (``hidden_states +
        residual`` before a layer). Returns ``(final hidden [T, hidden], aux [T,
        len(aux_layers) * hidden])``, the captured states concatenated in ascending layer
        order. Raises ``ValueError`` for indices that are out of range, repeated or unsorted.
        """
        n = self.config.num_hidden_layers
        layers = tuple(aux_layers)
        if not layers or list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] > n:
            raise ValueError(f"aux_layers must be distinct ascending indices in 0..{n} "
                             f"(the residual stream before each layer), got {list(layers)}")
        captured: list[torch.Tensor] = []
        x = run_layers(self.layers, self.rotary, self.embed_tokens(batch.input_ids), batch, kv,
                       backend, False, layers, captured)
        assert x is not None
        return self.norm(x), torch.cat(captured, -1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[N, hidden]`` -> float32 logits ``[N, vocab_size]``."""
        return self.lm_head(hidden).float()

    def make_kv_pool(self, num_slots: int, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> KVPool:
        """A :class:`KVPool` shaped for this model (dtype/device default to the weights')."""
        w = self.embed_tokens.weight
        c = self.config
        kv_heads = cast(DecoderLayer, self.layers[0]).self_attn.num_kv_heads  # this rank's
        return KVPool(c.num_hidden_layers, num_slots, kv_heads, c.head_dim,
                      dtype or w.dtype, device or w.device)


Qwen2ForCausalLM = LlamaForCausalLM
