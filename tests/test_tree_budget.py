"""Per-request node budgets of draft trees (issue 29 item 5, worker/tree_budget.py): each
request verifies the nodes whose path confidence reaches the plan's ``min_survival``. The kept
set is ancestor-closed, compaction keeps exactly it, acceptance over the kept subtree equals
acceptance over a tree of only those nodes, and through the worker and the engine: greedy
tokens equal target-only (built-in and random drafters, shape changes), seeded tokens do not
depend on the kept subset, unseeded sampling keeps the target's marginals, the target KV is a
fresh prefill's, and the kept counts reach the report and the trace, which replays."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import PROMPTS
from specdial.worker.batch_sampling import BatchSampling
from specdial.worker.sampling_params import SamplingParams
from specdial.worker.tree import DraftTree, ancestor_mask
from specdial.worker.tree_accept import tree_accept
from specdial.worker.tree_budget import compact_tree, kept_nodes
from specdial.worker.tree_draft import TreeDraft
from specdial.worker.tree_step import TreePlan
from test_tree_step import NEW, SHAPES, assert_target_greedy_and_chain_kv, reference_greedy, run
from tree_helpers import ToyLM, column_logits, draft_tree

V = 12


def toy_tree(shape, rows=6, seed=0):
    """A batch of toy EAGLE-2 trees ``(TreeDraft, target, prev, last)`` of ``(topk, depth, N)``."""
    target = ToyLM(V, seed)
    drafter = ToyLM(V, seed + 1, base=target, noise=0.7)
    g = torch.Generator().manual_seed(seed)
    prev, last = torch.randint(0, V, (rows,), generator=g), torch.randint(0, V, (rows,), generator=g)
    k, d, n = shape
    tree = draft_tree(drafter, prev, last, k, d, n)
    td = TreeDraft(tree, torch.full_like(tree.tokens, -1), tree.scores.exp())
    return td, target, prev, last


def paths(tree, row, nodes):
    """Token paths (root excluded) of ``nodes`` of ``row``."""
    out = []
    for i in nodes:
        p, j = [], int(i)
        while j >= 0:
            p.append(int(tree.tokens[row, j]))
            j = int(tree.parents[row, j])
        out.append(tuple(p[::-1]))
    return out


@pytest.mark.parametrize("shape", [(2, 3, 6), (4, 4, 16), (8, 7, 64), (3, 2, 9)])
@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.9])
def test_kept_nodes_are_ancestor_closed_and_compaction_keeps_exactly_them(shape, quantile):
    """The threshold is a quantile of the batch's path confidences, so every case cuts some
    requests' trees part-way (a fixed threshold kept every node of some shapes: identity)."""
    td, *_ = toy_tree(shape, seed=shape[2])
    tree = td.tree
    ms = float(td.confidence.flatten().quantile(quantile))
    kept = kept_nodes(td.confidence, ms)
    assert bool(((kept.sum(1) > 0) & (kept.sum(1) < tree.num_nodes)).any()), kept.sum(1)
    parent_kept = torch.where(tree.parents < 0, True,
                              kept.gather(1, tree.parents.clamp(min=0)))
    assert bool((~kept | parent_kept).all()), "a kept node's parent is kept"
    count = kept.sum(1)
    width = max(1, int(count.max()))
    small, small_kept = compact_tree(td, kept, width)
    assert small.tree.tokens.shape == (tree.tokens.shape[0], width)
    assert small_kept.sum(1).tolist() == count.tolist()
    assert bool((small.tree.depths.diff(dim=1) >= 0).all()), "depths never decrease"
    assert bool((small.tree.parents < torch.arange(width)).all()), "parents precede children"
    for r in range(tree.tokens.shape[0]):
        n = int(count[r])
        assert paths(small.tree, r, range(n)) == paths(tree, r, kept[r].nonzero().flatten())
        assert torch.equal(small.confidence[r, :n], td.confidence[r][kept[r]])


def test_bad_budgets_are_refused_naming_the_field():
    td, *_ = toy_tree((2, 3, 6))
    with pytest.raises(ValueError, match=r"min_survival must be in \(0, 1\), got 1.0"):
        kept_nodes(td.confidence, 1.0)
    kept = torch.ones_like(td.tree.tokens, dtype=torch.bool)
    with pytest.raises(ValueError, match="width must be in 1..6, got 7"):
        compact_tree(td, kept, 7)
    with pytest.raises(ValueError, match="kept must be"):
        compact_tree(td, kept[:, :3], 3)
    z = np.zeros(2, np.int64)
    with pytest.raises(ValueError, match=r"min_survival must be in \[0, 1\)"):
        TreePlan(z, z, z, np.zeros(8, np.int64), np.zeros(8, np.int64), 3, 2, 4,
                 min_survival=1.5)


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("shape,ms,case", [((2, 3, 6), 0.2, "accepts"),
                                           ((4, 4, 16), 0.05, "accepts"),
                                           ((3, 2, 9), 0.3, "accepts"), ((3, 2, 9), 0.5, "empty")])
def test_acceptance_over_the_kept_subtree_is_a_pruned_trees(shape, ms, seeded, case):
    """Per request (batch 1, so the compacted tree holds exactly the kept nodes): greedy and
    seeded acceptance with the ``kept`` mask over the whole tree equals acceptance over the
    tree of the kept nodes alone; the accepted path never leaves the kept set. Every case cuts
    some request part-way; ``case`` says what else it must exercise: a request that accepted
    drafts, or one that kept no node."""
    td, target, prev, last = toy_tree(shape, rows=8, seed=3)
    kept = kept_nodes(td.confidence, ms)
    counts = kept.sum(1)
    assert bool(((counts > 0) & (counts < shape[2])).any()), counts
    if case == "empty":
        assert bool((counts == 0).any()), counts
    accepted = []
    logits = column_logits(target, td.tree, prev, last)
    params = SamplingParams(temperature=0.8, seed=11) if seeded else SamplingParams()
    s1 = BatchSampling.from_params([params])
    pos = torch.tensor([5])
    for r in range(8):
        sub = _row(td, r)
        acc, path, out = tree_accept(sub.tree, logits[r:r + 1], s1, None, pos,
                                     ancestors=ancestor_mask(sub.tree.parents),
                                     kept=kept[r:r + 1])
        n = int(kept[r].sum())
        accepted.append(int(acc[0]))
        on = path[0, : int(acc[0])]
        assert bool(kept[r][on - 1].all()), "the path stays in the kept subtree"
        if n == 0:
            assert int(acc[0]) == 0
            continue
        small, _ = compact_tree(sub, kept[r:r + 1], n)
        small_logits = column_logits(target, small.tree, prev[r:r + 1], last[r:r + 1])
        acc2, _, out2 = tree_accept(small.tree, small_logits, s1, None, pos)
        assert int(acc2[0]) == int(acc[0])
        assert out2[0, : int(acc[0]) + 1].tolist() == out[0, : int(acc[0]) + 1].tolist()
    if case == "accepts":
        assert max(accepted) > 0, accepted


def _row(td, r):
    """Row ``r`` of ``td`` as a batch of one."""
    t = td.tree
    tree = DraftTree(t.tokens[r:r + 1], t.parents[r:r + 1], t.depths[r:r + 1],
                     t.scores[r:r + 1], depth=t.depth, topk=t.topk)
    return TreeDraft(tree, td.node_fed[r:r + 1], td.confidence[r:r + 1])


@pytest.mark.parametrize("name", ["draft", "eagle", "random"])
def test_worker_trees_with_node_budgets_give_target_greedy_and_chain_kv(request, name, tiny):
    fx = request.getfixturevalue("tiny1") if name == "eagle" else tiny
    target = fx.target
    module = {"draft": "draft_noisy", "eagle": "eagle_noisy", "random": "draft_random"}[name]
    module = getattr(fx, module)
    for ms in (0.02, 0.05, 0.3):
        verified = []
        worker, chain, out, _ = run(target, module, SHAPES, min_survival=ms, verified=verified)
        assert_target_greedy_and_chain_kv(target, worker, chain, out)
        counts = np.concatenate([v for _, v in verified])
        assert all(0 <= v.min() and v.max() <= n for n, v in verified)
        if ms == 0.05:  # the budgets bite part-way: some requests keep some, not all, nodes
            assert any(((v > 0) & (v < n)).any() for n, v in verified), counts


def test_seeded_tokens_do_not_depend_on_the_kept_subset(tiny):
    params = [SamplingParams(temperature=0.9, seed=7, max_new_tokens=64),
              SamplingParams(temperature=1.0, seed=123, presence_penalty=1.5, max_new_tokens=64),
              SamplingParams(temperature=0.7, seed=5, max_new_tokens=64)]
    sampling = BatchSampling.from_params(params, prompt_lens=[len(p) for p in PROMPTS])
    _, _, plain, _ = run(tiny.target, tiny.draft_noisy, None, sampling)
    for ms in (0.05, 0.4):
        verified = []
        _, _, got, _ = run(tiny.target, tiny.draft_noisy, [(2, 3, 4), (4, 3, 8), (3, 4, 12)],
                           sampling, min_survival=ms, verified=verified)
        assert any((v < n).any() for n, v in verified), "the budgets cut some trees"
        for r in range(len(PROMPTS)):
            n = min(len(plain[r]), len(got[r]))
            assert n >= NEW and got[r][:n] == plain[r][:n]


@pytest.mark.parametrize("shape,ms", [((3, 2, 6), 0.2), ((2, 3, 6), 0.4)])
def test_unseeded_sampling_with_node_budgets_keeps_the_target_distribution(shape, ms):
    """Temperature 1, no seed: the 2nd and 3rd tokens of 3000 copies of one prompt follow the
    exact target-only marginals (chi-square, df 7, alpha 1e-3) with a random draft model whose
    trees are cut per request by confidence."""
    from test_engine_sampling import (CRITICAL_DF7_ALPHA_1E3, PROMPT, chi2, exact_marginals,
                                      tiny_model)
    from test_engine_sampling import V as VOCAB

    target, draft = tiny_model(0, layers=2), tiny_model(1, layers=1)
    m2, m3 = exact_marginals(target, {"temperature": 1.0})
    rows = 3000
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0)] * rows)
    torch.manual_seed(5)
    verified = []
    _, _, out, _ = run(target, draft, [shape], sampling, prompts=[PROMPT] * rows, new_tokens=3,
                       min_survival=ms, verified=verified)
    assert any((v < shape[2]).any() and (v > 0).any() for _, v in verified)
    ids = np.array([o[:3] for o in out])
    for col, m in ((1, m2), (2, m3)):
        stat = chi2(np.bincount(ids[:, col], minlength=VOCAB), m)
        assert stat < CRITICAL_DF7_ALPHA_1E3, (col, stat)


NODE_S = 0.0005  # the injected cost's seconds per verify token (tree node or chain position)


def verify_priced_cost(last_tree: dict):
    """The engine test's deterministic cost (the loop's ``decode_seconds`` hook): 20 ms, 0.2 ms
    per draft step and ``NODE_S`` per verify token, the root included: ``steps_per_request + 1``
    per request for a chain, ``1 +`` its kept nodes for a tree (the tree iteration's
    ``verified``, recorded in ``last_tree``; ``plan.num_draft_tokens`` per request where no
    threshold ran). Verify nodes are not free, so ``"auto"`` prices them and cuts the least
    confident ones (with nodes free it never cuts: the threshold is their price)."""
    def cost(plan, measured):
        b = plan.batch_size
        if plan.tree_topk > 1:
            v = last_tree.pop("verified")
            nodes = b * plan.num_draft_tokens if v is None else int(np.sum(v))
        else:
            nodes = int(np.sum(plan.steps_per_request))
        return 0.020 + 0.0002 * plan.steps + NODE_S * (nodes + b)
    return cost


def test_engine_trees_with_per_request_budgets_are_lossless_and_replay(tiny, tmp_path, capsys,
                                                                        monkeypatch):
    """Goodput per-request with trees allowed and ``"min_survival": "auto"``, verify nodes
    priced (:func:`verify_priced_cost`): trees are drafted with node thresholds that cut
    (some requests verify fewer nodes than the tree drafted), greedy output equals target-only,
    every page comes back, and the trace's tree lines carry the kept node counts and replay.
    (A fixed threshold's decision: the Rust test
    ``per_request_budgets_draft_trees_whose_node_counts_the_stop_cuts``.)"""
    import specdial.worker.worker as worker_module
    last_tree: dict = {}
    cuts = []  # per tree iteration that applied a threshold: (N, kept nodes per request)
    run_tree = worker_module.run_tree_iteration

    def recording(*a, **k):
        out = run_tree(*a, **k)
        last_tree["verified"] = out.verified
        if out.verified is not None:
            cuts.append((a[1].num_draft_tokens, out.verified))
        return out
    monkeypatch.setattr(worker_module, "run_tree_iteration", recording)
    from greedy import greedy
    from specdial.cli import main as cli_main
    from specdial.engine import Engine
    from test_engine_greedy import assert_no_leak

    kw = dict(max_running_requests=4, kv_cache_tokens=4096, page_size=8, log_interval_s=None,
              policy_cache=False)
    cfg = {"strategy": "goodput", "verify": "per_request", "min_survival": "auto",
           "1": {"candidate_steps": [0, 1, 2, 3]}}
    with Engine.from_modules(tiny.target, None, **kw) as plain:
        want = [o["output_ids"] for o in plain.generate(input_ids=PROMPTS,
                                                        sampling_params=greedy(32))]
    trace = tmp_path / "trace.jsonl"
    with Engine.from_modules(tiny.target, tiny.draft_random, record_trace=str(trace),
                             speculative_eagle_topk=4, speculative_num_draft_tokens=12,
                             speculative_adaptive_config=cfg, **kw) as engine:
        engine._loop.decode_seconds = verify_priced_cost(last_tree)
        for _ in range(10):  # until thresholds cut
            got = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS,
                                                             sampling_params=greedy(32))]
            assert got == want
            if sum(int((v < n).sum()) for n, v in cuts) >= 4:
                break
        assert_no_leak(engine)
    rows = [json.loads(x) for x in trace.read_text().splitlines()]
    trees = [r for r in rows if "tree_topk" in r]
    assert trees, "per-request budgets draft trees"
    cut = [r for r in trees if "verified" in r]
    assert cut, "auto thresholds ran on trees"
    assert all(0 < r["min_survival"] < 1 for r in cut)
    assert all(len(r["verified"]) == r["batch_size"]
               and all(a <= v <= r["tree_nodes"] for a, v in zip(r["accepted"], r["verified"]))
               for r in cut)
    shrunk = [v for r in cut for v in r["verified"] if v < r["tree_nodes"]]
    assert shrunk, "some requests verified fewer nodes than their tree drafted"
    assert cli_main(["policy", "replay", "--trace", str(trace), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tree_verifies"] == len(trees)
    assert summary["confidence_stop_verifies"] == sum("min_survival" in r for r in rows)


def test_tree_lines_with_kept_node_counts_parse_and_are_bounded_by_tree_nodes():
    """A tree line's ``verified`` are kept nodes: above the depth is fine, above
    ``tree_nodes`` is an error naming the field."""
    from specdial.replay import TraceError, parse_line

    line = {"batch_size": 3, "accepted": [2, 0, 1], "steps": 3, "tree_topk": 4,
            "tree_nodes": 12, "min_survival": 0.25, "verified": [9, 0, 4]}
    v = parse_line(json.dumps(line), "t:1")
    assert v.tree == (4, 12) and v.verified.tolist() == [9, 0, 4] and v.min_survival == 0.25
    with pytest.raises(TraceError, match="verified .* exceeds 12"):
        parse_line(json.dumps({**line, "verified": [13, 0, 4]}), "t:1")
    with pytest.raises(TraceError, match="accepted .* exceeds the verified lengths"):
        parse_line(json.dumps({**line, "verified": [1, 0, 4]}), "t:1")
    # a chain line keeps its bound: the steps
    chain = {k: x for k, x in line.items() if k not in ("tree_topk", "tree_nodes")}
    with pytest.raises(TraceError, match="verified .* exceeds 3"):
        parse_line(json.dumps(chain), "t:1")


def test_graph_replay_keeps_its_node_count_and_the_budget_only_masks_acceptance(tiny):
    """With tree verify graphs (emulated on the CPU) the verify keeps the plan's ``N`` (its
    graph key) and the budgets only mask acceptance: greedy tokens equal the compacted eager
    run's and target-only, the verify replays, and the kept counts are the eager run's."""
    from test_tree_graphs import GRAPH_BS

    shapes = [(2, 3, 4), (4, 3, 8), (3, 4, 12)]
    eager_v, graph_v = [], []
    _, _, want, _ = run(tiny.target, tiny.draft_noisy, shapes, min_survival=0.3,
                        verified=eager_v)
    worker, _, out, _ = run(tiny.target, tiny.draft_noisy, shapes, min_survival=0.3,
                            verified=graph_v, cuda_graph_bs=GRAPH_BS, cuda_graph_mode="emulate",
                            tree_max_num_draft_tokens=16)
    assert out == want
    for r, prompt in enumerate(PROMPTS):
        assert out[r] == reference_greedy(tiny.target, prompt, len(out[r]))
    assert worker.tree_graphs.stats.replays["tree_verify"] > 0
    assert [v.tolist() for _, v in graph_v] == [v.tolist() for _, v in eager_v]
    assert any((v < n).any() for n, v in graph_v)
