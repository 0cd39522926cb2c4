"""Drafter state (docs/design.md invariant 3): after draft extend, and after skipped zero-step extends
plus the catch-up, the drafter's KV of a request equals a fresh drafter prefill of the same
tokens (and an EAGLE drafter's per-slot target features equal the true sequence's); acceptance
after a zero-step interval equals acceptance without skipping. Drafters: a draft model, an
EAGLE-1 head and an EAGLE-3 head."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import PROMPTS
from specdial._core import Scheduler, SchedulerConfig
from specdial.attention import TorchAttentionBackend
from specdial.models import ForwardBatch
from specdial.worker.drafters import make_drafter, run_target
from specdial.worker.sampling import BatchSampling, SamplingParams
from specdial.worker.worker import SpecWorker

SCHEDULE = [3, 0, 0, 2, 5, 0, 0, 0, 7, 1, 0, 4]


def fresh_drafter_kv(target, module, tokens):
    """K/V of a fresh drafter prefill of ``tokens`` (slots 0..T-1): ``[layers, T, kvh, d]`` x2,
    and the target features of ``tokens`` (``[T, F]``, None for a draft model)."""
    t = len(tokens)
    backend = TorchAttentionBackend()
    ar = torch.arange(t)
    batch = ForwardBatch(torch.tensor(tokens), ar, ar, backend.plan(torch.tensor([t]),
                                                                  torch.tensor([t]), ar))
    drafter = make_drafter(module, target)
    pool = drafter.init_kv(t)
    _, feats = run_target(target, drafter, batch, target.make_kv_pool(t), backend)
    shifted = None
    if feats is not None:
        shifted = torch.cat([torch.zeros_like(feats[:1]), feats[:-1]])  # h_{p-1}, zeros at 0
    drafter.prefill(batch, backend, hidden_states=shifted)
    return pool.k_buffer[:, :t], pool.v_buffer[:, :t], feats


def models(request, name):
    """(target, drafter module) with partial acceptance, so extends cover accepted drafts."""
    if name == "draft":
        tiny = request.getfixturevalue("tiny")
        return tiny.target, tiny.draft_noisy
    if name == "eagle3":
        exact = request.getfixturevalue("exact")
        return exact.target, exact.eagle3_noisy
    tiny1 = request.getfixturevalue("tiny1")
    return tiny1.target, tiny1.eagle_noisy


def make_worker(target, module, skip, max_extend_tokens=4096):
    """A worker over a scheduler's KV pool (64 pages of 8 tokens), steps fixed per iteration."""
    # the scheduler, the one owner of the setting, marks which requests skip their extend
    # (plan.skip_extend); the worker follows the plan
    sched = Scheduler(SchedulerConfig(max_running_requests=4, context_length=128, num_pages=64,
                                      page_size=8, skip_zero_step_draft_extend=skip),
                      speculative_num_steps=0, adaptive=False)
    worker = SpecWorker(target, make_drafter(module, target, max_steps=7), sched.num_slots,
                        max_running_requests=4, context_length=128, step_values=range(8),
                        max_extend_tokens=max_extend_tokens)
    return worker, sched


def target_lens(sched, rids):
    """Each request's target length from the scheduler (which owns it; the worker keeps no
    copy): its tokens but the last, whose KV the next iteration writes."""
    return np.array([len(p) + len(sched.output_ids(r)) - 1 for r, p in zip(rids, PROMPTS)])


def check_drafter_kv(target, worker, module, rows):
    kv = worker.drafter.kv
    for row in rows.tolist():
        n = int(worker.draft_len[row])
        tokens = worker.tables.req_to_ids[row, :n].tolist()
        slots = worker.tables.req_to_token[row, :n]
        k_ref, v_ref, feats = fresh_drafter_kv(target, module, tokens)
        torch.testing.assert_close(kv.k_buffer[:, slots], k_ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(kv.v_buffer[:, slots], v_ref, atol=2e-5, rtol=1e-4)
        if feats is not None:  # the features kept per slot are the true sequence's
            torch.testing.assert_close(worker.hidden[slots], feats, atol=2e-5, rtol=1e-4)


def run_schedule(target, module, skip, check, lazy_prefill=False, max_extend_tokens=4096):
    """Prefill ``PROMPTS`` (the drafter's pass left to the catch-up with ``lazy_prefill``),
    then decode at ``SCHEDULE``'s steps, checking lengths (and drafter KV with ``check``) after
    every iteration. Returns the accepted counts per iteration."""
    worker, sched = make_worker(target, module, skip, max_extend_tokens)
    sampling = BatchSampling.from_params([SamplingParams()] * len(PROMPTS))
    rids = [sched.add_request(p, 100) for p in PROMPTS]  # no request is capped below steps
    accepted = []
    with torch.inference_mode():
        plan = sched.schedule()
        assert plan.is_prefill and plan.request_ids.tolist() == rids
        out = worker.prefill(plan, sampling, None, draft_prefill=not lazy_prefill)
        sched.report(out.tokens, out.offsets)
        rows = np.array([sched.row_of(r) for r in rids])
        if lazy_prefill:
            assert (worker.draft_len[rows] == 0).all()
        else:
            assert (worker.draft_len[rows] == target_lens(sched, rids)).all()
            if check:
                check_drafter_kv(target, worker, module, rows)
        state_ptrs = {s: st.buffers.verify_input_ids.data_ptr() for s, st in worker.states.items()}
        assert len(set(state_ptrs.values())) == 1  # one buffer set for every steps value
        for steps in SCHEDULE:
            sched.set_fixed_steps(steps)
            plan = sched.schedule()
            assert plan.kind == "decode" and plan.steps == steps
            before = target_lens(sched, rids)
            out = worker.decode(plan, sampling, None)
            sched.report(out.tokens, out.offsets, out.accepted)
            accepted.append(out.accepted)
            np.testing.assert_array_equal(target_lens(sched, rids), before + out.accepted + 1)
            lag = target_lens(sched, rids) - worker.draft_len[rows]
            if steps == 0 and skip:
                assert (lag > 0).all()
            else:
                assert (lag == 0).all()
            if check:
                check_drafter_kv(target, worker, module, rows)
        # the runners' buffers are filled in place, never replaced
        assert state_ptrs == {s: st.buffers.verify_input_ids.data_ptr()
                              for s, st in worker.states.items()}
        for rid in rids:
            sched.abort(rid)
    assert sched.stats().kv_pages_used == 0 and sched.rows_in_use == 0
    return accepted


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("name", ["draft", "eagle", "eagle3"])
def test_drafter_kv_equals_fresh_prefill(request, name, skip):
    accepted = run_schedule(*models(request, name), skip, check=True)
    assert sum(int(a.sum()) for a in accepted) > 0  # extends over accepted drafts happened


@pytest.mark.parametrize("name", ["draft", "eagle", "eagle3"])
def test_a_deferred_drafter_prefill_catches_up_to_a_fresh_one(request, name):
    # the engine defers the drafter's prefill while decoding runs steps 0 (skip mode): the
    # catch-up before the first drafting iteration covers the prompt, and drafts are unchanged
    lazy = run_schedule(*models(request, name), skip=True, check=True, lazy_prefill=True)
    eager = run_schedule(*models(request, name), skip=True, check=False)
    # a catch-up longer than max_extend_tokens runs in pieces (the prompts: 29 tokens)
    pieces = run_schedule(*models(request, name), skip=True, check=True, lazy_prefill=True,
                          max_extend_tokens=5)
    for steps, a, b, c in zip(SCHEDULE, eager, lazy, pieces):
        np.testing.assert_array_equal(a, b, err_msg=f"steps={steps}")
        np.testing.assert_array_equal(a, c, err_msg=f"steps={steps} (catch-up in pieces)")


@pytest.mark.parametrize("name", ["draft", "eagle", "eagle3"])
def test_acceptance_after_skipped_zero_steps_is_unchanged(request, name):
    warm = run_schedule(*models(request, name), skip=False, check=False)
    caught_up = run_schedule(*models(request, name), skip=True, check=False)
    for steps, a, b in zip(SCHEDULE, warm, caught_up):
        np.testing.assert_array_equal(a, b, err_msg=f"steps={steps}")
    assert sum(int(a.sum()) for a in warm) > 0  # non-trivial acceptance somewhere


def test_a_long_catch_up_runs_in_forwards_of_bounded_size(request):
    target, module = models(request, "eagle")
    worker, sched = make_worker(target, module, skip=True, max_extend_tokens=8)
    sampling = BatchSampling.from_params([SamplingParams()] * len(PROMPTS))
    rids = [sched.add_request(p, 100) for p in PROMPTS]
    sizes = []
    inner = worker.drafter_state.extend_eager

    def counting(rows, start, end, state):
        sizes.append(int((end - start).sum()))
        return inner(rows, start, end, state)

    worker.drafter_state.extend_eager = counting
    with torch.inference_mode():
        plan = sched.schedule()
        out = worker.prefill(plan, sampling, None, draft_prefill=False)
        sched.report(out.tokens, out.offsets)
        sched.set_fixed_steps(2)
        plan = sched.schedule()
        out = worker.decode(plan, sampling, None)
        sched.report(out.tokens, out.offsets, out.accepted)
    rows = np.array([sched.row_of(r) for r in rids])
    # the prompts (3 + 9 + 17 tokens) caught up before drafting, 8 tokens at most per forward
    assert sum(sizes) >= sum(len(p) for p in PROMPTS)
    assert max(sizes) <= 8 and len(sizes) >= 4, sizes
    assert (worker.draft_len[rows] == target_lens(sched, rids)).all()
    check_drafter_kv(target, worker, module, rows)
