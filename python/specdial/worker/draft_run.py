"""One call of :meth:`Drafter.draft <specdial.worker.drafters.Drafter.draft>`: the choice of
each level's tokens (argmax or a draw from ``q``), their confidences, and the per-level request
subsets of per-request verify budgets (:class:`~specdial.worker.verify_budgets.DraftLevels`).

``B`` requests, ``k`` levels, ``V`` the target vocabulary; tokens int64, logits and
probabilities float32. No host sync.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from specdial.models.batch import ForwardBatch
from specdial.worker.processors import StepProcessing
from specdial.worker.sampling import BatchSampling, sample_from_probs, target_probs
from specdial.worker.verify_budgets import DraftLevels

__all__ = ["DraftRun"]


#: a greedy level's ``[B, V]`` logits up to this many elements (4 MiB of float32) are kept
#: and their confidences computed for all levels at once in :meth:`DraftRun.result`: on the
#: CPU each small op right after a model forward costs several times its warm cost (measured
#: at batch 1 in situ: ``max`` 43-49 µs, ``logsumexp`` 86-94 µs against 5 / 11 µs warm), so
#: one set of ops per draft call instead of one per level; larger levels are done per level,
#: not to hold ``k`` copies of large logits
DEFER_CONF_ELEMENTS = 1 << 20


def greedy_confidence(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` logits -> ``[...]`` float32: ``softmax(logits)`` at the argmax, in
    ``[0, 1]`` (0 for a row masked to nothing, whose softmax is NaN)."""
    logits = logits.float()
    conf = torch.exp(logits.max(-1).values - torch.logsumexp(logits, -1))
    return conf.nan_to_num_(0.0).clamp_(0.0, 1.0)


class DraftRun:
    """The state of one draft call: ``drafter`` (a ``Drafter``), the batch's ``sampling``,
    ``generator``, ``sample_positions``, ``processing`` and ``conf_out`` (see
    :meth:`Drafter.draft <specdial.worker.drafters.Drafter.draft>`); collects each level's
    tokens ``[B]`` and, for sampled drafts, ``q`` ``[B, V]``."""

    def __init__(self, drafter: Any, sampling: BatchSampling, generator: torch.Generator | None,
                 sample_positions: torch.Tensor | None, processing: StepProcessing | None,
                 conf_out: torch.Tensor | None) -> None:
        self.drafter, self.sampling, self.generator = drafter, sampling, generator
        self.sample_positions, self.processing = sample_positions, processing
        self.conf_out = conf_out
        self.tokens: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []
        #: greedy levels' logits ``[B, V]`` whose confidences :meth:`result` computes at once
        self.greedy_logits: list[torch.Tensor] = []

    def choose(self, logits: torch.Tensor, i: int, input_ids: torch.Tensor) -> torch.Tensor:
        """Level ``i`` (0-based): the drafter's ``[B, V_draft]`` logits and the level's input
        tokens ``[B]`` (the processors' history) -> the drafted target ids ``[B]``."""
        d, sampling, proc = self.drafter, self.sampling, self.processing
        if proc is not None:  # over target ids from here on
            logits = proc.draft_step(d.to_target_logits(logits), i, input_ids)
        conf = None
        if sampling.all_greedy:
            if self.conf_out is not None and logits.numel() > DEFER_CONF_ELEMENTS:
                logits = logits.float()  # max's index is argmax's (the first maximum)
                top, tok = logits.max(-1)
                conf = torch.exp(top - torch.logsumexp(logits, -1))  # softmax at the argmax
            else:
                tok = logits.argmax(-1)
                if self.conf_out is not None:  # the confidences of all levels in result()
                    self.greedy_logits.append(logits)
            tok = tok if proc is not None else d.to_target_ids(tok)
        else:
            if proc is None:
                logits = d.to_target_logits(logits)
            q = target_probs(logits.unsqueeze(1), sampling).squeeze(1)
            pos = self.sample_positions
            tok = sample_from_probs(q, self.generator, sampling=sampling,
                                    positions=None if pos is None else pos + i)
            self.probs.append(q)
            if self.conf_out is not None:
                q_tok = q.gather(1, tok[:, None]).squeeze(1)
                conf = torch.where(sampling.greedy_mask, greedy_confidence(logits), q_tok)
        if conf is not None:
            assert self.conf_out is not None
            # a probability (Scheduler.report checks [0, 1]): renormalised top-k / top-p
            # weights can round a hair above 1, and a row masked to nothing has no confidence
            self.conf_out[:, i].copy_(conf.nan_to_num_(0.0).clamp_(0.0, 1.0))
        self.tokens.append(tok)
        return tok

    def levels(self, k: int, steps: Sequence[ForwardBatch], backend: Any,
               first_hidden: torch.Tensor | None, levels: DraftLevels) -> None:
        """Run ``levels.levels`` levels, level ``i + 1`` over ``levels.active[i]`` only
        (``steps[i]`` holds those requests); its logits (and EAGLE's hidden output) are
        scattered into the full batch, where the inactive rows get zeros. Sampled drafts
        then draw filler levels up to ``k`` (:meth:`filler`)."""
        b = levels.first_ids.numel()
        prev, h_full = levels.first_ids, first_hidden
        for i in range(levels.levels):
            act = levels.active[i]
            if i:
                steps[i].input_ids.copy_(prev.index_select(0, act))
            hidden = None if h_full is None else h_full.index_select(0, act)
            h = self.drafter._forward(steps[i], backend, hidden, False)
            assert h is not None
            part = self.drafter.compute_logits(h)
            logits = part.new_zeros(b, part.shape[1]).index_copy_(0, act, part)
            if h_full is not None:
                h_full = h.new_zeros(b, h.shape[1]).index_copy_(0, act, h)
            prev = self.choose(logits, i, prev)
        if not self.sampling.all_greedy:
            for i in range(levels.levels, k):
                self.filler(i, b, levels.first_ids.device)

    def filler(self, i: int, b: int, device: torch.device) -> None:
        """Level ``i`` that no request drafts, in a sampled batch: a draw from the uniform
        ``[B, V]`` weights, so the generator advances exactly as for a drafted level (the
        engine's generator stream, and so an unseeded batch's tokens, match a padded batch's,
        e.g. a CUDA-graph replay's). Its tokens and ``q`` are never read."""
        vocab = self.drafter.vocab_size
        q = torch.full((b, vocab), 1.0 / vocab, device=device)
        pos = self.sample_positions
        self.tokens.append(sample_from_probs(q, self.generator, sampling=self.sampling,
                                             positions=None if pos is None else pos + i))
        self.probs.append(q)

    def result(self, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(tokens [B, k], probs [B, k, V] or None)``; levels that did not run are zeros
        (and ``conf_out`` is zeroed there)."""
        tokens, probs, done = self.tokens, self.probs, len(self.tokens)
        if self.greedy_logits:
            assert self.conf_out is not None
            self.conf_out[:, :len(self.greedy_logits)].copy_(
                greedy_confidence(torch.stack(self.greedy_logits, 1)))
        if done < k:
            b = self.tokens[0].shape[0] if done else self.sampling.batch_size
            dev = self.tokens[0].device if done else self.sampling.temperature.device
            tokens = tokens + [torch.zeros(b, dtype=torch.int64, device=dev)] * (k - done)
            if probs:
                probs = probs + [torch.zeros_like(probs[0])] * (k - done)
            if self.conf_out is not None:
                self.conf_out[:, done:].zero_()
        return torch.stack(tokens, 1), (torch.stack(probs, 1) if probs else None)
