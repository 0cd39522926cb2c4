"""Issue 28's visibility and workload: the per-request verify-length histogram (engine stats,
``/metrics``, ``specdial generate``'s statistics, the bench summary and report) and the
``mixed-batch`` bench workload (greedy code and temperature-1.0 prose interleaved). Draft
trees' verified nodes (issue 29) have a histogram of their own on every one of those paths: a
node count is no verify length, and the two are never added together."""

from __future__ import annotations

import numpy as np
from prometheus_client import generate_latest
from prometheus_client.core import CollectorRegistry

from conftest import PROMPTS
from specdial.bench.datasets import build_requests
from specdial.bench.driver import _params_of
from specdial.bench.http_driver import prometheus_snapshot
from specdial.bench.metrics import RunData, snapshot, summarize
from specdial.engine import Engine
from specdial.engine.api import EngineStats
from specdial.engine.loop_stats import VerifyLengths
from specdial.generate_cmd import format_generation


def test_verify_lengths_count_each_request_at_its_own_budget():
    h = VerifyLengths()
    assert h.as_dict() == {}
    h.add(np.array([0, 3, 3, 1]))
    h.add(np.array([5]))
    assert h.as_dict() == {0: 1, 1: 1, 3: 2, 5: 1}


def test_engine_stats_carry_the_histogram_of_the_plans(tiny):
    """Fixed steps 3, 3 prompts, 6 tokens each: every request verifies 3 drafts per decode
    until its end caps it (steps_per_request of the plans)."""
    with Engine.from_modules(tiny.target, tiny.draft_noisy, max_running_requests=4,
                             kv_cache_tokens=1024, page_size=8, speculative_num_steps=3,
                             speculative_adaptive=False) as engine:
        out = engine.generate(input_ids=PROMPTS, sampling_params={
            "max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True})
        hist = engine.stats().verify_length_histogram
    verifies = sum(o["meta_info"]["spec_verify_ct"] for o in out)
    assert sum(hist.values()) == verifies
    assert max(hist) == 3 and all(0 <= v <= 3 for v in hist)


def test_tree_iterations_count_nodes_in_their_own_histogram(tiny):
    """Fixed trees (depth 3, top-k 4, N = 8 nodes): every decode iteration is a tree's, so the
    chains' verify lengths stay empty and each request-iteration is counted at its 8 nodes
    (no node budget), which no verify length of depth 3 could be."""
    with Engine.from_modules(tiny.target, tiny.draft_noisy, max_running_requests=4,
                             kv_cache_tokens=2048, page_size=8, speculative_num_steps=3,
                             speculative_eagle_topk=4, speculative_num_draft_tokens=9,
                             speculative_adaptive=False) as engine:
        out = engine.generate(input_ids=PROMPTS, sampling_params={
            "max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True})
        s = engine.stats()
    verifies = sum(o["meta_info"]["spec_verify_ct"] for o in out)
    assert s.verify_length_histogram == {}
    assert s.tree_node_histogram == {8: verifies}


def test_metrics_and_reports_show_the_histogram():
    from specdial.server.metrics import EngineCollector

    class FakeEngine:
        def stats(self):
            return EngineStats(verify_length_histogram={0: 4, 2: 7})

    reg = CollectorRegistry()
    reg.register(EngineCollector(FakeEngine()))
    text = generate_latest(reg).decode()
    assert 'specdial:spec_decode_verify_length_total{verify_length="0"} 4.0' in text
    assert 'specdial:spec_decode_verify_length_total{verify_length="2"} 7.0' in text
    assert prometheus_snapshot(text)["verify_length_histogram"] == {0: 4, 2: 7}  # bench http
    report = {"meta_info": {"completion_tokens": 3}, "seconds": 1.0,
              "speculative_algorithm": "EAGLE", "verify_lengths": {0: 2, 4: 5}}
    assert "verify lengths     0: 2, 4: 5" in format_generation(report)
    first = snapshot(EngineStats(verify_length_histogram={1: 2}), 0.0)
    last = snapshot(snapshot(EngineStats(verify_length_histogram={1: 5, 3: 4}), 0.0), 1.0)
    s = summarize([RunData([], 1.0, [first, last])])
    assert s["verify_length_histogram"] == {1: 3, 3: 4}
    assert s["tree_node_histogram"] == {}  # no tree iterations


def test_metrics_and_reports_show_the_tree_nodes_apart():
    from specdial.server.metrics import EngineCollector

    class FakeEngine:
        def stats(self):
            return EngineStats(verify_length_histogram={2: 7}, tree_node_histogram={0: 1, 9: 5})

    reg = CollectorRegistry()
    reg.register(EngineCollector(FakeEngine()))
    text = generate_latest(reg).decode()
    assert 'specdial:spec_decode_tree_nodes_total{tree_nodes="9"} 5.0' in text
    assert 'specdial:spec_decode_tree_nodes_total{tree_nodes="0"} 1.0' in text
    assert 'verify_length="9"' not in text and 'tree_nodes="2"' not in text
    snap = prometheus_snapshot(text)
    assert (snap["verify_length_histogram"], snap["tree_node_histogram"]) == ({2: 7}, {0: 1, 9: 5})
    report = {"meta_info": {"completion_tokens": 3}, "seconds": 1.0,
              "speculative_algorithm": "EAGLE", "verify_lengths": {2: 1},
              "tree_nodes": {5: 2, 12: 3}}
    text = format_generation(report)
    assert "verify lengths     2: 1 " in text and "tree nodes         5: 2, 12: 3 " in text
    first = snapshot(EngineStats(tree_node_histogram={8: 2}), 0.0)
    last = snapshot(EngineStats(tree_node_histogram={8: 5, 3: 4}, verify_length_histogram={1: 1}),
                    1.0)
    s = summarize([RunData([], 1.0, [first, last])])
    assert (s["tree_node_histogram"], s["verify_length_histogram"]) == ({3: 4, 8: 3}, {1: 1})


def test_mixed_batch_interleaves_greedy_code_and_sampled_prose():
    reqs = build_requests("mixed-batch", 6)
    assert [r.workload for r in reqs] == ["code", "prose"] * 3
    assert [r.temperature for r in reqs] == [0.0, 1.0] * 3
    run = {"max_new_tokens": 8, "temperature": 0.0}
    assert _params_of(reqs[1], run) == {"max_new_tokens": 8, "temperature": 1.0}
    assert _params_of(build_requests("code", 1)[0], run) is run


def test_stats_follow_every_snapshot_and_a_snapshot_does_not_move(tiny):
    """The loop keeps each iteration's stats inputs and ``stats()`` builds the snapshot
    (cached per snapshot): a read after more work sees the newer counts, never the cached
    older build, and a snapshot's histogram is a copy the later iterations leave alone."""
    with Engine.from_modules(tiny.target, tiny.draft_noisy, max_running_requests=4,
                             kv_cache_tokens=1024, page_size=8, speculative_num_steps=3,
                             speculative_adaptive=False) as engine:
        sp = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        engine.generate(input_ids=PROMPTS[:1], sampling_params=sp)
        first = engine.stats()
        assert engine.stats() == first  # the same snapshot, built once
        held = engine._loop._stats  # the inputs the loop kept for it
        engine.generate(input_ids=PROMPTS[:1], sampling_params=sp)
        second = engine.stats()
    assert second.generation_tokens == first.generation_tokens + 6
    assert sum(second.verify_length_histogram.values()) > sum(
        first.verify_length_histogram.values())
    # the first snapshot's histogram copy did not grow with the second request's iterations
    assert held[1]["verify_lengths"].as_dict() == first.verify_length_histogram
