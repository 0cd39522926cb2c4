"""EAGLE-3 draft head (Li et al. 2025, arXiv 2503.01840): multi-layer feature fusion.

Where EAGLE-1 reads the target's final hidden state, an EAGLE-3 head reads the target's residual
stream at a few layers (low, middle, high), fuses them with ``fc`` and drafts over its own,
smaller vocabulary:

- fused features of position ``p - 1``: ``g = fc(cat(aux_1, ..., aux_k))`` ``[H]``, where
  ``aux_j`` is the target's residual stream at layer index ``aux_layers[j]`` (see
  :meth:`~specdial.models.LlamaForCausalLM.forward_with_aux`); the worker stores ``g`` per KV
  slot, so ``fc`` runs once per target token;
- one decoder layer (``midlayer``) over ``x = cat(input_layernorm(embed(x_p)), hidden_norm(h))``
  of width ``2 H``, with ``h = g`` at the first draft step and the head's own previous output
  afterwards; the residual is ``h`` (``hidden_norm(h)`` with ``norm_before_residual``, vLLM's
  option); then post-attention norm and MLP as in Llama; the output ``o`` (before ``norm``) is
  the next step's ``h``;
- logits ``lm_head(norm(o))`` over ``draft_vocab_size`` tokens; draft token ``i`` is target
  token ``i + d2t[i]`` (:attr:`Eagle3Head.draft_to_target`).

This is the computation of SGLang's ``LlamaForCausalLMEagle3`` and vLLM's
``Eagle3LlamaForCausalLM`` (one midlayer). Checkpoints (loaded by
:func:`specdial.models.load_eagle3_head`): ``fc.weight`` ``[H, k * H_target]`` (``fc.bias`` when
the config's ``bias`` is set), ``midlayer.*`` (SGLang) or ``layers.0.*`` (vLLM, speculators) in HF
Llama naming (``self_attn.q_proj.weight`` ``[heads * head_dim, 2 H]``, ...,
``input_layernorm``, ``hidden_norm``, ``post_attention_layernorm``, ``mlp.*``), ``norm.weight``,
``lm_head.weight`` ``[draft_vocab_size, H]``, ``d2t`` ``[draft_vocab_size]`` int64 (target id
minus draft id), ``t2d`` ``[vocab_size]`` bool (target ids in the draft vocabulary), optionally
``embed_tokens.weight``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specdial.attention.base import AttentionBackend
from specdial.kv_pool import KVPool
from specdial.models.batch import ForwardBatch
from specdial.models.config import ModelConfig
from specdial.models.layers import MLP, Attention, LMHead, RMSNorm, RotaryEmbedding
from specdial.models.tensor_parallel import full_shape

#: ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang, SpecForge) names the layer whose
#: *output* is captured; top-level ``eagle_aux_hidden_state_layer_ids`` (vLLM, speculators)
#: names the layer whose *input* is captured. Without either, both capture the inputs of layers
#: ``(2, N // 2, N - 3)`` of an ``N``-layer target.
NESTED_IDS = "eagle_config.eagle_aux_hidden_state_layer_ids"
TOP_LEVEL_IDS = "eagle_aux_hidden_state_layer_ids"


@dataclass(frozen=True)
class Eagle3Spec:
    """What an EAGLE-3 head adds to its one-layer Llama config.

    - ``aux_layers``: target residual-stream indices fused by ``fc``, distinct and ascending
      (index ``i``: the input of target layer ``i``; ``N``: the last layer's output);
    - ``target_hidden_size``: the target's hidden size (``fc`` input is
      ``len(aux_layers) * target_hidden_size``);
    - ``draft_vocab_size``: rows of the head's ``lm_head``;
    - ``norm_before_residual``: the residual is ``hidden_norm(h)`` instead of ``h`` (vLLM);
    - ``fc_bias``: ``fc`` has a bias.
    """

    aux_layers: tuple[int, ...]
    target_hidden_size: int
    draft_vocab_size: int
    norm_before_residual: bool = False
    fc_bias: bool = False


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """Inputs of layers ``(2, N // 2, N - 3)``: SGLang's and vLLM's default for ``N`` layers."""
    return (2, num_layers // 2, num_layers - 3)


def resolve_aux_layers(nested: Any, top_level: Any, num_layers: int) -> tuple[int, ...]:
    """Residual-stream indices of an ``num_layers``-layer target from a head's config fields.

    ``nested`` (``eagle_config.eagle_aux_hidden_state_layer_ids``, SGLang's reading: layer ids
    whose output is captured, so index ``id + 1``) wins over ``top_level`` (vLLM's reading:
    index ``id``); without either, :func:`default_aux_layers`. Repeated indices count once and
    the states are concatenated in ascending layer order, as both engines capture them inside
    their layer loop. Raises ``ValueError`` naming the field for a non-list, a non-integer or
    an index outside ``0..num_layers``.
    """
    if nested is not None:
        field, ids, shift = NESTED_IDS, nested, 1
    elif top_level is not None:
        field, ids, shift = TOP_LEVEL_IDS, top_level, 0
    else:
        field, ids, shift = f"the default (2, N // 2, N - 3) for N = {num_layers}", \
            list(default_aux_layers(num_layers)), 0
    if not isinstance(ids, (list, tuple)) or not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{field} must be a non-empty list of layer indices, got {ids!r}")
    idx = sorted({i + shift for i in ids})
    if idx[0] < 0 or idx[-1] > num_layers:
        raise ValueError(f"{field} = {list(ids)} selects residual-stream indices {idx}, outside "
                         f"0..{num_layers} for a target of {num_layers} layers")
    return tuple(idx)


class Eagle3DecoderLayer(nn.Module):
    """The midlayer: attention over ``cat(input_layernorm(embeds), hidden_norm(h))``."""

    def __init__(self, config: ModelConfig, norm_before_residual: bool) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = Attention(config, 0, input_size=2 * h)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(config)

    def _inputs(self, embeds: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], -1), residual

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, batch: ForwardBatch, kv: KVPool,
                backend: AttentionBackend) -> torch.Tensor:
        """``embeds``, ``hidden`` ``[T, H]`` -> output before the final norm ``[T, H]``."""
        x, residual = self._inputs(embeds, hidden)
        r = self.self_attn(x, cos, sin, batch, kv, backend, residual)
        return self.mlp(self.post_attention_layernorm(r), r)

    def write_kv_only(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, batch: ForwardBatch, kv: KVPool) -> None:
        """Only what the KV cache needs: the norms, k/v projections, rope, KV write."""
        self.self_attn.write_kv(self._inputs(embeds, hidden)[0], cos, sin, batch, kv)


class Eagle3Head(nn.Module):
    """EAGLE-3 head (see the module docstring) for a target with ``target_embed``.

    - ``config``: the head's one-layer Llama config (``vocab_size`` = the target's);
      ``spec``: :class:`Eagle3Spec`.
    - ``target_embed``: shared unless ``own_embedding`` (then ``embed_tokens`` is a parameter
      of the head: a checkpoint whose embedding differs from the target's, vLLM's rule).
    - ``target_lm_head``: share the target's LM head (a head saved without ``lm_head``, SGLang's
      ``draft_vocab_size`` None); else ``lm_head`` ``[draft_vocab_size, H]`` is the head's own.

    Buffer :attr:`draft_to_target` ``[draft_vocab_size]`` int64: the target id of each draft id
    (identity until :meth:`set_vocab_map`). Raises ``ValueError`` for more than one layer,
    sizes that do not match the target, or a shared LM head with a reduced vocabulary.
    """

    embed_tokens: nn.Embedding
    lm_head: nn.Linear
    draft_to_target: torch.Tensor

    def __init__(self, config: ModelConfig, spec: Eagle3Spec, target_embed: nn.Embedding,
                 target_lm_head: nn.Linear | None = None, *, own_embedding: bool = False) -> None:
        super().__init__()
        if config.num_hidden_layers != 1:
            raise ValueError(f"Eagle3Head has one decoder layer (midlayer), config says "
                             f"num_hidden_layers={config.num_hidden_layers}")
        vocab, target_hidden = full_shape(target_embed)  # unsharded under tensor parallelism
        h = config.hidden_size
        if config.vocab_size != vocab:
            raise ValueError(f"EAGLE-3 head vocab_size {config.vocab_size} differs from the "
                             f"target's {vocab}")
        if spec.target_hidden_size != target_hidden:
            raise ValueError(f"EAGLE-3 head target_hidden_size {spec.target_hidden_size} differs "
                             f"from the target's hidden size {target_hidden}")
        if not own_embedding and h != target_hidden:
            raise ValueError(f"EAGLE-3 head hidden_size {h} differs from the target's "
                             f"{target_hidden}: it needs its own embed_tokens")
        if not 1 <= spec.draft_vocab_size <= vocab:
            raise ValueError(f"draft_vocab_size {spec.draft_vocab_size} outside 1..{vocab}")
        self.config, self.spec = config, spec
        if own_embedding:
            self.embed_tokens = nn.Embedding(vocab, h)
        else:
            object.__setattr__(self, "embed_tokens", target_embed)  # shared, not a parameter
        self.fc = nn.Linear(len(spec.aux_layers) * target_hidden, h, bias=spec.fc_bias)
        self.midlayer = Eagle3DecoderLayer(config, spec.norm_before_residual)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        if target_lm_head is not None:
            if spec.draft_vocab_size != vocab or full_shape(target_lm_head) != (vocab, h):
                raise ValueError("a head sharing the target's lm_head drafts over the full "
                                 f"vocabulary ({vocab}) at hidden size {h}")
            object.__setattr__(self, "lm_head", target_lm_head)
        else:
            self.lm_head = LMHead(h, spec.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        self.register_buffer("draft_to_target", torch.arange(spec.draft_vocab_size),
                             persistent=False)

    @property
    def identity_vocab(self) -> bool:
        """True when draft ids are target ids (full vocabulary, identity map)."""
        return bool(self.spec.draft_vocab_size == self.config.vocab_size and torch.equal(
            self.draft_to_target.cpu(), torch.arange(self.spec.draft_vocab_size)))

    def set_vocab_map(self, d2t: torch.Tensor | None, t2d: torch.Tensor | None = None,
                      device: torch.device | str | None = None) -> None:
        """Set :attr:`draft_to_target` from published tensors: ``d2t`` ``[draft_vocab_size]``
        integer offsets (target id = draft id + offset; None: identity, as SGLang and vLLM do
        without it) and the optional ``t2d`` ``[vocab_size]`` bool mask, checked against it.
        Raises ``ValueError`` for wrong shapes or dtypes, target ids outside the vocabulary,
        two draft ids mapping to one target id, or a ``t2d`` that disagrees."""
        vd, v = self.spec.draft_vocab_size, self.config.vocab_size
        ids = torch.arange(vd)
        if d2t is not None:
            if tuple(d2t.shape) != (vd,) or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
                raise ValueError(f"d2t must be an integer tensor [{vd}] (draft_vocab_size), got "
                                 f"{d2t.dtype} {list(d2t.shape)}")
            ids = ids + d2t.to("cpu", torch.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= v:
            raise ValueError(f"d2t maps draft ids to target ids outside [0, {v})")
        if torch.unique(ids).numel() != vd:
            raise ValueError("d2t maps two draft ids to the same target id")
        if t2d is not None:
            mask = torch.zeros(v, dtype=torch.bool)
            mask[ids] = True
            if tuple(t2d.shape) != (v,) or not torch.equal(t2d.to("cpu", torch.bool), mask):
                raise ValueError(f"t2d [{list(t2d.shape)}] does not mark exactly the target ids "
                                 "d2t maps to")
        self.draft_to_target = ids.to(device or self.fc.weight.device)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """Target aux states ``[T, k * H_target]`` -> fused features ``[T, H]`` (``fc``)."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def forward(self, batch: ForwardBatch, kv: KVPool, backend: AttentionBackend, *,
                hidden_states: torch.Tensor, kv_only: bool = False) -> torch.Tensor | None:
        """Draft forward. ``hidden_states`` ``[T, H]``: fused features (:meth:`fuse`) of the
        target at the position before each token, or the head's own previous output. Writes
        layer 0 of ``kv`` at ``batch.out_loc``. Returns the output before ``norm`` ``[T, H]``
        (None with ``kv_only=True``: only the norms and the K/V write run)."""
        embeds = self.embed_tokens(batch.input_ids)
        hidden = hidden_states.to(embeds.dtype)
        cos, sin = self.rotary(batch.positions, embeds.dtype)
        if kv_only:
            self.midlayer.write_kv_only(embeds, hidden, cos, sin, batch, kv)
            return None
        return self.midlayer(embeds, hidden, cos, sin, batch, kv, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` head outputs -> float32 logits ``[N, draft_vocab_size]``."""
        return self.lm_head(self.norm(hidden)).float()

    def make_kv_pool(self, num_slots: int, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> KVPool:
        """A 1-layer :class:`KVPool` for this head (dtype/device default to the weights')."""
        w, c = self.fc.weight, self.config
        kv_heads = self.midlayer.self_attn.num_kv_heads  # this rank's share
        return KVPool(1, num_slots, kv_heads, c.head_dim,
                      dtype or w.dtype, device or w.device)
