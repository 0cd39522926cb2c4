"""Greedy acceptance of a chain on the host, for a CPU device (issue 29, batch 1).

On the CPU the tensors of a decode iteration already live in host memory, and each small torch
op right after the verify forward runs cold (its dispatch several times its warm cost: 20-90 µs
measured in situ at batch 1, against 3-10 µs warm). :func:`greedy_accept_host` does what
:meth:`SpecWorker.accept <specdial.worker.worker.SpecWorker.accept>` does for an all-greedy
batch (:func:`~specdial.worker.sampling.speculative_accept`'s greedy rule, the token table
write, the host copy) with one torch op (the target's argmax) and numpy on views of the same
memory, and returns the same :class:`~specdial.worker.stages.Accepted`. Batches it does not
cover (another device, sampled or seeded rows, logprobs, structured outputs) return None and
take the torch path.

Rule (docs/design.md invariant 1): ``choice`` = the target's argmax per column ``[B, n]``;
``accepted`` = the leading run of drafts equal to ``choice[:, :k]``, capped at the request's
verify limit (the confidence stop's verify lengths, else the budgets when some is below
``k``); the emitted tokens are ``choice[:, :accepted + 1]`` (the accepted drafts equal their
columns' choices, then the correction or bonus token), ``-1`` after, written to the token
table at positions ``L + 1 ..`` (later columns are stale, never read).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specdial.worker.batch_sampling import BatchSampling
from specdial.worker.stages import Accepted, DecodeStep, Drafts, Verified

__all__ = ["greedy_accept_host"]


def greedy_accept_host(step: DecodeStep, drafts: Drafts, verified: Verified,
                       sampling: BatchSampling, req_to_ids: Any,
                       logprobs: Any) -> Accepted | None:
    """The :class:`Accepted` of an all-greedy decode batch whose tensors are on the CPU,
    computed on the host; None where the batch needs the torch path (not all greedy, a
    non-CPU device, ``logprobs`` rows, a grammar, steps 0).

    ``step``: the iteration's :class:`DecodeStep` (``B`` requests at steps ``k``);
    ``drafts.tokens`` ``[B, k]`` int64, ``drafts.conf`` ``[B, k]`` float32,
    ``drafts.verify_lens`` ``[B]`` int64 or None; ``verified.target`` ``[B, n, V]`` float32
    logits (after the processors); ``req_to_ids``: the tables' ``[max_bs, width]`` int64
    token table (written in place). Same outputs as the torch path, bit for bit (tested)."""
    k = step.steps
    target = verified.target
    if (not k or not sampling.all_greedy or logprobs is not None or sampling.grammar is not None
            or target.device.type != "cpu" or req_to_ids.device.type != "cpu"):
        return None
    choice = target.argmax(-1).numpy()  # [B, n]: first maximum, as the torch path
    run = (drafts.tokens.numpy() == choice[:, :k]).cumprod(1).sum(1)  # leading equal drafts
    budgets = step.inp.steps_per_request
    verify_lens = None
    if drafts.verify_lens is not None:  # the confidence stop's cut, at most the budgets
        verify_lens = drafts.verify_lens.numpy().astype(np.int64)
        run = np.minimum(run, verify_lens)
    elif bool((budgets < k).any()):
        run = np.minimum(run, budgets)
    accepted = run.astype(np.int64)
    out = np.where(np.arange(k + 1)[None, :] <= accepted[:, None], choice, -1)
    positions = step.target_len[:, None] + np.arange(1, k + 2)[None, :]
    req_to_ids.numpy()[step.rows[:, None], positions] = out
    keep = np.arange(k)[None, :] < np.asarray(budgets)[:, None]
    return Accepted(accepted, out, None, drafts.conf.numpy()[keep].astype(np.float32),
                    verify_lens)
