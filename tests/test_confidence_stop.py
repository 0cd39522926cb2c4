"""Issue 28, the worker's side of the confidence stop and of budget-0 requests skipping the draft
extend: a plan's ``min_survival`` cuts each request's verify after drafting (on the device, the
cut lengths returned with the one host copy as ``verified``), the packed verify runs only the
cut lengths on the CPU, and ``skip_extend`` leaves budget-0 requests' drafter behind until they
draft again. Greedy output stays identical to target-only for every drafter (docs/design.md
invariant 1), a seeded request's tokens do not depend on the cut (invariant 2), and a drafter
equal to the target accepts every verified draft after skips (invariant 3)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import PROMPTS
from specdial.worker.confidence_stop import cut_lengths, stop_confidence
from specdial.worker.inputs import DecodeInput, PrefillInput
from specdial.worker.sampling import BatchSampling, SamplingParams
from specdial.worker.worker import SpecWorker
from test_verify_budgets import (D, GREEDY, N, W, budgets_of, i64, make_worker, run_budgets,
                                 target_tokens)


def run_stop(worker: SpecWorker, prompts, params, min_survival: float, *, skip: bool = True,
             budgets=budgets_of, record=None) -> list[list[int]]:
    """:func:`run_budgets` with the confidence stop at ``min_survival`` (0: none) and, when
    ``skip``, budget-0 requests skipping their extend."""
    return run_budgets(worker, prompts, params, budgets, record, min_survival=min_survival,
                       skip=skip)


def test_cut_lengths_stop_at_the_first_position_below_the_threshold():
    conf = torch.tensor([[0.9, 0.9, 0.9, 0.9],    # cumulative 0.9 0.81 0.729 0.656
                         [0.5, 1.0, 1.0, 1.0],    # 0.5 ...
                         [1.0, 1.0, 0.1, 1.0],    # a later position rising again is not
                         [0.9, 0.9, 0.9, 0.9]])   # verified; budget 1 caps the last row
    budgets = torch.tensor([4, 4, 4, 1])
    assert cut_lengths(conf, budgets, 0.7).tolist() == [3, 0, 2, 1]
    assert cut_lengths(conf, budgets, 0.5).tolist() == [4, 4, 2, 1]
    assert cut_lengths(conf, budgets, 0.95).tolist() == [0, 0, 2, 0]
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="min_survival"):
            cut_lengths(conf, budgets, bad)


@pytest.mark.parametrize("name", ["draft", "eagle", "eagle3"])
@pytest.mark.parametrize("ms", [0.2, 0.6])
def test_greedy_tokens_with_the_confidence_stop(request, name, ms):
    fixture, attr = {"draft": ("tiny", "draft_noisy"), "eagle": ("tiny1", "eagle_noisy"),
                     "eagle3": ("exact", "eagle3_noisy")}[name]
    models = request.getfixturevalue(fixture)
    cut = []
    worker = make_worker(models.target, getattr(models, attr))
    with torch.inference_mode():
        got = run_stop(worker, PROMPTS, GREEDY, ms,
                       record=lambda dec, v, live: cut.append(int((dec.verified < v).sum())))
    assert got == target_tokens(models.target)
    assert sum(cut) > 0  # the rule cut something, so the test exercises it


def test_graph_replay_keeps_its_shape_and_the_cut_only_limits_acceptance(tiny):
    """The graph path (emulated on the CPU) is not re-packed; the device-side cut keeps it
    lossless."""
    worker = make_worker(tiny.target, tiny.draft_noisy, cuda_graph_bs=[1, 2, 4],
                         cuda_graph_mode="emulate")
    with torch.inference_mode():
        got = run_stop(worker, PROMPTS, GREEDY, 0.5)
    assert worker.graph_stats()["replays"]["verify"] > 0
    assert got == target_tokens(tiny.target)


def test_the_verify_runs_only_the_cut_lengths(tiny):
    """On the CPU the target's verify forward sees ``sum(verified + 1)`` tokens, not the
    budgets'."""
    worker = make_worker(tiny.target, tiny.draft_noisy)
    seen: list[int] = []
    hook = tiny.target.embed_tokens.register_forward_hook(
        lambda mod, args, out: seen.append(args[0].numel()))
    shorter = []

    def record(dec, v, live):
        assert seen[-1] == int((dec.verified + 1).sum())
        shorter.append(int(dec.verified.sum()) < int(v.sum()))
        seen.clear()

    try:
        with torch.inference_mode():
            run_stop(worker, PROMPTS, GREEDY, 0.5, record=record)
    finally:
        hook.remove()
    assert any(shorter)


@pytest.mark.parametrize("name", ["draft", "eagle"])
def test_a_drafter_equal_to_the_target_accepts_every_verified_draft(request, name):
    """The drafter's state is right after budget-0 iterations that skipped the extend and
    after cut verifies: a drafter reproducing the target accepts every verified draft."""
    models = request.getfixturevalue("tiny" if name == "draft" else "tiny1")
    module = models.draft_same if name == "draft" else models.eagle_same
    worker = make_worker(models.target, module)
    short = []

    def record(dec, v, live):
        short.append(int((dec.accepted != (v if dec.verified is None else dec.verified)).sum()))

    def budgets(it, live, caps):  # long runs of budget 0, then drafting again
        return np.minimum(np.full(len(live), 0 if it % 5 < 3 else D), caps)

    with torch.inference_mode():
        run_stop(worker, PROMPTS, GREEDY, 0.0, budgets=budgets, record=record)
        assert sum(short) == 0
        run_stop(make_worker(models.target, module), PROMPTS, GREEDY, 0.3, record=record)
    assert sum(short) == 0


def test_a_skipped_extend_leaves_the_drafter_behind_until_the_request_drafts(tiny):
    """A budget-0 request marked ``skip_extend`` runs no drafter forward at all (neither the
    catch-up before drafting nor the extend), its drafter length lags; the iteration where it
    drafts again catches it up first. Without the mark its extend runs every iteration."""
    for skip in (True, False):
        worker = make_worker(tiny.target, tiny.draft_noisy)
        ds = worker.drafter_state

        def budgets(it, live, caps):  # request 0 sits at budget 0 for iterations 0..2
            v = np.minimum(np.full(len(live), 2), caps)
            v[0] = 0 if it < 3 else v[0]
            return v

        lens = []

        def rec(dec, v, live):
            if live[0] == 0:
                lens.append(int(ds.draft_len[0]))

        with torch.inference_mode():
            run_stop(worker, PROMPTS, GREEDY, 0.0, skip=skip, budgets=budgets, record=rec)
        prompt = len(PROMPTS[0])
        if skip:  # no extend for three iterations: still at the prompt's end
            assert lens[:3] == [prompt] * 3
            assert lens[3] > prompt + 3  # caught up before drafting, then extended
        else:
            assert lens[:3] == [prompt + 1, prompt + 2, prompt + 3]


def test_seeded_tokens_do_not_depend_on_the_cut(tiny):
    params = [SamplingParams(temperature=1.0, seed=100 + i) for i in range(len(PROMPTS))]
    runs = []
    for ms in (0.0, 0.3, 0.8):
        worker = make_worker(tiny.target, tiny.draft_noisy)
        with torch.inference_mode():
            runs.append(run_stop(worker, PROMPTS, params, ms))
    assert runs[0] == runs[1] == runs[2]


def test_decode_input_checks_the_new_fields():
    base = dict(steps=1, graph_bs=None, rows=i64([0, 1]), input_ids=i64([1, 2]),
                positions=i64([3, 3]), out_loc=i64([0, 1, 2, 3]),
                steps_per_request=i64([1, 0]))
    with pytest.raises(ValueError, match="skip_extend: expected 2"):
        DecodeInput(**base, skip_extend=i64([0]))
    with pytest.raises(ValueError, match="skip_extend: only a request at verify budget 0"):
        DecodeInput(**base, skip_extend=i64([1, 1]))
    with pytest.raises(ValueError, match="min_survival must be in"):
        DecodeInput(**base, min_survival=1.0)
    DecodeInput(**base, skip_extend=i64([0, 1]), min_survival=0.5)


def test_replay_uses_the_recorded_per_request_lengths(tmp_path):
    """``specdial policy replay`` bounds each request by what it verified: at chosen steps above
    a request's recorded length, one that accepted all of it is censored (not fed, its recorded
    tokens counted), one that rejected inside it replays exactly; bad lengths are refused."""
    from specdial._core import AdaptiveConfig
    from specdial.replay import TraceError, parse_line, replay

    cfg = AdaptiveConfig.from_dict({"1": {"candidate_steps": [3]}})
    lines = [{"batch_size": 3, "accepted": [1, 0, 3], "steps": 3, "steps_per_request": [3, 2, 3],
              "min_survival": 0.4, "verified": [1, 2, 3]}] * 4
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(x) for x in lines))
    s = replay(cfg, trace, initial_steps=3)
    # request 0 verified 1 and accepted it: censored at steps 3; request 1 rejected at 1 of 2
    assert (s.censored, s.stopped, s.verifies) == (4, 4, 4)
    assert s.emitted_tokens == 4 * (2 + 1 + 4)
    assert s.to_dict()["censored_observations"] == 4
    plain = tmp_path / "p.jsonl"
    plain.write_text("\n".join(json.dumps({k: x[k] for k in ("batch_size", "accepted", "steps")})
                               for x in lines))
    assert replay(cfg, plain, initial_steps=3).censored == 0
    for bad, msg in [({"verified": [4, 0, 3]}, "verified"), ({"verified": [0, 0, 3]}, "exceeds"),
                     ({"steps_per_request": [3, 2]}, "steps_per_request must be a list of 3"),
                     ({"min_survival": 1.5}, "min_survival must be a number in")]:
        with pytest.raises(TraceError, match=msg):
            parse_line(json.dumps({**lines[0], **bad}), "t:1")


@pytest.mark.parametrize("name", ["draft", "eagle"])
def test_engine_with_the_stop_is_lossless_and_its_trace_replays(request, name, tmp_path, capsys):
    """Through the engine (goodput per-request with a fixed ``min_survival``): greedy output
    equals target-only, every page comes back, the trace records the cut and replays."""
    from greedy import greedy
    from specdial.cli import main as cli_main
    from specdial.engine import Engine
    from test_engine_greedy import assert_no_leak

    fixture, attr = {"draft": ("tiny", "draft_noisy"), "eagle": ("tiny1", "eagle_noisy")}[name]
    models = request.getfixturevalue(fixture)
    kw = dict(max_running_requests=4, kv_cache_tokens=2048, page_size=8)
    cfg = {"strategy": "goodput", "verify": "per_request", "min_survival": 0.3,
           "1": {"candidate_steps": [0, 1, 2, 3, 4]}}
    with Engine.from_modules(models.target, None, **kw) as plain:
        want = [o["output_ids"] for o in plain.generate(input_ids=PROMPTS,
                                                        sampling_params=greedy(24))]
    trace = tmp_path / "trace.jsonl"
    with Engine.from_modules(models.target, getattr(models, attr), record_trace=str(trace),
                             speculative_adaptive_config=cfg, **kw) as engine:
        got = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS * 2,
                                                         sampling_params=greedy(24))]
        assert_no_leak(engine)
    assert got == want * 2
    rows = [json.loads(x) for x in trace.read_text().splitlines()]
    cut = [r for r in rows if "verified" in r]
    assert cut and all(r["min_survival"] == pytest.approx(0.3) for r in cut)
    assert all(len(r["verified"]) == r["batch_size"] for r in cut)
    assert cli_main(["policy", "replay", "--trace", str(trace), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["confidence_stop_verifies"] == len(cut)


def test_a_cut_that_depends_on_the_drafts_keeps_sampling_exact():
    """Rejection sampling with verify lengths from the stop rule still emits the target's
    distribution (docs/design.md invariant 2) when the factor at position ``j`` does not depend
    on ``d_j`` (:func:`stop_confidence`'s ``max q_j`` for unseeded rows): the first emitted
    token follows ``p_0``; the second (emitted now, or by the next plain step for rows that
    stopped after one) follows ``p_1`` (the target here does not depend on the prefix). With
    the drafted tokens' own ``q(d)`` as the factor (the shared contract's text) it does not:
    the rule then keeps ``d_1`` only where ``q(d_1)`` is high, and the first token is biased."""
    from specdial.worker.sampling import speculative_accept
    from test_sampling import assert_fits, gen

    v, rows = 5, 30000
    p = torch.tensor([[0.1, 0.2, 0.3, 0.25, 0.15], [0.3, 0.1, 0.1, 0.2, 0.3],
                      [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.05, 0.05, 0.6, 0.2, 0.1], [0.4, 0.3, 0.1, 0.1, 0.1]])
    drafts = torch.stack([torch.multinomial(q[i], rows, True, generator=gen(10 + i))
                          for i in range(2)], 1)
    draft_probs = q[None].expand(rows, 2, v).contiguous()
    conf = q.gather(1, drafts.T).T  # [rows, 2]: q(d) of each drafted token
    target = torch.log(p)[None].expand(rows, 3, v).contiguous()
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0)] * rows)
    budgets = torch.full((rows,), 2)
    biased = cut_lengths(conf, budgets, 0.12)  # the contract's factor, q(d_j)
    acc, out = speculative_accept(drafts, draft_probs, target, sampling, gen(5), limits=biased)
    with pytest.raises(AssertionError, match="chi2"):
        assert_fits("first token, factor q(d_j)", out[:, 0], p[0])
    unseeded = torch.ones(rows, dtype=torch.bool)
    # max q = 0.6 then 0.4: cumulative 0.6, 0.24; a threshold between cuts after one draft
    for ms, want in ((0.3, 1), (0.7, 0), (0.2, 2)):
        lens = cut_lengths(stop_confidence(conf, draft_probs, unseeded), budgets, ms)
        assert bool((lens == want).all())
    # a prefix-dependent factor: position 2 is verified only where q(d_1) is high
    factor = torch.stack([q[0].max().expand(rows), conf[:, 0]], 1)
    lens = cut_lengths(factor, budgets, 0.2)
    assert 0 < int((lens == 1).sum()) and 0 < int((lens == 2).sum())
    acc, out = speculative_accept(drafts, draft_probs, target, sampling, gen(5), limits=lens)
    assert bool((acc <= lens).all())
    assert_fits("first token under the stop rule", out[:, 0], p[0])
    one = acc == 0  # these emitted one token: their second comes from a plain step at p_1
    nxt = torch.multinomial(p[1], int(one.sum()), True, generator=gen(6))
    second = out[:, 1].clone()
    second[one] = nxt
    assert_fits("second token under the stop rule", second, p[1])


def test_unseeded_sampling_rows_cut_by_their_distributions_confidence(tiny):
    """A batch mixing greedy, seeded and unseeded sampling rows runs the stop (the unseeded rows
    with ``max q``); the greedy row's tokens stay target-only's."""
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.7)][:len(PROMPTS)]
    assert len(params) >= 3
    worker = make_worker(tiny.target, tiny.draft_noisy)
    cut = []
    with torch.inference_mode():
        got = run_stop(worker, PROMPTS, params, 0.3,
                       record=lambda dec, v, live: cut.append(int((dec.verified < v).sum())))
    assert got[0] == target_tokens(tiny.target)[0]
    assert sum(cut) > 0
