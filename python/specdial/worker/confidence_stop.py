"""The confidence stop (issue 28; DSpark, vLLM PR #47808; SpecDec++, Huang et al. 2025), the
worker's side: after drafting, each request's verify stops at the first draft position whose
cumulative draft probability falls below the plan's ``min_survival``.

Request ``b`` with verify budget ``v_b`` (``steps_per_request``) and draft confidences ``c_b``
``[k]`` (the drafter's probability of each drafted token: ``softmax`` at a greedy draft,
``q(d)`` at a sampled one; :class:`~specdial.worker.stages.Drafts`) verifies

    ``u_b = min(v_b, #{j : prod_{i <= j} c_b[i] >= min_survival, leading})``

drafts (0 allowed: a plain decode through verify). A request verified to ``u_b`` emits exactly
what a batch at ``k = u_b`` emits (:func:`~specdial.worker.sampling._capped`), so greedy output
equals target-only, and a seeded request's tokens (the target's own coupled draws, keyed by
sequence position, :mod:`specdial.worker.seeded_noise`) do not change.

One deviation from the shared contract, for losslessness: in a row that samples without a seed
(rejection sampling, Leviathan et al. 2023), whether position ``j`` is verified must not depend
on the token drawn there. If it did, the verified ``d_j`` would follow ``q_j`` restricted to the
tokens the rule keeps, not ``q_j``, and accepting with ``min(1, p/q)`` would no longer emit
``p`` (``tests/test_confidence_stop.py`` measures the bias: a chi-square of ~2000 on five
tokens). Such rows use :func:`stop_confidence`'s factor ``max_x q_j(x)``, the drafter's
confidence in its distribution at ``j``, a function of the drafts before ``j`` only (a
stopping rule in SpecDec++'s sense, which keeps the emitted tokens exact). Greedy rows'
factor, the probability of the argmax, is already of that kind; seeded rows keep ``q(d)``. The KV slots the plan reserved beyond
``u_b + accepted`` are freed by the scheduler's report like rejected ones (it truncates each
request to ``L + accepted + 1``).

Compute: the cut lengths stay on the device and ride in the iteration's one host copy. On a
CPU device (host memory: reading them is no sync) an eager batch re-packs its verify over the
cut lengths (:func:`repack_verify`), so the target runs only the verified tokens. On a GPU the
verify keeps the plan's budgets (packed, or a captured graph's padded shape): re-packing would
need the lengths on the host before the verify, a second sync; there the cut only shortens
what acceptance reads.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from specdial.worker.runtime import DecodeBatches
from specdial.worker.step_runner import StepRunner
from specdial.worker.verify_budgets import PackedVerify

__all__ = ["cut_lengths", "repack_verify", "stop_confidence"]


def stop_confidence(conf: torch.Tensor, probs: torch.Tensor | None,
                    unseeded: torch.Tensor | None) -> torch.Tensor:
    """The per-position factors of the stop rule ``[B, k]`` float32: ``conf`` (the drafts'
    probabilities, :class:`~specdial.worker.stages.Drafts`), except in the rows that sample
    without a seed (``unseeded`` ``[B]`` bool, or None: none), which take ``max_x q_j(x)`` from
    ``probs`` ``[B, k, V]`` (the distributions the drafts were drawn from) so the decision to
    verify position ``j`` does not depend on the token drawn there (module docstring)."""
    if probs is None or unseeded is None:
        return conf
    return torch.where(unseeded[:, None], probs.amax(-1).to(conf.dtype), conf)


def cut_lengths(conf: torch.Tensor, budgets: torch.Tensor, min_survival: float) -> torch.Tensor:
    """``conf`` ``[B, k]`` float32 (draft confidences in ``[0, 1]``; entries beyond a request's
    budget are ignored), ``budgets`` ``[B]`` int64 in ``0..k`` on the same device,
    ``min_survival`` in ``(0, 1)`` -> ``[B]`` int64: the leading positions whose cumulative
    product of ``conf`` is ``>= min_survival``, at most ``budgets``. No host sync.
    Raises ``ValueError`` for ``min_survival`` outside ``(0, 1)`` or mismatched shapes."""
    if not 0.0 < min_survival < 1.0:
        raise ValueError(f"min_survival must be in (0, 1), got {min_survival}")
    if conf.dim() != 2 or budgets.shape != conf.shape[:1]:
        raise ValueError(f"conf must be [B, k] and budgets [B], got {tuple(conf.shape)} and "
                         f"{tuple(budgets.shape)}")
    survive = torch.cumprod(conf.float(), dim=1) >= min_survival
    lead = torch.cumprod(survive.to(torch.int64), dim=1).sum(1)
    return torch.minimum(lead, budgets)


def repack_verify(runner: StepRunner, batches: DecodeBatches, target_len: np.ndarray,
                  lengths: np.ndarray) -> DecodeBatches:
    """The eager ``batches`` (no KV layout: not the graph path) with a packed verify over each
    request's ``lengths[b] + 1`` tokens (host int64 ``[B]`` in ``0..k``; ``target_len`` ``L``
    ``[B]`` host). The drafting batches are unchanged (already run); the verify's columns
    beyond ``lengths[b]`` repeat column ``lengths[b]`` (never read for what it emits)."""
    if batches.layout is not None:
        raise ValueError("repack_verify: the graph path keeps its captured verify shape")
    n, dev = runner.n, batches.rows.device
    lengths = np.asarray(lengths, np.int64)
    index, unpack = PackedVerify.indices(lengths, n)
    packed = PackedVerify(torch.from_numpy(index).to(dev), torch.from_numpy(unpack).to(dev),
                          runner._plan(batches.rows, lengths + 1, target_len + lengths + 1))
    return dataclasses.replace(batches, packed=packed)
