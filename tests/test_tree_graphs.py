"""CUDA graphs of the draft-tree verify (issue 29, worker/tree_graphs.py): the capture plan's
pruning, and replay (the CPU's emulated graphs: captured output tensors, re-run bodies) giving
the eager tree iteration's tokens and KV, with per-request N padded to the captured N."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS
from specdial.worker.tree_graphs import tree_capture_plan, tree_node_counts
from test_tree_step import SHAPES, reference_greedy, run

GRAPH_BS = [1, 2, 4, 8, 16]


def test_node_counts_and_the_token_budget_prune_the_keys():
    assert tree_node_counts(64) == (2, 4, 8, 16, 32, 64)
    assert tree_node_counts(40) == (2, 4, 8, 16, 32, 40)
    assert tree_node_counts(2) == (2,)
    with pytest.raises(ValueError, match="max_num_draft_tokens"):
        tree_node_counts(65)
    plan = tree_capture_plan(40, GRAPH_BS, max_steps=7)  # budget 16 * 8 = 128 tokens
    assert plan.sizes == {2: (16, 8, 4, 2, 1), 4: (16, 8, 4, 2, 1), 8: (8, 4, 2, 1),
                          16: (4, 2, 1), 32: (2, 1), 40: (2, 1)}
    for n, gs in plan.sizes.items():
        assert all(g * (n + 1) <= 16 * 8 for g in gs)
    order = plan.order()
    tokens = [g * (n + 1) for n, g in order]
    assert tokens == sorted(tokens, reverse=True) and len(order) == plan.num_graphs
    # a tree bound above what the budget allows at any size captures nothing of that N
    assert 64 not in tree_capture_plan(64, [1, 2], max_steps=3).sizes


@pytest.mark.parametrize("name", ["draft", "eagle"])
def test_replayed_tree_verify_gives_the_eager_tokens_and_kv(request, name):
    fx = request.getfixturevalue("tiny" if name == "draft" else "tiny1")
    module = fx.draft_noisy if name == "draft" else fx.eagle_noisy
    shapes = [SHAPES[-1], *SHAPES[:-1]]  # N 40 first (eager: no graph at batch 3), then N 3..12
    eager, chain_e, out_e, _ = run(fx.target, module, shapes)
    worker, chain, out, _ = run(fx.target, module, shapes, cuda_graph_bs=GRAPH_BS,
                                cuda_graph_mode="emulate", tree_max_num_draft_tokens=40)
    assert out == out_e
    for r, prompt in enumerate(PROMPTS):
        assert out[r] == reference_greedy(fx.target, prompt, len(out[r]))
        slots = torch.tensor(chain[r])
        assert chain[r] == chain_e[r]
        torch.testing.assert_close(worker.kv.k_buffer[:, slots], eager.kv.k_buffer[:, slots],
                                   atol=2e-5, rtol=1e-4)
        if name == "eagle":
            torch.testing.assert_close(worker.hidden[slots], eager.hidden[slots],
                                       atol=2e-5, rtol=1e-4)
    stats = worker.tree_graphs.stats
    # 3 requests: N 3..12 pad to a captured 4, 8 or 16 at batch 4 and replay; N 40 has graphs
    # up to batch 2 only and runs eagerly
    assert stats.replays["tree_verify"] > 0
    assert stats.eager.get("tree_verify:batch_not_captured", 0) > 0
    assert set(stats.eager) == {"tree_verify:batch_not_captured"}
    assert worker.graph_stats()["captured"] >= worker.tree_graphs.plan.num_graphs


def test_padded_nodes_do_not_change_the_real_columns(tiny):
    """One shape (N 3) replayed at the captured N 4, and at N 8 (more padding): the same
    tokens as eager."""
    shapes = [(2, 3, 3)]
    _, _, want, _ = run(tiny.target, tiny.draft_noisy, shapes)
    for bound in (4, 8):
        worker, _, out, _ = run(tiny.target, tiny.draft_noisy, shapes, cuda_graph_bs=[4],
                                cuda_graph_mode="emulate", tree_max_num_draft_tokens=bound)
        assert out == want
        assert worker.tree_graphs.stats.replays["tree_verify"] > 0 and not worker.tree_graphs.stats.eager


def test_a_backend_without_tree_graph_metadata_runs_the_tree_verify_eagerly():
    """flashinfer's static wrapper takes no tree mask: nothing is captured and every tree
    verify runs the eager custom-mask path, counted (its custom mask: tests against the fake
    flashinfer wrapper)."""
    from types import SimpleNamespace

    from specdial.worker.graph_pool import GraphPool
    from specdial.worker.tree_graphs import TreeVerifyGraphs

    graphs = TreeVerifyGraphs(target=None, drafter=None, kv=SimpleNamespace(pad_slot=0),
                              backend=object(), plan=tree_capture_plan(8, [1, 2], 3),
                              pool=GraphPool("cpu", "emulate"), kv_capacity=64)
    assert not graphs.supported and graphs.capture() == 0
    assert graphs.serving_key(4, 1) is None
    assert graphs.stats.eager == {"tree_verify:backend_without_tree_graphs": 1}
