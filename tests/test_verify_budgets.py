"""Per-request verify budgets in the worker (issue 28): hand-built decode inputs whose
``steps_per_request`` differ inside one batch (0 included) run a packed verify (the target sees
only each request's ``v_r + 1`` tokens) and draft level ``j`` only for ``v_r >= j``, and stay
lossless (docs/design.md invariants 1-3, 7):

- greedy tokens equal the target's for the draft model, EAGLE and EAGLE-3 drafters;
- a drafter equal to the target accepts every draft of every budget (its state is right after
  each shortened verify);
- a seeded request's tokens do not depend on the budgets;
- ``StepOutput.draft_probs`` holds ``sum(v_r)`` confidences, and a budget caps acceptance on
  the device with the bonus token of the budget's column (chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import PROMPTS
from specdial.engine import Engine
from specdial.worker.draft_run import DraftRun
from specdial.worker.drafters import make_drafter
from specdial.worker.inputs import DecodeInput, PrefillInput
from specdial.worker.sampling import BatchSampling, SamplingParams, speculative_accept
from specdial.worker.verify_budgets import PackedVerify
from specdial.worker.worker import SpecWorker
from test_sampling import assert_fits, gen

N = 14  # output tokens per request
W = 80  # KV slots per row in the hand-made layout
D = 4  # the batch's draft depth


def i64(values) -> np.ndarray:
    return np.asarray(values, np.int64)


def budgets_of(it: int, live: list[int], caps: np.ndarray) -> np.ndarray:
    """Heterogeneous budgets in 0..D (a different mix every iteration), at most ``caps``."""
    rng = np.random.default_rng(it)
    return np.minimum(rng.integers(0, D + 1, len(live)), caps)


def run_budgets(worker: SpecWorker, prompts, params: list[SamplingParams], budgets=budgets_of,
                record=None, *, min_survival: float = 0.0, skip: bool = False
                ) -> list[list[int]]:
    """Prefill, then decodes at depth ``D`` with per-request budgets (``budgets(it, live,
    caps)``), budget-0 requests skipping their extend when ``skip``, and the confidence stop
    at ``min_survival`` (0: none; test_confidence_stop.py); ``record(dec, v, live)`` sees every
    decode output, its budgets and rows."""
    b = len(prompts)
    lens = i64([len(p) for p in prompts])
    out = worker.prefill(PrefillInput(
        rows=i64(range(b)), input_ids=i64(sum(prompts, [])),
        out_loc=i64(np.concatenate([r * W + np.arange(n) for r, n in enumerate(lens)])),
        qo_lens=lens, kv_lens=lens, sample_first=np.ones(b, np.int64),
        logits_indices=np.cumsum(lens) - 1), BatchSampling.from_params(params), None)
    outputs = [[int(t)] for t in out.tokens]
    for it in range(100):
        live = [r for r in range(b) if len(outputs[r]) < N]
        if not live:
            break
        positions = i64([len(prompts[r]) + len(outputs[r]) - 1 for r in live])
        v = budgets(it, live, i64([N - len(outputs[r]) - 1 for r in live]))
        out_loc = i64([r * W + positions[i] + j if j <= v[i] else worker.pad_kv_slot
                       for i, r in enumerate(live) for j in range(D + 1)])
        dec = worker.decode(DecodeInput(D, None, i64(live), i64([outputs[r][-1] for r in live]),
                                        positions, out_loc, v, (v == 0).astype(np.int64) * skip,
                                        min_survival),
                            BatchSampling.from_params([params[r] for r in live]), None)
        assert (dec.accepted <= v).all()
        assert dec.draft_probs is not None and dec.draft_probs.dtype == np.float32
        assert len(dec.draft_probs) == int(v.sum())  # every drafted token's confidence
        assert ((dec.draft_probs > 0) & (dec.draft_probs <= 1)).all()
        if min_survival:
            assert dec.verified is not None and ((dec.verified >= 0) & (dec.verified <= v)).all()
            assert (dec.accepted <= dec.verified).all()
            assert dec.decode_extras()["verified"] is dec.verified
        else:
            assert dec.verified is None
        if record is not None:
            record(dec, v, live)
        for i, r in enumerate(live):
            outputs[r].extend(int(t) for t in dec.tokens_of(i))
    return outputs


def make_worker(target, module, **kw) -> SpecWorker:
    return SpecWorker(target, make_drafter(module, target, max_steps=D), 4 * W,
                      max_running_requests=4, context_length=W - 8, step_values=[D], **kw)


def target_tokens(target, prompts=PROMPTS, **sp) -> list[list[int]]:
    with Engine.from_modules(target, None, max_running_requests=4, kv_cache_tokens=1024,
                             page_size=8) as engine:
        return [o["output_ids"] for o in engine.generate(
            input_ids=prompts, sampling_params={"max_new_tokens": N, "temperature": 0.0,
                                                "ignore_eos": True, **sp})]


GREEDY = [SamplingParams()] * len(PROMPTS)


@pytest.mark.parametrize("name", ["draft", "eagle", "eagle3"])
def test_greedy_tokens_with_per_request_budgets(request, name):
    fixture, attr = {"draft": ("tiny", "draft_noisy"), "eagle": ("tiny1", "eagle_noisy"),
                     "eagle3": ("exact", "eagle3_noisy")}[name]
    models = request.getfixturevalue(fixture)
    worker = make_worker(models.target, getattr(models, attr))
    with torch.inference_mode():
        got = run_budgets(worker, PROMPTS, GREEDY)
    assert got == target_tokens(models.target)


@pytest.mark.parametrize("sizes", [[1, 2, 4], [1, 2]])
def test_graph_replay_of_a_budgeted_batch_is_padded_and_lossless(tiny, sizes):
    """The CUDA-graph path (emulated on the CPU) keeps its ``(steps, padded batch)`` graphs: a
    heterogeneous batch replays them padded to the depth, and the device-side caps keep it
    lossless; a batch above the largest graph (3 requests, graphs of 1 and 2) runs packed."""
    worker = make_worker(tiny.target, tiny.draft_noisy, cuda_graph_bs=sizes,
                         cuda_graph_mode="emulate")
    with torch.inference_mode():
        got = run_budgets(worker, PROMPTS, GREEDY)
    stats = worker.graph_stats()
    assert stats["replays"]["verify"] > 0 and stats["replays"]["draft"] > 0
    assert (stats["eager"].get("decode:budgets_eager", 0) > 0) == (max(sizes) < 3)
    assert got == target_tokens(tiny.target)


def test_verify_is_packed_and_levels_draft_only_their_requests(tiny):
    """The target's verify forward sees ``sum(v_r + 1)`` tokens and draft level ``j`` only the
    requests with ``v_r >= j`` (no draft forward at all when every budget is 0)."""
    worker = make_worker(tiny.target, tiny.draft_noisy)
    seen: dict[str, list[int]] = {"target": [], "draft": []}
    hooks = [m.embed_tokens.register_forward_hook(
        lambda mod, args, out, key=key: seen[key].append(args[0].numel()))
        for key, m in (("target", tiny.target), ("draft", tiny.draft_noisy))]
    checked = []

    def record(dec, v, live):
        levels = [int((v > j).sum()) for j in range(int(v.max()))]
        assert seen["target"][-1] == int((v + 1).sum())  # the verify
        # the draft levels, then the draft extend when a request has tokens to catch up
        # (the first decode's list starts with the drafter's prefill)
        calls = seen["draft"][0 if checked else 1:]
        assert calls[:len(levels)] == levels and len(calls) - len(levels) <= 1
        checked.append(int(v.min()) == 0)
        seen["target"].clear()
        seen["draft"].clear()

    try:
        with torch.inference_mode():
            run_budgets(worker, PROMPTS, GREEDY, record=record)
    finally:
        for h in hooks:
            h.remove()
    assert any(checked)


@pytest.mark.parametrize("name", ["draft", "eagle"])
def test_a_drafter_equal_to_the_target_accepts_every_budget(request, name):
    """Right drafter state after every shortened verify (and after budgets of 0, which draft
    nothing): a drafter reproducing the target accepts all ``v_r`` drafts of every request."""
    models = request.getfixturevalue("tiny" if name == "draft" else "tiny1")
    module = models.draft_same if name == "draft" else models.eagle_same
    worker = make_worker(models.target, module)
    short = []

    def record(dec, v, live):
        short.append((dec.accepted != v).sum())

    with torch.inference_mode():
        run_budgets(worker, PROMPTS, GREEDY, record=record)
    assert sum(short) == 0


def test_seeded_tokens_do_not_depend_on_the_budgets(tiny):
    params = [SamplingParams(temperature=1.0, seed=100 + i) for i in range(len(PROMPTS))]
    runs = []
    for schedule in (budgets_of, lambda it, live, caps: np.minimum(D, caps),
                     lambda it, live, caps: np.zeros(len(live), np.int64)):
        worker = make_worker(tiny.target, tiny.draft_noisy)
        with torch.inference_mode():
            runs.append(run_budgets(worker, PROMPTS, params, budgets=schedule))
    assert runs[0] == runs[1] == runs[2]


def test_packed_indices():
    index, unpack = PackedVerify.indices(i64([2, 0, 3]), 4)
    assert index.tolist() == [0, 1, 2, 4, 8, 9, 10, 11]
    assert unpack.tolist() == [0, 1, 2, 2, 3, 3, 3, 3, 4, 5, 6, 7]


def test_draft_confidence_is_the_probability_of_the_drafted_token():
    class Identity:
        def to_target_logits(self, x):
            return x

        def to_target_ids(self, x):
            return x

    torch.manual_seed(0)
    logits = torch.randn(6, 9)
    conf = torch.zeros(6, 1)
    greedy = BatchSampling.from_params([SamplingParams()] * 6)
    run = DraftRun(Identity(), greedy, None, None, None, conf)
    tok = run.choose(logits, 0, None)
    run.result(1)  # greedy levels' confidences are written for all levels at once here
    soft = torch.softmax(logits, -1)
    assert torch.equal(tok, logits.argmax(-1))
    assert torch.allclose(conf[:, 0], soft.max(-1).values)
    mixed = BatchSampling.from_params([SamplingParams(temperature=0.5)] * 3 +
                                      [SamplingParams()] * 3)
    run = DraftRun(Identity(), mixed, torch.Generator().manual_seed(1), None, None, conf)
    tok = run.choose(logits, 0, None)
    q = run.probs[0]
    assert torch.allclose(conf[:3, 0], q[:3].gather(1, tok[:3, None]).squeeze(1))
    assert torch.allclose(conf[3:, 0], soft[3:].max(-1).values)
    logits[0] = float("-inf")  # a row masked to nothing: no confidence, still a probability
    run = DraftRun(Identity(), greedy, None, None, None, conf)
    run.choose(logits, 0, None)
    run.result(1)
    assert conf[0, 0] == 0 and bool(((conf >= 0) & (conf <= 1)).all())


def test_greedy_confidences_of_all_levels_at_once_equal_per_level(monkeypatch):
    """Greedy levels' confidences, computed for all levels in ``result`` (small logits), equal
    the per-level computation (logits above ``DEFER_CONF_ELEMENTS``), bit for bit, tokens
    too; a level that did not run reads 0."""
    from specdial.worker import draft_run

    class Identity:
        def to_target_logits(self, x):
            return x

        def to_target_ids(self, x):
            return x

    torch.manual_seed(3)
    levels = [torch.randn(4, 11) * 3 for _ in range(3)]
    levels[1][2] = float("-inf")  # a row masked to nothing
    greedy = BatchSampling.from_params([SamplingParams()] * 4)
    outs = []
    for limit in (draft_run.DEFER_CONF_ELEMENTS, 0):
        monkeypatch.setattr(draft_run, "DEFER_CONF_ELEMENTS", limit)
        conf = torch.full((4, 4), 7.0)
        run = DraftRun(Identity(), greedy, None, None, None, conf)
        for i, x in enumerate(levels):
            run.choose(x, i, None)
        assert (len(run.greedy_logits) == 3) == (limit > 0)
        tokens, _ = run.result(4)
        outs.append((tokens, conf))
    (t0, c0), (t1, c1) = outs
    assert torch.equal(t0, t1) and torch.equal(c0, c1)
    assert torch.equal(t0[:, :3], torch.stack([x.argmax(-1) for x in levels], 1))
    want = torch.stack([torch.softmax(x, -1).max(-1).values for x in levels], 1).nan_to_num(0.0)
    assert torch.allclose(c0[:, :3], want) and c0[2, 1] == 0 and bool((c0[:, 3] == 0).all())


def test_a_budget_caps_acceptance_with_the_bonus_token_of_its_column():
    """Rows at budget 0 (drafts offered anyway) accept nothing and emit a draw from ``p_0``
    (not the rejection residual); rows at budget 1 of 2 emit ``p_1`` after an accept."""
    v, rows = 5, 20000
    p_logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.25, 0.15],
                                       [0.3, 0.1, 0.1, 0.2, 0.3],
                                       [0.2, 0.2, 0.2, 0.2, 0.2]]))
    target = p_logits[None].expand(rows, 3, v).contiguous()
    drafts = torch.full((rows, 2), 2, dtype=torch.int64)  # token 2, q one-hot
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0)] * rows)
    limits = torch.zeros(rows, dtype=torch.int64)
    acc, out = speculative_accept(drafts, None, target, sampling, gen(3), limits=limits)
    assert (acc == 0).all()
    assert_fits("budget 0: the bonus of column 0", out[:, 0], p_logits[0].exp())
    acc, out = speculative_accept(drafts, None, target, sampling, gen(4), limits=limits + 1)
    assert (acc <= 1).all()
    assert (acc == 1).sum() > rows // 4
    assert_fits("budget 1: the bonus of column 1", out[acc == 1, 1], p_logits[1].exp())
