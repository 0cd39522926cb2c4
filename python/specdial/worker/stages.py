"""Typed values that pass between the stages of one decode iteration, and the step's output.

:meth:`SpecWorker.decode <specdial.worker.worker.SpecWorker.decode>` is
``prepare -> draft -> verify -> accept -> extend``; each stage takes and returns one of these:

- :class:`DecodeStep` (``prepare``): the plan's input, its runner and the batch written into
  the device buffers; every length and KV slot in it comes from the plan.
- :class:`Drafts` (``draft``): the proposed tokens and, for sampled drafts, their
  distributions.
- :class:`Verified` (``verify``): the target's logits over ``[x_L, d_1..d_k]``.
- :class:`Accepted` (``accept``): the host copy of the accepted counts and emitted tokens (the
  iteration's one device sync); ``extend`` reads it, :meth:`Accepted.output` turns it into the
  :class:`StepOutput` the scheduler's ``report`` takes.

``B`` requests, ``k`` steps, ``n = k + 1``, ``V`` vocabulary. Host arrays numpy int64, device
tensors int64 (tokens) or float32 (logits, probabilities).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdial.worker.inputs import DecodeInput
from specdial.worker.logprobs import HostLogprobs
from specdial.worker.processors import StepProcessing
from specdial.worker.runtime import DecodeBatches
from specdial.worker.step_runner import StepRunner

__all__ = ["Accepted", "DecodeStep", "Drafts", "StepOutput", "Verified", "float_bits",
           "packed_draft_probs"]


@dataclass
class StepOutput:
    """Result of one plan over ``B`` requests (host numpy, int64), what
    :meth:`specdial._core.Scheduler.report` takes.

    ``tokens``: emitted tokens, request after request (decode: accepted drafts then the bonus
    token; prefill: the first token of the ``sample_first`` requests); ``offsets`` ``[B + 1]``:
    request ``b`` emitted ``tokens[offsets[b]:offsets[b + 1]]``; ``accepted`` ``[B]``
    (decode; None for prefill): accepted drafts, ``0..steps_per_request[b]``.
    ``logprobs``: the target's log-probabilities of the emitted tokens for the rows that asked
    (:mod:`specdial.worker.logprobs`; decode: ``[R, steps + 1]``, row ``r`` emitted its first
    ``offsets`` count; prefill: ``[R, 1]`` over the ``sample_first`` requests); None when no
    row asked. ``prompt_logprobs``: the prefill's prompt positions of a
    :class:`~specdial.worker.logprobs.PromptLogprobPlan` (``[1, N]``), or None.
    ``verified`` (decode with a confidence stop, else None): ``[B]`` the drafts each request
    verified after the cut (``Scheduler.report(..., verified=)``).
    ``draft_probs`` (decode; None for prefill): float32 ``[sum(steps_per_request)]``, request
    after request, the drafter's probability of each draft token the request drafted
    (``softmax`` of the draft logits at a greedy draft, ``q(d)`` at a sampled one; issue 28's
    confidence signal for the goodput policy, ``Scheduler.report(..., draft_probs=)``),
    copied in the iteration's one device sync. A draft tree's (issue 29 item 5): float64
    ``[sum(verified)]`` (``N`` per request without a node budget), request after request, the
    path confidence of each node it verified, its accepted path's nodes first
    (:func:`~specdial.worker.tree_budget.path_first_confidences`).
    """

    steps: int
    tokens: np.ndarray
    offsets: np.ndarray
    accepted: np.ndarray | None
    logprobs: HostLogprobs | None = None
    prompt_logprobs: HostLogprobs | None = None
    draft_probs: np.ndarray | None = None
    verified: np.ndarray | None = None

    def decode_extras(self) -> dict:
        """``{"draft_probs", "verified"}``: the keyword arguments of
        ``Scheduler.report`` this decode output carries besides the tokens."""
        return {"draft_probs": self.draft_probs, "verified": self.verified}

    def tokens_of(self, b: int) -> np.ndarray:
        return self.tokens[self.offsets[b]:self.offsets[b + 1]]


@dataclass
class DecodeStep:
    """A decode plan prepared on the device (``prepare``'s output).

    ``inp``: the plan's arrays (:class:`~specdial.worker.inputs.DecodeInput`); ``runner``: the
    runtime state of its steps value; ``rows`` ``[B]`` host; ``batches``: the forward batches
    written into the runner's buffers; ``first_pos`` ``[B]`` device: sequence index of draft 1
    (``L + 1``), the seeded rows' keys and the first position the processors decide (None
    when the batch has neither); ``processing``: the penalties / ``min_tokens`` of the step.
    """

    inp: DecodeInput
    runner: StepRunner
    rows: np.ndarray
    batches: DecodeBatches
    first_pos: torch.Tensor | None
    processing: StepProcessing | None

    @property
    def steps(self) -> int:
        return self.inp.steps

    @property
    def target_len(self) -> np.ndarray:
        """``L`` ``[B]`` host: each request's target KV length, from the plan."""
        return self.inp.positions


@dataclass
class Drafts:
    """``tokens`` ``[B, k]`` int64 (a view of the verify input ids: ``[B, 0]`` at steps 0);
    ``probs`` ``[B, k, V]`` float32, the distributions sampled drafts were drawn from, or None
    (greedy drafts: one-hot); ``conf`` ``[B, k]`` float32: the drafter's probability of each
    draft (zero at levels a request did not draft); ``verify_lens`` ``[B]`` int64 device: the
    drafts each request verifies after the plan's confidence stop
    (:mod:`specdial.worker.confidence_stop`), None without one (every request verifies its
    budget)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    conf: torch.Tensor
    verify_lens: torch.Tensor | None = None


@dataclass
class Verified:
    """``logits`` ``[B, n, V]`` float32: the target's raw logits at ``L .. L + k`` (reported
    log-probabilities come from these); ``target``: the same after the step's processors
    (what acceptance reads; ``logits`` itself when there are none)."""

    logits: torch.Tensor
    target: torch.Tensor


@dataclass
class Accepted:
    """Host copy of the acceptance: ``accepted`` ``[B]`` int64 (accepted drafts, at most the
    request's own ``steps_per_request``), ``tokens`` ``[B, n]`` int64 (row ``b`` emitted its
    first ``accepted[b] + 1``; later entries are stale), ``logprobs`` of the rows that asked,
    ``draft_probs`` float32 ``[sum(steps_per_request)]`` (:attr:`StepOutput.draft_probs`),
    ``verified`` ``[B]`` int64 or None (:attr:`StepOutput.verified`)."""

    accepted: np.ndarray
    tokens: np.ndarray
    logprobs: HostLogprobs | None
    draft_probs: np.ndarray | None = None
    verified: np.ndarray | None = None

    def output(self, steps: int) -> StepOutput:
        """The :class:`StepOutput` of a decode at ``steps``."""
        n = self.tokens.shape[1]
        emitted = np.arange(n)[None, :] <= self.accepted[:, None]
        offsets = np.concatenate([[0], np.cumsum(self.accepted + 1)]).astype(np.int64)
        return StepOutput(steps, self.tokens[emitted].astype(np.int64), offsets, self.accepted,
                          self.logprobs, draft_probs=self.draft_probs, verified=self.verified)


def float_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 ``[B, k]`` -> int64 ``[B, k]`` holding its bits, so it rides in the step's one
    int64 device-to-host copy (:func:`packed_draft_probs` reads it back)."""
    return x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)


def packed_draft_probs(bits: np.ndarray, budgets: np.ndarray) -> np.ndarray:
    """Host int64 ``[B, k]`` from :func:`float_bits` and the budgets ``v`` ``[B]`` -> float32
    ``[sum(v)]``: each request's first ``v_b`` confidences, request after request."""
    k = bits.shape[1]
    keep = np.arange(k)[None, :] < np.asarray(budgets)[:, None]
    return bits.astype(np.int32).view(np.float32)[keep]
