"""The worker runs without a scheduler: prefill / decode inputs built by hand (the worker's own
slot layout, steps changing between iterations, capped requests) give the target's greedy
tokens (docs/design.md invariant 1); the inputs reject arrays of the wrong length, naming the field;
a plan and the input built from it by ``worker_input`` are the same work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import PROMPTS
from specdial._core import Scheduler, SchedulerConfig
from specdial.engine import Engine
from specdial.worker.drafters import make_drafter
from specdial.worker.inputs import DecodeInput, PrefillInput, worker_input
from specdial.worker.sampling import BatchSampling, SamplingParams
from specdial.worker.worker import SpecWorker

N = 14  # output tokens per request
W = 64  # slots per row in the hand-made layout: row r owns slots r * W .. r * W + W - 1
STEPS = [3, 0, 2, 7, 1, 0, 5]


def i64(values) -> np.ndarray:
    return np.asarray(values, np.int64)


def hand_run(worker: SpecWorker, prompts: list[list[int]]) -> list[list[int]]:
    b = len(prompts)
    lens = i64([len(p) for p in prompts])
    sampling = BatchSampling.from_params([SamplingParams()] * b)
    out = worker.prefill(PrefillInput(
        rows=i64(range(b)), input_ids=i64(sum(prompts, [])),
        out_loc=i64(np.concatenate([r * W + np.arange(n) for r, n in enumerate(lens)])),
        qo_lens=lens, kv_lens=lens, sample_first=np.ones(b, np.int64),
        logits_indices=np.cumsum(lens) - 1), sampling, None)
    outputs = [[int(t)] for t in out.tokens]
    for it in range(100):
        live = [r for r in range(b) if len(outputs[r]) < N]  # finished rows leave the batch
        if not live:
            break
        steps = STEPS[it % len(STEPS)]
        # KV convention: the last token has no KV yet; it is this iteration's input
        positions = i64([len(prompts[r]) + len(outputs[r]) - 1 for r in live])
        steps_r = i64([min(steps, N - len(outputs[r]) - 1) for r in live])
        out_loc = i64([r * W + positions[i] + j if j <= steps_r[i] else worker.pad_kv_slot
                       for i, r in enumerate(live) for j in range(steps + 1)])
        dec = worker.decode(DecodeInput(steps, None, i64(live), i64([outputs[r][-1] for r in live]),
                                        positions, out_loc, steps_r),
                            BatchSampling.from_params([SamplingParams()] * len(live)), None)
        for i, r in enumerate(live):
            outputs[r].extend(int(t) for t in dec.tokens_of(i))
    return outputs


def test_hand_built_inputs_give_the_greedy_tokens(tiny):
    with Engine.from_modules(tiny.target, None, max_running_requests=4, kv_cache_tokens=1024,
                             page_size=8) as engine:
        want = [o["output_ids"] for o in engine.generate(
            input_ids=PROMPTS, sampling_params={"max_new_tokens": N, "temperature": 0.0,
                                                "ignore_eos": True})]
    worker = SpecWorker(tiny.target, make_drafter(tiny.draft_noisy, tiny.target, max_steps=7),
                        4 * W, max_running_requests=4, context_length=W - 8,
                        step_values=range(8))
    with torch.inference_mode():
        got = hand_run(worker, PROMPTS)
    assert got == want


def test_inputs_name_the_field_of_a_wrong_length():
    ones = np.ones(2, np.int64)
    with pytest.raises(ValueError, match="^out_loc: expected 4 entries, got 3"):
        DecodeInput(1, None, i64([0, 1]), ones, ones, i64([0, 1, 2]), ones)
    with pytest.raises(ValueError, match="^logits_indices: expected 2 entries, got 1"):
        PrefillInput(i64([0, 1]), ones, ones, ones, ones, ones, i64([0]))


def test_worker_input_carries_what_the_plan_says():
    sched = Scheduler(SchedulerConfig(max_running_requests=4, context_length=64, num_pages=16,
                                      page_size=4), speculative_num_steps=2, adaptive=False)
    for p in PROMPTS:
        sched.add_request(p, 3)
    plan = sched.schedule()
    inp = worker_input(plan, -1)
    assert isinstance(inp, PrefillInput)
    assert inp.rows.tolist() == plan.rows.tolist() == [0, 1, 2]
    assert inp.logits_indices.tolist() == plan.logits_indices.tolist()
    sched.report(np.zeros(3, np.int64) + 5, [0, 1, 2, 3])
    plan = sched.schedule()
    inp = worker_input(plan, -1)
    assert isinstance(inp, DecodeInput) and inp.steps == 2
    assert inp.out_loc.tolist() == plan.out_loc_padded(-1).tolist()
    assert inp.positions.tolist() == plan.positions.tolist()
