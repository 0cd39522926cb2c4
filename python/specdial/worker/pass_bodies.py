"""The three pass bodies of a decode iteration, one definition each: verify, draft, extend.

:class:`PassBodies` runs one forward pass over a :class:`~specdial.models.batch.ForwardBatch`
whose attention metadata is already planned. The same body runs eagerly (dynamic metadata,
:class:`~specdial.worker.step_runner.StepRunner`) or is captured over the padded static
buffers and replayed (fixed-shape metadata, :class:`~specdial.worker.graph_passes.GraphPasses`):
both hold the one :class:`PassBodies` of their steps value (composition; gpt-fast's "one
function, captured or not").
"""

from __future__ import annotations

from typing import Any

import torch

from specdial.attention.base import AttentionBackend
from specdial.kv_pool import KVPool
from specdial.models.batch import ForwardBatch
from specdial.worker.drafters import run_target

__all__ = ["PassBodies"]


class PassBodies:
    """Verify, draft and draft-extend forwards of one ``steps`` value.

    - ``steps``: ``k`` drafts per request (draft body), ``k + 1`` verify tokens per request.
    - ``target`` (a ``LlamaForCausalLM``) and ``target_kv`` (its :class:`KVPool`);
      ``drafter``: a :class:`~specdial.worker.drafters.Drafter` with its ``kv``, or None.
    - ``backend``: the attention backend the metadata was planned with.
    - ``logits_in_graph``: :meth:`verify` also computes the target's logits (float32).
    """

    def __init__(self, steps: int, *, target: Any, target_kv: KVPool, drafter: Any,
                 backend: AttentionBackend, logits_in_graph: bool = True) -> None:
        self.steps = steps
        self.target, self.target_kv, self.drafter = target, target_kv, drafter
        self.backend, self.logits_in_graph = backend, logits_in_graph
        #: EAGLE: the drafter reads target features (``first_hidden``, extend hidden states)
        self.needs_hidden = bool(drafter is not None and drafter.needs_target_hidden)
        # a one-layer drafter's KV-only extend never runs attention (the last layer only
        # writes K/V), so its extend needs no attention plan
        self.extend_uses_attention = drafter is not None and drafter.num_layers > 1

    @property
    def has_drafter(self) -> bool:
        return self.drafter is not None

    def verify(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None,
                                                   torch.Tensor | None]:
        """Target forward over ``B * (k + 1)`` tokens -> ``(hidden [N, H], logits [N, V]
        float32 or None, drafter features [N, F] or None)``."""
        hidden, feats = run_target(self.target, self.drafter, batch, self.target_kv,
                                   self.backend)
        logits = self.target.compute_logits(hidden) if self.logits_in_graph else None
        return hidden, logits, feats

    def draft(self, batches: list[ForwardBatch], first_hidden: torch.Tensor | None,
              sampling: Any, generator: torch.Generator | None,
              sample_positions: torch.Tensor | None = None,
              processing: Any = None, conf_out: torch.Tensor | None = None,
              levels: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``k`` draft forwards (one batch per step) -> ``(tokens [B, k] int64, probs
        [B, k, V] float32 or None)``; ``conf_out`` ``[B, k]`` float32 gets the drafts'
        confidences, ``levels`` limits each level to its requests
        (:meth:`~specdial.worker.drafters.Drafter.draft`)."""
        return self.drafter.draft(self.steps, batches, self.backend, first_hidden=first_hidden,
                                  sampling=sampling, generator=generator,
                                  sample_positions=sample_positions, processing=processing,
                                  conf_out=conf_out, levels=levels)

    def extend(self, batch: ForwardBatch, hidden: torch.Tensor | None) -> None:
        """Drafter KV-only extend over the batch's tokens (``hidden``: EAGLE's features of the
        previous positions, ``[T, F]``)."""
        self.drafter.extend(batch, self.backend, hidden_states=hidden, kv_only=True)
