"""The worker follows the plans alone (one owner per fact): a real Rust scheduler's plans --
chunked prefills, decodes at changing steps, requests capped near their end, preemptions and
their re-prefills -- run through ``SpecWorker.prefill`` / ``decode`` and reported back give
the target's greedy tokens (docs/design.md invariant 1). The test keeps no length, position or KV
slot of its own: what it knows of a request is what ``report`` returned."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import PROMPTS
from specdial._core import Scheduler, SchedulerConfig
from specdial.engine import Engine
from specdial.worker.batch_sampling import BatchSampling
from specdial.worker.drafters import make_drafter
from specdial.worker.sampling_params import SamplingParams
from specdial.worker.worker import SpecWorker

N = 24  # output tokens per request
STEPS = [3, 0, 2, 7, 1, 0, 0, 5, 4]


def greedy(b: int) -> BatchSampling:
    return BatchSampling.from_params([SamplingParams()] * b)


def target_greedy(target) -> list[list[int]]:
    with Engine.from_modules(target, None, max_running_requests=4, kv_cache_tokens=1024,
                             page_size=8) as engine:
        return [o["output_ids"] for o in engine.generate(
            input_ids=PROMPTS, sampling_params={"max_new_tokens": N, "temperature": 0.0,
                                                "ignore_eos": True})]


def run_plans(worker: SpecWorker, sched: Scheduler, skip_zero: bool) -> tuple[dict, int]:
    """Schedule -> worker -> report until every request finished; returns the tokens each
    request was given by ``report`` and the number of preemptions."""
    rids = [sched.add_request(p, N, ignore_eos=True) for p in PROMPTS]
    got: dict[int, list[int]] = {r: [] for r in rids}
    it = 0
    with torch.inference_mode():
        while sched.has_unfinished():
            sched.set_fixed_steps(STEPS[it % len(STEPS)])
            plan = sched.schedule()
            assert plan is not None
            if plan.is_prefill:
                n_first = int(np.asarray(plan.sample_first).sum())
                out = worker.prefill(plan, greedy(n_first) if n_first else None, None,
                                     draft_prefill=not skip_zero)
                res = sched.report(out.tokens, out.offsets)
            else:
                out = worker.decode(plan, greedy(len(plan)), None)
                res = sched.report(out.tokens, out.offsets, out.accepted)
            offs = np.asarray(res.new_offsets)
            for i, rid in enumerate(np.asarray(res.request_ids).tolist()):
                got[rid].extend(np.asarray(res.new_tokens)[offs[i]:offs[i + 1]].tolist())
            it += 1
            assert it < 500
    assert sched.stats().kv_pages_used == 0 and sched.rows_in_use == 0
    return {r: got[r] for r in rids}, sched.stats().preemptions


@pytest.mark.parametrize("skip_zero", [False, True])
@pytest.mark.parametrize("name", ["draft", "eagle"])
def test_plans_alone_give_the_target_greedy_tokens(request, name, skip_zero):
    """Chunked prefills (8 tokens per iteration) and a KV cache too small for every request
    (preemption, then a re-prefill of prompt + output that samples nothing)."""
    fixture = request.getfixturevalue("tiny" if name == "draft" else "tiny1")
    target = fixture.target
    module = fixture.draft_noisy if name == "draft" else fixture.eagle_noisy
    want = target_greedy(target)
    sched = Scheduler(SchedulerConfig(max_running_requests=3, context_length=64, num_pages=12,
                                      page_size=8, max_prefill_tokens=8,
                                      chunked_prefill_size=8,
                                      skip_zero_step_draft_extend=skip_zero),
                      speculative_num_steps=0, adaptive=False)
    worker = SpecWorker(target, make_drafter(module, target, max_steps=7), sched.num_slots,
                        max_running_requests=3, context_length=64, step_values=range(8),
                        max_extend_tokens=8)
    got, preemptions = run_plans(worker, sched, skip_zero)
    assert list(got.values()) == want
    assert not hasattr(worker, "target_len")  # the plans are the only source of lengths
    assert preemptions > 0  # the re-prefill path ran
