"""The Engine with CUDA-graph runners (issue 7), on the CPU with emulated graphs
(``cuda_graph_mode="emulate"``: captured once, each replay re-runs the pass into the captured
output tensors, padding included): greedy outputs equal the eager engine's for the draft model,
EAGLE-1 and EAGLE-3 drafters, fixed steps and a switching adaptive run, padded replays, eager
fallbacks above the largest captured size and for sampling drafts, and the options' defaults
and errors; draft trees replay their (N, batch) verify graphs and give target-only greedy
(shape changes between iterations: tests/test_tree_graphs.py)."""

from __future__ import annotations

import pytest

from conftest import PROMPTS
from specdial._core import ConfigError
from specdial.engine import Engine
from specdial.worker import graph_passes
from specdial.worker.graph_tables import default_cuda_graph_bs
from specdial.worker.graph_passes import GraphPasses

KW = dict(max_running_requests=8, kv_cache_tokens=2048, page_size=8, drafter_max_steps=7,
          log_interval_s=None)
GRAPHS = dict(cuda_graph_bs=[1, 2, 4, 8], cuda_graph_mode="emulate")
PROMPTS5 = PROMPTS + [[3, 4, 5, 6, 7], [11, 12]]
NEW = [14, 11, 9, 6, 4]  # the batch shrinks 5 -> 4 -> 3 -> 2 -> 1: padded replays of each size
#: switches quickly: EMA of the last verify, updated every iteration, no warm-up
ADAPTIVE = {"strategy": "ema",
            "1": {"candidate_steps": [0, 1, 3, 7], "ema_alpha": 1.0, "update_interval": 1,
                  "warmup_batches": 0, "down_hysteresis": 0.0},
            "4": {"candidate_steps": [0, 1, 3], "ema_alpha": 1.0, "update_interval": 1,
                  "warmup_batches": 0, "down_hysteresis": 0.0}}


@pytest.fixture(params=["draft", "eagle", "eagle3"])
def models(request):
    """(target, drafter module) with partial acceptance: extends of several lengths run."""
    if request.param == "draft":
        tiny = request.getfixturevalue("tiny")
        return tiny.target, tiny.draft_noisy
    if request.param == "eagle3":
        exact = request.getfixturevalue("exact")
        return exact.target, exact.eagle3_noisy
    tiny1 = request.getfixturevalue("tiny1")
    return tiny1.target, tiny1.eagle_noisy


def run(engine: Engine, prompts=PROMPTS5, new=NEW, **sp):
    try:
        out = engine.generate(input_ids=prompts,
                              sampling_params=[{"temperature": 0.0, "max_new_tokens": n, **sp}
                                               for n in new])
        stats = engine.graph_stats()
        assert engine.stats().kv_pages_used == 0 and engine.scheduler.rows_in_use == 0
    finally:
        engine.shutdown()
    return [o["output_ids"] for o in out], out, stats


def compare(target, drafter, graph_kw=GRAPHS, new=NEW, **spec):
    eager, _, eager_stats = run(Engine.from_modules(target, drafter, **spec, **KW), new=new)
    assert eager_stats == {"replays": {}, "eager": {}, "captured": 0}  # CPU default: no runners
    graphs, out, stats = run(Engine.from_modules(target, drafter, **spec, **graph_kw, **KW),
                             new=new)
    assert graphs == eager
    assert stats["captured"] > 0 and stats["replays"]["verify"] > 0, stats
    return out, stats


@pytest.mark.parametrize("steps", [0, 1, 3, 7])
def test_fixed_steps_graphs_equal_eager(models, steps):
    target, drafter = models
    # steps 0 with the per-iteration extend (the default skips it), so its graph runs too
    _, stats = compare(target, drafter, speculative_adaptive=False, speculative_num_steps=steps,
                       skip_zero_step_draft_extend=steps != 0)
    if steps <= 3:  # (the draft model extends only after accepting all 7: rare here)
        assert stats["replays"]["extend"] > 0
    assert (stats["replays"]["draft"] > 0) == (steps > 0)
    assert not stats["eager"], stats  # every batch (<= 5 requests) had a graph


def test_adaptive_switching_graphs_equal_eager(models):
    target, drafter = models
    # request 0 runs on alone (batch-size slot 1, where steps 7 is a candidate)
    out, stats = compare(target, drafter, new=[40, *NEW[1:]],
                         speculative_adaptive_config=ADAPTIVE, speculative_initial_steps=3)
    hists = [o["meta_info"]["spec_steps_histogram"] for o in out]
    assert len(set().union(*hists)) >= 2, hists  # the policy switched steps
    assert stats["replays"]["draft"] > 0 and stats["replays"]["extend"] > 0


def test_padded_replay_and_pruned_plan(tiny, monkeypatch):
    seen = []
    fill = GraphPasses._fill_verify

    def spy(self, g, input_ids, positions, out_loc, kv, start):
        if input_ids is not None:  # not a capture
            seen.append((len(start), g))
        return fill(self, g, input_ids, positions, out_loc, kv, start)

    monkeypatch.setattr(GraphPasses, "_fill_verify", spy)
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy,
                                 speculative_adaptive_config=ADAPTIVE, speculative_initial_steps=3,
                                 **GRAPHS, **KW)
    plan = engine.worker.capture_plan
    assert plan is not None and plan.pruned
    assert plan.sizes[7] == (2, 1)  # only batch-size slot 1 (sizes 1, 2) can choose 7
    assert plan.sizes[1] == (8, 4, 2, 1)
    run(engine)
    assert (5, 8) in seen and (3, 4) in seen, seen  # 5 requests replay the graph of 8


def test_graph_path_writes_inputs_once(tiny, monkeypatch):
    """The runner prepares the verify and draft inputs in the buffers the graphs read: a
    replay pads their tail but copies none of them again (issue 16)."""
    copies = []
    load = graph_passes._load_into

    def spy(dst, src):
        if src is not None and src.numel() and not (
                src.data_ptr() == dst.data_ptr() and src.shape == dst.shape
                and src.stride() == dst.stride()):
            copies.append(tuple(src.shape))
        return load(dst, src)

    monkeypatch.setattr(graph_passes, "_load_into", spy)
    _, _, stats = run(Engine.from_modules(tiny.target, tiny.draft_noisy,
                                          speculative_adaptive=False, speculative_num_steps=3,
                                          **GRAPHS, **KW))
    assert stats["replays"]["verify"] > 0 and stats["replays"]["draft"] > 0
    assert copies == []


def test_batch_above_largest_graph_falls_back_to_eager(tiny):
    _, stats = compare(tiny.target, tiny.draft_noisy, {**GRAPHS, "cuda_graph_bs": [1, 2]},
                       speculative_adaptive=False, speculative_num_steps=3)
    assert stats["eager"].get("verify:batch_not_captured", 0) > 0, stats
    assert stats["replays"]["verify"] > 0 and stats["replays"]["draft"] > 0


def test_sampling_drafts_fall_back_to_eager(models):
    target, drafter = models
    spec = dict(speculative_adaptive=False, speculative_num_steps=3, seed=7)
    sp = dict(temperature=1.0)
    eager, _, _ = run(Engine.from_modules(target, drafter, **spec, **KW), **sp)
    graphs, _, stats = run(Engine.from_modules(target, drafter, **spec, **GRAPHS, **KW), **sp)
    assert stats["eager"].get("draft:sampling", 0) > 0 and stats["replays"]["verify"] > 0
    assert graphs == eager


def test_options_defaults_and_errors(tiny):
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, cuda_graph_mode="emulate", **KW)
    assert engine.cuda_graph_bs == default_cuda_graph_bs(8) == [1, 2, 4, 8]
    assert engine.worker.capture_plan.graph_bs == (1, 2, 4, 8)
    engine.shutdown()
    for kw in ({}, {"disable_cuda_graph": True, "cuda_graph_mode": "emulate"}):
        engine = Engine.from_modules(tiny.target, tiny.draft_noisy, **kw, **KW)
        assert engine.cuda_graph_bs is None and not engine.worker.graph_runners
        assert all(s.pool is None for s in engine.worker.states.values())
        engine.shutdown()
    engine = Engine.from_modules(tiny.target, cuda_graph_mode="emulate", **KW)  # no drafter
    assert engine.worker.capture_plan.passes(0) == ("verify",)
    engine.shutdown()
    for bad, match in (({"cuda_graph_mode": "cuda"}, "CUDA device"),
                       ({"cuda_graph_mode": "graphs"}, "cuda_graph_mode"),
                       ({"cuda_graph_bs": [0, 2]}, "cuda_graph_bs"),
                       ({"cuda_graph_bs": []}, "cuda_graph_bs"),
                       ({"disable_cuda_graph": "yes"}, "disable_cuda_graph")):
        with pytest.raises(ConfigError, match=match):
            Engine.from_modules(tiny.target, tiny.draft_noisy, **bad, **KW)


@pytest.mark.parametrize("topk, count", [(2, 6), (4, 9)])
def test_fixed_tree_graphs_equal_target_only(models, topk, count):
    """Draft trees (issue 29) through the engine with graphs on: the tree verify replays its
    (N, batch) graph (worker/tree_graphs.py), N padded to the captured one, and greedy output
    is target-only greedy."""
    target, drafter = models
    want, _, _ = run(Engine.from_modules(target, None, **KW))
    graph_kw = dict(cuda_graph_bs=[1, 2, 4, 8, 16], cuda_graph_mode="emulate")
    out, _, stats = run(Engine.from_modules(
        target, drafter, speculative_adaptive=False, speculative_num_steps=3,
        speculative_eagle_topk=topk, speculative_num_draft_tokens=count, **graph_kw, **KW))
    assert out == want
    # token budget 16 x (3 + 1): N 5 is captured up to batch 8, N 8 up to batch 4 (the 5
    # requests' first iterations run eagerly); N padding: tests/test_tree_graphs.py
    assert stats["replays"]["tree_verify"] > 0, stats
    assert set(stats["eager"]) <= {"tree_verify:batch_not_captured"}, stats

