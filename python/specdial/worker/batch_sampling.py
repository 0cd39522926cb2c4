"""A batch's sampling options as per-row tensors: :class:`BatchSampling`.

Built once per batch composition from validated
:class:`~specdial.worker.sampling_params.SamplingParams`; read by the kernels of
:mod:`specdial.worker.sampling` (:func:`~specdial.worker.sampling.target_probs`,
:func:`~specdial.worker.sampling.sample`, :func:`~specdial.worker.sampling.speculative_accept`)
and by the drafters. Its flags are plain Python bools, so the kernels branch without a device
sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specdial.worker.processors import BatchProcessors
from specdial.worker.sampling_params import SamplingParams
from specdial.worker.seeded_noise import seed_to_int64

__all__ = ["BatchSampling"]

@dataclass
class BatchSampling:
    """Per-row sampling options of one batch, built once per batch composition.

    - ``temperature`` ``[B]`` float32 (0 on greedy rows).
    - ``top_p`` ``[B]`` float32 in ``(0, 1]``.
    - ``top_k`` ``[B]`` int64, values ``<= 0`` mean off.
    - ``greedy_mask`` ``[B]`` bool: rows with temperature 0.
    - ``all_greedy``: every row is greedy (fast path: no probabilities, no random draws).
    - ``any_top_k`` / ``any_top_p``: some sampling row filters (else the sort is skipped).
    - ``seeds`` ``[B]`` int64: each row's ``seed`` as int64 bits (0 where none).
    - ``seeded_mask`` ``[B]`` bool: sampling (non-greedy) rows with a seed.
    - ``seeded_rows`` ``[S]`` int64: their indices, increasing (empty when none).
    - ``any_seeded`` / ``all_seeded``: some / every row is a seeded sampling row (with
      ``all_seeded`` the generator is not used at all).
    - ``any_unseeded``: some row samples without a seed (rejection sampling and the generator
      are needed); False when every row is greedy or seeded.
    - ``min_p`` ``[B]`` float32 in ``[0, 1]`` (None: 0 everywhere) and ``any_min_p``: some
      sampling row filters by min-p.
    - ``processors``: the penalties and ``min_tokens`` of the rows
      (:class:`~specdial.worker.processors.BatchProcessors`), None when no row uses one. The
      worker applies them to the logits before :func:`target_probs`, :func:`sample` and
      :func:`speculative_accept`, which take processed logits.

    The flags are plain Python bools so the per-step functions never sync with the device.
    The seed fields default to "no seeded row" (for callers that build one by hand), and
    ``any_unseeded`` to True (rejection sampling for every sampling row).
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    greedy_mask: torch.Tensor
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    seeds: torch.Tensor | None = None
    seeded_mask: torch.Tensor | None = None
    seeded_rows: torch.Tensor | None = None
    any_seeded: bool = False
    all_seeded: bool = False
    any_unseeded: bool = True
    min_p: torch.Tensor | None = None
    any_min_p: bool = False
    processors: BatchProcessors | None = None
    #: the constrained rows' matchers (:class:`~specdial.worker.grammar_masks.BatchGrammar`),
    #: set by the engine; None when no row has a structured-output constraint
    grammar: Any = None

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str = "cpu", *,
                    prompt_lens: list[int] | None = None,
                    min_tokens_ids: list[tuple[int, ...]] | None = None) -> BatchSampling:
        """Stack ``params`` (one per row, in batch order) into tensors on ``device``.

        ``prompt_lens`` (tokens) and ``min_tokens_ids`` (per row, the ids masked under
        ``min_tokens``: EOS and ``stop_token_ids``, each ``< V``) feed the
        :attr:`processors`; ``ValueError`` when a row has a penalty or ``min_tokens`` and they
        are missing."""
        greedy = [p.is_greedy for p in params]
        seeded = [p.seed is not None and not g for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32,
                                     device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            any_top_k=any(p.top_k > 0 and not g for p, g in zip(params, greedy)),
            any_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)),
            seeds=torch.tensor([seed_to_int64(p.seed or 0) for p in params], dtype=torch.int64,
                               device=device),
            seeded_mask=torch.tensor(seeded, dtype=torch.bool, device=device),
            seeded_rows=torch.tensor([i for i, s in enumerate(seeded) if s], dtype=torch.int64,
                                     device=device),
            any_seeded=any(seeded),
            all_seeded=bool(seeded) and all(seeded),
            any_unseeded=not all(g or s for g, s in zip(greedy, seeded)),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
            any_min_p=any(m > 0 for m in min_p),
            processors=BatchProcessors.build(params, prompt_lens, min_tokens_ids, device),
        )

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    def select(self, index: torch.Tensor) -> BatchSampling:
        """The sub-batch of rows ``index`` (``[B']`` int64, in the new batch order).

        Recomputes the flags, which reads them back from the device once: call it when the
        batch composition changes (requests finish), not per step.
        """
        index = index.to(device=self.temperature.device, dtype=torch.int64)
        temperature = self.temperature.index_select(0, index)
        top_p = self.top_p.index_select(0, index)
        top_k = self.top_k.index_select(0, index)
        greedy = self.greedy_mask.index_select(0, index)
        all_greedy, any_top_k, any_top_p = torch.stack([
            greedy.all(), ((top_k > 0) & ~greedy).any(),
            ((top_p < 1.0) & ~greedy).any()]).tolist()
        out = BatchSampling(temperature, top_p, top_k, greedy, all_greedy, any_top_k, any_top_p)
        if self.seeds is not None and self.seeded_mask is not None:
            out.seeds = self.seeds.index_select(0, index)
            out.seeded_mask = self.seeded_mask.index_select(0, index)
            out.seeded_rows = out.seeded_mask.nonzero().squeeze(1)  # one more sync
            n = out.seeded_rows.numel()
            out.any_seeded, out.all_seeded = n > 0, 0 < n == index.numel()
            out.any_unseeded = bool((~(out.seeded_mask | greedy)).any())
        if self.min_p is not None:
            out.min_p = self.min_p.index_select(0, index)
            out.any_min_p = bool((out.min_p > 0).any())
        if self.processors is not None:
            out.processors = self.processors.select(index)
        return out
