"""Drafters: what proposes the ``k`` draft tokens of a decode iteration.

Three implementations behind one :class:`Drafter` interface (chain drafting, top-1, no trees):

- :class:`DraftModelDrafter`: a small :class:`~specdial.models.LlamaForCausalLM` sharing the
  target's tokenizer, with its own :class:`~specdial.kv_pool.KVPool`.
- :class:`EagleDrafter`: an EAGLE-1 head (Li et al. 2024, arXiv 2401.15077) over
  ``cat(embed(token), target hidden)``, with its own 1-layer pool.
- :class:`Eagle3Drafter`: an EAGLE-3 head (Li et al. 2025, arXiv 2503.01840) over the fused
  residual stream of a few target layers, drafting over its own reduced vocabulary whose ids
  it maps to the target's (``d2t``).

All pools are indexed by the *same* KV slot indices as the target's: one
:class:`specdial._core.KvPagePool` allocation serves target and drafter.

Target features (EAGLE heads, ``needs_target_hidden``): every target forward goes through
:func:`run_target`, which returns the final hidden states and the drafter's per-token
*features*, the ``h`` its first draft step reads: the final hidden state itself for EAGLE-1,
``fc(cat(aux states))`` for EAGLE-3 (the target runs with
:meth:`~specdial.models.LlamaForCausalLM.forward_with_aux`). The worker stores features per KV
KV slot (``[num_slots + 2, feature_size]``); below, "hidden" of the target means these features.

Position / validity convention (used by :mod:`specdial.worker.worker`):

- Target: per request ``target_len`` ``L`` = positions whose target KV is written (the plan's
  ``positions``: the scheduler owns it, the worker keeps no copy). The last
  emitted token ``x_L`` is *not* yet in the target KV. Verify feeds ``[x_L, d_1..d_k]`` at
  positions ``L..L+k``; after accepting ``a`` drafts the target keeps KV for ``L..L+a``, the
  rejected KV slots are truncated back to the allocator, and the bonus token becomes ``x_{L+a+1}``
  (so ``L`` becomes ``L + a + 1``).
- Drafter: per request ``draft_len`` = positions whose drafter KV is valid (was computed from
  the true sequence). EAGLE's input at position ``p`` is ``(embed(x_p), h_{p-1})`` where
  ``h_{p-1}`` is the target's feature at ``p - 1`` (EAGLE-1: the final hidden state after the
  final norm; EAGLE-3: the fused aux states), zeros for ``p = 0``; its output predicts
  ``x_{p+1}``. Draft step 1 feeds ``(x_L, h_{L-1})`` at position
  ``L``, step ``i > 1`` feeds ``(d_{i-1}, head output of step i-1)`` at ``L + i - 1``. After a
  verify, EAGLE's valid ``draft_len`` is ``L + 1`` (``d_1..d_a`` were fed approximate hiddens),
  so the draft extend recomputes ``L+1..L+a`` with true hiddens. The draft model wrote true
  entries for ``x_L, d_1..d_{k-1}`` at ``L..L+k-1``, so its ``draft_len`` is
  ``min(L + k, L + a + 1)`` and its extend only covers ``d_k`` when every draft was accepted.
  With a per-request verify budget ``v_r`` (issue 28) ``k`` is the request's own ``v_r``
  (the levels it drafted); ``v_r = 0`` wrote nothing, so ``draft_len`` stays ``L``.
- When ``draft_len`` moves (a row's restart, the catch-up over ``[draft_len, L)`` before
  drafting and as the draft extend after each verify, :meth:`Drafter.draft_len_after_verify`,
  skipped zero-step extends) is stated once, in :mod:`specdial.worker.drafter_state`. Extend
  never needs logits, so it always runs ``kv_only`` (the last drafter layer only writes K/V:
  no attention output, MLP or LM head).

Shapes: ``B`` requests, ``k`` steps, ``V`` vocabulary, ``H`` hidden size; tokens/positions/KV slots
int64, logits and probabilities float32, hidden states in the model dtype.
"""

from __future__ import annotations

import abc
from typing import Sequence

import numpy as np
import torch
from torch import nn

from specdial.attention.base import AttentionBackend
from specdial.config import EngineConfig
from specdial.kv_pool import KVPool
from specdial.models.batch import ForwardBatch
from specdial.models.eagle import EagleHead
from specdial.models.eagle3 import Eagle3Head
from specdial.models.llama import LlamaForCausalLM
from specdial.worker.processors import StepProcessing
from specdial.worker.draft_run import DraftRun
from specdial.worker.sampling import BatchSampling
from specdial.worker.verify_budgets import DraftLevels

#: Default largest ``steps`` a chain drafter accepts (buffers and runtime states are sized by
#: the configured candidates, so this is only a sanity bound; override per drafter). The value
#: is :class:`~specdial.engine.config.EngineConfig`'s ``drafter_max_steps`` default.
DEFAULT_MAX_STEPS: int = EngineConfig.drafter_max_steps


class Drafter(abc.ABC):
    """A chain drafter with its own KV pool over the target's KV slot indices.

    Attributes: ``max_steps`` (largest ``k`` it supports), ``algorithm`` (``"DRAFT"``,
    ``"EAGLE"``, ``"EAGLE3"``), ``needs_target_hidden`` (EAGLE heads: the worker keeps the
    target features of :func:`run_target` per KV slot, ``feature_size`` wide), ``kv`` (its
    :class:`~specdial.kv_pool.KVPool`, set by :meth:`init_kv`), ``vocab_size`` (the target's:
    drafted tokens are target ids), ``num_layers`` (decoder layers; a one-layer drafter's
    KV-only extend runs no attention).
    """

    max_steps: int
    algorithm: str
    needs_target_hidden: bool = False
    num_layers: int = 1
    kv: KVPool
    module: nn.Module

    def __init__(self, max_steps: int) -> None:
        if max_steps < 1:
            raise ValueError(f"Drafter max_steps must be >= 1, got {max_steps}")
        self.max_steps = max_steps

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @property
    def feature_size(self) -> int | None:
        """Width of the per-KV-slot target features (None: the drafter reads none)."""
        return None

    def run_target(self, target: LlamaForCausalLM, batch: ForwardBatch, kv: KVPool,
                   backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target forward for this drafter: ``(final hidden [T, H], features [T, F] or
        None)`` (EAGLE-1: the final hidden state is the feature)."""
        hidden = target(batch, kv, backend)
        return hidden, (hidden if self.needs_target_hidden else None)

    def to_target_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Drafter token ids -> target ids (identity unless the drafter has its own vocab)."""
        return tokens

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``[N, V_draft]`` -> ``[N, V]`` logits over the target vocabulary (identity unless the
        drafter has its own vocab; then ``-inf`` outside it, so ``q`` is 0 there)."""
        return logits

    @abc.abstractmethod
    def init_kv(self, num_slots: int) -> KVPool:
        """Allocate (and keep as ``self.kv``) a pool of ``num_slots`` KV slots, same KV slot indices
        as the target's; dtype/device follow the drafter's weights."""

    @abc.abstractmethod
    def _forward(self, batch: ForwardBatch, backend: AttentionBackend,
                 hidden_states: torch.Tensor | None, kv_only: bool) -> torch.Tensor | None:
        """One drafter forward writing ``self.kv`` at ``batch.out_loc``; ``[T, H]`` or None."""

    @abc.abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` -> float32 logits ``[N, V]``."""

    @abc.abstractmethod
    def draft_len_after_verify(self, target_len: np.ndarray, steps: np.ndarray | int,
                               accepted: np.ndarray) -> np.ndarray:
        """Valid ``draft_len`` ``[B]`` after drafting ``steps`` levels (``[B]`` or one value,
        each in ``0..k``: a request with a verify budget drafts only its own levels) at
        ``target_len`` ``L`` and a verify accepting ``accepted`` drafts (see the module
        docstring)."""

    def extend(self, batch: ForwardBatch, backend: AttentionBackend, *,
               hidden_states: torch.Tensor | None = None,
               kv_only: bool = True) -> torch.Tensor | None:
        """Draft extend: process true tokens the drafter has not seen (``[draft_len, L)``).

        ``batch``: ragged, ``T`` tokens at their true positions and KV slots. ``hidden_states``
        ``[T, H]``: for EAGLE, the target's hidden state at the position *before* each token
        (zeros at position 0); ignored by the draft model. Returns None with ``kv_only``
        (the default: no logits are ever needed from extend), else the drafter's hidden
        ``[T, H]``. Raises ``ValueError`` when EAGLE gets no ``hidden_states``.
        """
        return self._forward(batch, backend, hidden_states, kv_only)

    def prefill(self, batch: ForwardBatch, backend: AttentionBackend, *,
                hidden_states: torch.Tensor | None = None) -> None:
        """Drafter prefill of whole prompts (positions ``0..P-1``): an extend from 0, KV only."""
        self._forward(batch, backend, hidden_states, True)

    def draft(self, k: int, steps: Sequence[ForwardBatch], backend: AttentionBackend, *,
              first_hidden: torch.Tensor | None, sampling: BatchSampling,
              generator: torch.Generator | None,
              sample_positions: torch.Tensor | None = None,
              processing: StepProcessing | None = None,
              conf_out: torch.Tensor | None = None,
              levels: DraftLevels | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Propose ``k >= 1`` tokens per request with ``k`` one-token forwards.

        ``steps[i]`` (``i < k``): the forward batch of draft step ``i + 1`` (``B`` tokens at
        positions ``L + i``, the KV slots of those positions). ``steps[0].input_ids`` holds
        ``x_L``; ``steps[i].input_ids`` for ``i >= 1`` are buffers this method fills with the
        previous step's tokens (fixed buffers: CUDA-graph friendly). ``first_hidden``
        ``[B, H]``: EAGLE's ``h_{L-1}`` (None for the draft model).

        Returns ``(tokens [B, k] int64, probs [B, k, V] float32 or None)``: greedy batches
        take the argmax and return no probabilities; otherwise each draft is sampled from
        ``q = target_probs(drafter logits)`` (same temperature/top-k/top-p as the target, so
        the rejection rule of Leviathan et al. 2023 stays lossless) and ``q`` is returned.
        ``sample_positions`` ``[B]`` int64: sequence index of draft 1 (``L + 1``); draft ``i``
        (1-based) of a seeded row is drawn with the noise of key (seed,
        ``sample_positions + i - 1``), the key of the target's own token at that position, so
        it is accepted exactly when it equals the target's draw there (the coupled draws of
        :func:`~specdial.worker.sampling.speculative_accept`); required when
        ``sampling.any_seeded``. ``processing``: the batch's penalties and ``min_tokens``
        (:class:`~specdial.worker.processors.StepProcessing`), applied to step ``i``'s logits
        over the target vocabulary with the history ``x_L, d_1..d_i`` before the argmax or
        ``q`` (only the acceptance depends on it: any proposal is verified exactly).

        ``conf_out`` ``[B, k]`` float32 (optional, written in place, CUDA-graph safe): the
        drafter's probability of each proposed token, the confidence signal of per-request
        verify budgets (DSpark, vLLM PR #47808; SpecDec++): ``softmax(logits)[d]`` for
        greedy rows (the draft distribution before the argmax), ``q(d)`` for sampled rows.
        ``levels`` (:class:`~specdial.worker.verify_budgets.DraftLevels`): level ``i + 1``
        runs only for ``levels.active[i]`` and ``steps[i]`` holds those requests only; the
        other rows' tokens, ``q`` and ``conf_out`` entries at that level are filler (zero
        confidence) that a verify with budgets never reads. Raises ``ValueError`` for ``k``
        outside ``1..max_steps``.
        """
        need = k if levels is None else levels.levels
        if not 1 <= k <= self.max_steps or len(steps) < need:
            raise ValueError(f"draft: k must be in 1..{self.max_steps} with a batch per step, "
                             f"got k={k} and {len(steps)} batches")
        run = DraftRun(self, sampling, generator, sample_positions, processing, conf_out)
        if levels is None:
            hidden = first_hidden
            for i in range(k):
                h = self._forward(steps[i], backend, hidden, False)
                assert h is not None
                tok = run.choose(self.compute_logits(h), i, steps[i].input_ids)
                if i + 1 < k:
                    steps[i + 1].input_ids.copy_(tok)
                hidden = h
        else:
            run.levels(k, steps, backend, first_hidden, levels)
        return run.result(k)


class DraftModelDrafter(Drafter):
    """A small Llama-family draft model with the target's tokenizer (same vocabulary).

    ``model``: a :class:`LlamaForCausalLM`; ``target_vocab_size``: checked against the draft
    model's (``ValueError`` if they differ).
    """

    algorithm = "DRAFT"

    def __init__(self, model: LlamaForCausalLM, *, target_vocab_size: int | None = None,
                 max_steps: int = DEFAULT_MAX_STEPS) -> None:
        super().__init__(max_steps)
        if target_vocab_size is not None and model.config.vocab_size != target_vocab_size:
            raise ValueError(f"draft model vocab_size {model.config.vocab_size} differs from "
                             f"the target's {target_vocab_size}")
        self.module = self.model = model
        self.num_layers = model.config.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def init_kv(self, num_slots: int) -> KVPool:
        self.kv = self.model.make_kv_pool(num_slots)
        return self.kv

    def _forward(self, batch, backend, hidden_states, kv_only):
        return self.model(batch, self.kv, backend, kv_only=kv_only)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def draft_len_after_verify(self, target_len, steps, accepted):
        return np.minimum(target_len + steps, target_len + accepted + 1)


class EagleDrafter(Drafter):
    """EAGLE-1 head: needs the target's final hidden states (``needs_target_hidden``)."""

    algorithm = "EAGLE"
    needs_target_hidden = True

    def __init__(self, head: EagleHead | Eagle3Head, *,
                 max_steps: int = DEFAULT_MAX_STEPS) -> None:
        super().__init__(max_steps)
        self.module = self.head = head

    @property
    def vocab_size(self) -> int:
        return self.head.config.vocab_size

    @property
    def feature_size(self) -> int | None:
        return self.head.config.hidden_size

    def init_kv(self, num_slots: int) -> KVPool:
        self.kv = self.head.make_kv_pool(num_slots)
        return self.kv

    def _forward(self, batch, backend, hidden_states, kv_only):
        if hidden_states is None:
            raise ValueError("EagleDrafter needs the target hidden states of the previous "
                             "positions (hidden_states [T, H])")
        return self.head(batch, self.kv, backend, hidden_states=hidden_states, kv_only=kv_only)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.compute_logits(hidden)

    def draft_len_after_verify(self, target_len, steps, accepted):
        # step 1 wrote (x_L, h_{L-1}) at L, a true entry; a request that drafted nothing
        # (verify budget 0) wrote none
        return target_len + np.minimum(steps, 1)


class Eagle3Drafter(EagleDrafter):
    """EAGLE-3 head (:class:`~specdial.models.Eagle3Head`).

    The target runs with its residual stream captured at ``head.spec.aux_layers``; the
    features are ``head.fuse(aux)``. Draft logits are over the head's ``draft_vocab_size``
    tokens: greedy drafts take their argmax mapped to target ids (``draft_to_target``),
    sampling drafts sample from ``target_probs`` of the logits scattered into the target
    vocabulary with ``-inf`` elsewhere (as vLLM's ``compute_logits`` does), so ``q`` is a
    distribution over target ids, zero outside the draft vocabulary, and the rejection rule
    stays lossless. Raises ``ValueError`` when the target's vocabulary or hidden size does not
    match the head or an aux layer is outside the target.
    """

    algorithm = "EAGLE3"

    def __init__(self, head: Eagle3Head, target: LlamaForCausalLM, *,
                 max_steps: int = DEFAULT_MAX_STEPS) -> None:
        super().__init__(head, max_steps=max_steps)
        n, v = target.config.num_hidden_layers, target.config.vocab_size
        if head.config.vocab_size != v or head.spec.target_hidden_size != target.config.hidden_size:
            raise ValueError(f"EAGLE-3 head (vocab {head.config.vocab_size}, target hidden "
                             f"{head.spec.target_hidden_size}) does not fit the target (vocab "
                             f"{v}, hidden {target.config.hidden_size})")
        if head.spec.aux_layers[-1] > n:
            raise ValueError(f"EAGLE-3 aux layers {list(head.spec.aux_layers)} outside the "
                             f"target's residual stream 0..{n}")
        self.aux_layers = head.spec.aux_layers
        #: draft id -> target id, or None when they coincide (no mapping work)
        self.draft_to_target = None if head.identity_vocab else head.draft_to_target

    def run_target(self, target, batch, kv, backend):
        hidden, aux = target.forward_with_aux(batch, kv, backend, self.aux_layers)
        return hidden, self.head.fuse(aux)

    def to_target_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens if self.draft_to_target is None else self.draft_to_target[tokens]

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.draft_to_target is None:
            return logits
        out = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return out.index_copy_(1, self.draft_to_target, logits)


def run_target(target: LlamaForCausalLM, drafter: Drafter | None, batch: ForwardBatch,
               kv: KVPool, backend: AttentionBackend
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target forward of a prefill or verify: ``(final hidden [T, H], drafter features
    [T, F] or None)`` (:meth:`Drafter.run_target`; ``drafter`` None: plain forward)."""
    if drafter is None:
        return target(batch, kv, backend), None
    return drafter.run_target(target, batch, kv, backend)


def make_drafter(module: nn.Module | Drafter | None, target: LlamaForCausalLM, *,
                 max_steps: int = DEFAULT_MAX_STEPS) -> Drafter | None:
    """Wrap ``module``: a :class:`Drafter` is returned as is, an :class:`EagleHead` becomes an
    :class:`EagleDrafter`, an :class:`Eagle3Head` an :class:`Eagle3Drafter`, a
    :class:`LlamaForCausalLM` a :class:`DraftModelDrafter`. Raises ``TypeError`` for anything
    else (None gives None)."""
    if module is None or isinstance(module, Drafter):
        return module
    if isinstance(module, Eagle3Head):
        return Eagle3Drafter(module, target, max_steps=max_steps)
    if isinstance(module, EagleHead):
        return EagleDrafter(module, max_steps=max_steps)
    if isinstance(module, LlamaForCausalLM):
        return DraftModelDrafter(module, target_vocab_size=target.config.vocab_size,
                                 max_steps=max_steps)
    raise TypeError(f"drafter must be an EagleHead, an Eagle3Head, a LlamaForCausalLM or a "
                    f"Drafter, got {type(module).__name__}")
