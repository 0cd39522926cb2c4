"""The all-greedy CPU acceptance on the host (``worker/host_accept.py``, issue 29) against the
torch path (``speculative_accept`` and the step's one host copy): the same accepted counts,
emitted tokens, confidences and verify lengths, iteration by iteration, with full budgets,
per-request budgets (0 included) and the confidence stop; batches it does not cover (sampled
rows) return None."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import PROMPTS
from specdial.worker import host_accept, worker as worker_mod
from specdial.worker.sampling import SamplingParams
from test_verify_budgets import D, GREEDY, budgets_of, make_worker, run_budgets


def _record(into: list):
    def record(dec, v, live):
        into.append((dec.accepted.copy(), dec.tokens.copy(), dec.offsets.copy(),
                     None if dec.draft_probs is None else dec.draft_probs.copy(),
                     None if dec.verified is None else dec.verified.copy(), list(live)))
    return record


@pytest.mark.parametrize("budgets,min_survival", [
    (lambda it, live, caps: np.minimum(D, caps), 0.0),
    (budgets_of, 0.0),
    (budgets_of, 0.3),
])
def test_host_acceptance_equals_the_torch_path(tiny, monkeypatch, budgets, min_survival):
    calls = []
    real = host_accept.greedy_accept_host

    def counted(*a, **k):
        out = real(*a, **k)
        calls.append(out is not None)
        return out

    runs = []
    for use_host in (True, False):
        monkeypatch.setattr(worker_mod, "greedy_accept_host",
                            counted if use_host else (lambda *a, **k: None))
        seen: list = []
        worker = make_worker(tiny.target, tiny.draft_noisy)
        with torch.inference_mode():
            tokens = run_budgets(worker, PROMPTS, GREEDY, budgets, _record(seen),
                                 min_survival=min_survival)
        runs.append((tokens, seen))
    assert calls and all(calls)  # every decode took the host path
    (tok_h, seen_h), (tok_t, seen_t) = runs
    assert tok_h == tok_t
    assert len(seen_h) == len(seen_t)
    for a, b in zip(seen_h, seen_t):
        for x, y in zip(a, b):
            if isinstance(x, np.ndarray):
                assert x.dtype == y.dtype and np.array_equal(x, y)
            else:
                assert x == y


def test_not_covered_batches_take_the_torch_path(tiny):
    """Sampled (seeded) rows: ``greedy_accept_host`` returns None (the torch path)."""
    calls = []
    real = host_accept.greedy_accept_host

    def counted(*a, **k):
        out = real(*a, **k)
        calls.append(out)
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(worker_mod, "greedy_accept_host", counted)
    try:
        worker = make_worker(tiny.target, tiny.draft_noisy)
        params = [SamplingParams(temperature=0.7, seed=3)] * len(PROMPTS)
        with torch.inference_mode():
            run_budgets(worker, PROMPTS, params, lambda it, live, caps: np.minimum(D, caps))
    finally:
        mp.undo()
    assert calls and all(c is None for c in calls)
