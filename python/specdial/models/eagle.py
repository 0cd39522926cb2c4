"""EAGLE-1 draft head.

The head predicts the target's next final hidden state from the previous one and the current
token: ``x = fc(cat([embed(input_ids), hidden_states], -1))``, then one Llama decoder layer
(input norm, attention, post-attention norm, MLP; no final norm); logits come from the
target's ``lm_head``. ``embed_tokens`` and ``lm_head`` are the target's modules (shared, not
copied). The head has its own :class:`~specdial.kv_pool.KVPool` with 1 layer, indexed by the
same slots as the target's.

Two variants of the same computation, both loaded by :func:`specdial.models.load_eagle_head`:
specdial's own layout below (input norm kept, ``fc`` with bias), and the layouts SGLang and
vLLM load (``LlamaForCausalLMEagle`` / ``EagleLlamaForCausalLM``: the decoder layer has no input
norm, as in the EAGLE reference code; ``fc.bias`` when the checkpoint has one).

specdial's checkpoint layout (a directory, see :func:`specdial.models.save_eagle_head`):

- ``config.json``: ``{"architectures": ["SpecdialEagleHead"], "hidden_size",
  "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim" (optional),
  "rms_norm_eps", "rope_theta", "rope_scaling", "vocab_size", "max_position_embeddings",
  "num_hidden_layers": 1}`` (the Llama fields of the target; ``attention_bias`` optional).
- ``model.safetensors``: ``fc.weight`` ``[hidden, 2 * hidden]``, ``fc.bias`` ``[hidden]`` and
  ``layers.0.*`` in HF Llama layer naming (``layers.0.self_attn.q_proj.weight``,
  ``layers.0.mlp.gate_proj.weight``, ``layers.0.input_layernorm.weight``, ...). No embedding
  or lm_head tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from specdial.attention.base import AttentionBackend
from specdial.kv_pool import KVPool
from specdial.models.batch import ForwardBatch
from specdial.models.config import ModelConfig
from specdial.models.layers import DecoderLayer, RotaryEmbedding
from specdial.models.llama import run_layers
from specdial.models.tensor_parallel import full_shape

EAGLE_ARCHITECTURE = "SpecdialEagleHead"


class EagleHead(nn.Module):
    """EAGLE-1 head sharing ``target_embed`` (``nn.Embedding``) and ``target_lm_head``.

    ``config.num_hidden_layers`` must be 1 and ``hidden_size``/``vocab_size`` must match the
    shared modules; raises ``ValueError`` otherwise. The shared modules are not registered as
    submodules, so ``state_dict()`` holds only ``fc.*`` and ``layers.0.*``. ``input_norm``:
    keep the decoder layer's input RMSNorm (specdial's layout; False for SGLang's and vLLM's);
    ``fc_bias``: ``fc`` has a bias.
    """

    embed_tokens: nn.Embedding
    lm_head: nn.Linear

    def __init__(self, config: ModelConfig, target_embed: nn.Embedding,
                 target_lm_head: nn.Linear, *, input_norm: bool = True,
                 fc_bias: bool = True) -> None:
        super().__init__()
        if config.num_hidden_layers != 1:
            raise ValueError("EagleHead has one decoder layer, config says "
                             f"{config.num_hidden_layers}")
        vocab, hidden = full_shape(target_embed)  # unsharded, also under tensor parallelism
        if (vocab, hidden) != (config.vocab_size, config.hidden_size):
            raise ValueError(f"EagleHead config (vocab {config.vocab_size}, hidden "
                             f"{config.hidden_size}) does not match the target embedding "
                             f"(vocab {vocab}, hidden {hidden})")
        if full_shape(target_lm_head) != (vocab, hidden):
            raise ValueError(f"target lm_head {full_shape(target_lm_head)} does not "
                             f"match the embedding ({vocab}, {hidden})")
        self.config = config
        # plain attributes: shared with the target, not parameters of the head
        object.__setattr__(self, "embed_tokens", target_embed)
        object.__setattr__(self, "lm_head", target_lm_head)
        self.input_norm = input_norm
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(config, 0, input_norm=input_norm)])
        self.rotary = RotaryEmbedding(config)

    def forward(self, batch: ForwardBatch, kv: KVPool, backend: AttentionBackend, *,
                hidden_states: torch.Tensor, kv_only: bool = False) -> torch.Tensor | None:
        """Draft forward.

        ``hidden_states`` ``[T, hidden]``: the target's final hidden states (after its final
        norm) at the position before each token of ``batch.input_ids``. Writes layer 0 of
        ``kv`` at ``batch.out_loc``. Returns ``[T, hidden]`` (None with ``kv_only=True``:
        only fc, input norm and the K/V write run).
        """
        embeds = self.embed_tokens(batch.input_ids)
        x = self.fc(torch.cat([embeds, hidden_states.to(embeds.dtype)], -1))
        return run_layers(self.layers, self.rotary, x, batch, kv, backend, kv_only)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[N, hidden]`` -> float32 logits ``[N, vocab]`` via the target lm_head."""
        return self.lm_head(hidden).float()

    def make_kv_pool(self, num_slots: int, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> KVPool:
        """A 1-layer :class:`KVPool` for this head (dtype/device default to the weights')."""
        w = self.fc.weight
        c = self.config
        kv_heads = self.layers[0].self_attn.num_kv_heads  # this rank's share
        return KVPool(1, num_slots, kv_heads, c.head_dim,
                      dtype or w.dtype, device or w.device)
