"""Issue 28 from Python: the goodput strategy's ``verify`` key and ``Scheduler.report(draft_probs=)``
(the drafter's probability of each verified draft token, the next decision's draft confidence)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specdial._core import AdaptiveConfig, ConfigError, Scheduler, SchedulerConfig

PER_REQUEST = {"strategy": "goodput", "verify": "per_request", "1": {"candidate_steps": [0, 1, 2, 3]}}


def scheduler(adaptive: dict) -> Scheduler:
    cfg = SchedulerConfig(max_running_requests=4, max_queued_requests=8, max_prefill_tokens=64,
                          context_length=256, num_pages=256, page_size=4)
    sched = Scheduler(cfg, speculative_num_steps=3, adaptive_config=AdaptiveConfig.from_dict(adaptive))
    for _ in range(3):
        sched.add_request([1, 2, 3], 100)
    return sched


def first_decode(sched: Scheduler):
    plan = sched.schedule()
    assert plan.is_prefill
    n = int(np.asarray(plan.sample_first).sum())
    sched.report(np.full(n, 5), np.concatenate([[0], np.cumsum(plan.sample_first)]))
    plan = sched.schedule()
    assert not plan.is_prefill
    return plan


def test_the_verify_key_names_its_allowed_values():
    assert json.loads(AdaptiveConfig.from_dict(PER_REQUEST).to_json())["verify"] == "per_request"
    assert json.loads(AdaptiveConfig.from_dict({**PER_REQUEST, "verify": "batch"}).to_json())["verify"] == "batch"
    with pytest.raises(ConfigError, match='verify must be one of "batch", "per_request"'):
        AdaptiveConfig.from_dict({**PER_REQUEST, "verify": "tree"})


@pytest.mark.parametrize("verify", ["per_request", "batch"])
def test_report_takes_draft_probs_and_checks_them(verify):
    sched = scheduler({**PER_REQUEST, "verify": verify})
    plan = first_decode(sched)
    spr = np.asarray(plan.steps_per_request)
    n = int(spr.sum())
    assert n > 0
    offsets = np.arange(len(spr) + 1)  # every request: no draft accepted, the bonus token
    tokens = np.full(len(spr), 5)
    with pytest.raises(ValueError, match=rf"^draft_probs: must hold sum\(steps_per_request\) = {n}"):
        sched.report(tokens, offsets, draft_probs=np.full(n + 1, 0.5))
    with pytest.raises(ValueError, match=r"^draft_probs: draft_probs\[0\] = 2"):
        sched.report(tokens, offsets, draft_probs=[2.0] + [0.5] * (n - 1))
    with pytest.raises(TypeError, match="draft_probs must be a sequence of floats"):
        sched.report(tokens, offsets, draft_probs="high")
    assert sched.plan_in_flight
    # float32 (what a torch tensor gives through numpy) and float64 both read
    sched.report(tokens, offsets, draft_probs=np.full(n, 0.25, dtype=np.float32))
    plan = sched.schedule()
    spr = np.asarray(plan.steps_per_request)
    assert np.array_equal(np.asarray(plan.qo_lens), spr + 1)  # KV for each request's own length
    sched.report(np.full(len(spr), 5), np.arange(len(spr) + 1), draft_probs=np.full(int(spr.sum()), 0.25))
