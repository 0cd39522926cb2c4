"""Calibration from draft trees (issue 29 item 5): a tree iteration reports, per request, the
path confidences of the nodes it verified with its accepted path's first
(:func:`~specdial.worker.tree_budget.path_first_confidences`, the report's ``draft_probs``), and
the core's confidence calibration, the one that prices tree nodes for ``"min_survival":
"auto"``, learns from them which nodes of each confidence were accepted
(``ConfidenceModel::observe_nodes``; the Rust tests check the update itself)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import PROMPTS
from specdial._core import CONFIDENCE_BIN_WIDTH, CONFIDENCE_BINS
from specdial.worker.batch_sampling import BatchSampling
from specdial.worker.sampling_params import SamplingParams
from specdial.worker.tree import ancestor_mask
from specdial.worker.tree_accept import tree_accept
from specdial.worker.tree_budget import compact_tree, kept_nodes, path_first_confidences
from test_tree_budget import toy_tree, verify_priced_cost
from tree_helpers import column_logits

BINS, WIDTH = CONFIDENCE_BINS, CONFIDENCE_BIN_WIDTH  # rust/core/src/goodput/confidence.rs


def calibration_bin(c: float) -> int:
    """The calibration bin of cumulative draft probability ``c`` (the core's ``bin``)."""
    return BINS - 1 if not c > 0 else min(int(max(-math.log(c) / WIDTH, 0.0)), BINS - 1)


@pytest.mark.parametrize("compact", [False, True])
def test_path_first_confidences_put_the_accepted_path_first_then_the_kept_nodes(compact):
    td, target, prev, last = toy_tree((3, 4, 12), rows=8, seed=3)
    kept = kept_nodes(td.confidence, 0.05)
    if compact:  # the CPU path: kept nodes first, padded with unkept copies
        td, kept = compact_tree(td, kept, int(kept.sum(1).max()))
    logits = column_logits(target, td.tree, prev, last)
    greedy = BatchSampling.from_params([SamplingParams()] * 8)
    acc, path, _ = tree_accept(td.tree, logits, greedy, None,
                               ancestors=ancestor_mask(td.tree.parents), kept=kept)
    got = path_first_confidences(td, kept, path)
    assert got.shape == td.confidence.shape and int(acc.max()) > 0
    for r in range(8):
        a, n = int(acc[r]), int(kept[r].sum())
        on = path[r, :a] - 1  # nodes of the accepted path, depth order
        assert got[r, :a].tolist() == td.confidence[r, on].tolist()
        rest = [i for i in range(kept.shape[1]) if kept[r, i] and i not in on.tolist()]
        assert got[r, a:n].tolist() == td.confidence[r, rest].tolist()
        assert sorted(got[r].tolist()) == sorted(td.confidence[r].tolist())
    # without a node budget every node is verified: the path first, then node order
    everything = path_first_confidences(td, None, path)
    a = int(acc[0])
    rest = [i for i in range(td.tree.num_nodes) if i not in (path[0, :a] - 1).tolist()]
    assert everything[0, a:].tolist() == td.confidence[0, rest].tolist()


class RecordingScheduler:
    """The engine loop's scheduler, forwarding everything, recording around each tree report
    the calibration counts before and after and what the report carried."""

    def __init__(self, sched, tree_out: dict):
        self._sched, self._tree_out, self.records = sched, tree_out, []

    def __getattr__(self, name):
        return getattr(self._sched, name)

    def report(self, tokens, offsets, accepted=None, **kw):
        tree = self._tree_out.pop("tree", None)
        before = self._sched.goodput_state()["confidence_calibration"] if tree else None
        out = self._sched.report(tokens, offsets, accepted, **kw)
        if tree:
            after = self._sched.goodput_state()["confidence_calibration"]
            self.records.append((np.asarray(before), np.asarray(after), kw["draft_probs"],
                                 kw["verified"], np.asarray(accepted), tree))
        return out


def test_a_tree_iterations_report_reaches_the_calibration(tiny, monkeypatch):
    """Per-request trees with ``"auto"`` thresholds through the engine: around each tree report
    the calibration's counts move by exactly the reported nodes (each in its confidence's bin,
    survived iff among the request's first ``accepted``), on top of one common decay; some
    nodes were accepted and some not, and the thresholds cut."""
    import specdial.worker.worker as worker_module
    from greedy import greedy
    from specdial.engine import Engine

    last_tree: dict = {}
    tree_out: dict = {}
    run_tree = worker_module.run_tree_iteration

    def recording(*a, **k):
        out = run_tree(*a, **k)
        last_tree["verified"] = out.verified
        tree_out["tree"] = a[1].num_draft_tokens
        return out
    monkeypatch.setattr(worker_module, "run_tree_iteration", recording)
    cfg = {"strategy": "goodput", "verify": "per_request", "min_survival": "auto",
           "1": {"candidate_steps": [0, 1, 2, 3]}}
    with Engine.from_modules(tiny.target, tiny.draft_noisy, max_running_requests=4,
                             kv_cache_tokens=4096, page_size=8, log_interval_s=None,
                             policy_cache=False, speculative_eagle_topk=4,
                             speculative_num_draft_tokens=12,
                             speculative_adaptive_config=cfg) as engine:
        engine._loop.decode_seconds = verify_priced_cost(last_tree)
        rec = RecordingScheduler(engine._loop.sched, tree_out)
        engine._loop.sched = rec
        for _ in range(10):
            engine.generate(input_ids=PROMPTS, sampling_params=greedy(32))
            if sum(v is not None for *_, v, _a, _t in rec.records) >= 4:
                break
    assert rec.records, "trees ran"
    accepted_nodes = rejected_nodes = cut = 0
    for before, after, probs, verified, accepted, n in rec.records:
        counts = np.full(len(accepted), n) if verified is None else np.asarray(verified)
        assert len(probs) == counts.sum()
        cut += int((counts < n).sum())
        add = np.zeros((BINS, 2))
        starts = np.concatenate([[0], np.cumsum(counts)])
        for r, a in enumerate(accepted):
            for j, c in enumerate(probs[starts[r]:starts[r + 1]]):
                add[calibration_bin(float(c))] += (1.0, float(j < a))
        accepted_nodes += int(add[:, 1].sum())
        rejected_nodes += int((add[:, 0] - add[:, 1]).sum())
        decayed = after - add
        seen = before[:, 0] > 0
        assert np.allclose(decayed[~seen], 0.0, atol=1e-9)
        ratio = decayed[seen, 0] / before[seen, 0]
        assert np.allclose(ratio, ratio[0], rtol=1e-9, atol=0)
        assert 0.9 < ratio[0] < 1.0
        survived = before[:, 1] > 0
        assert np.allclose(decayed[survived, 1] / before[survived, 1], ratio[0], rtol=1e-9)
        assert np.allclose(decayed[~survived, 1], 0.0, atol=1e-9)
    assert accepted_nodes > 0 and rejected_nodes > 0 and cut > 0, (accepted_nodes,
                                                                   rejected_nodes, cut)

