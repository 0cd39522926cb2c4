"""Issue 29, the surface of draft trees: SGLang's ``speculative_eagle_topk`` and
``speculative_num_draft_tokens`` (root included) as Engine options, command-line flags and
``/server_info`` fields, their errors naming the field and the allowed values, the Rust
scheduler's tree plans (``tree_topk``, ``num_draft_tokens`` without the root, ``scratch_loc``,
the tree graph key), and fixed trees run end to end through the tree worker."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specdial import ConfigError, Engine
from specdial._core import Scheduler, SchedulerConfig, validate_draft_tree
from specdial.cli import build_parser
from specdial.cli_serve import _defaults
from specdial.config import EngineConfig
from specdial.server.config import ServeConfig, config_from_args
from specdial.server.flags import resolve_compat
from specdial.server.sglang_api import _draft_tree


def serve_config(*argv: str) -> ServeConfig:
    args = build_parser().parse_args(["serve", *argv])
    return config_from_args(ServeConfig, resolve_compat(args, _defaults(ServeConfig)))


def test_defaults_are_chains_and_a_chain_count_sets_the_steps():
    cfg = EngineConfig()
    assert (cfg.speculative_eagle_topk, cfg.speculative_num_draft_tokens) == (1, None)
    # SGLang's counting: the last token plus 3 drafts
    assert EngineConfig(speculative_num_draft_tokens=4).speculative_num_steps == 3
    assert EngineConfig(speculative_num_steps=3, speculative_num_draft_tokens=4,
                        speculative_eagle_topk=1).speculative_num_steps == 3
    tree = EngineConfig(speculative_num_steps=3, speculative_eagle_topk=4,
                        speculative_num_draft_tokens=9)
    assert (tree.speculative_eagle_topk, tree.speculative_num_draft_tokens) == (4, 9)
    # adaptive without a steps bound: the scheduler checks the policy's largest candidate
    EngineConfig(speculative_eagle_topk=4, speculative_num_draft_tokens=9)


@pytest.mark.parametrize("kwargs, field, allowed", [
    ({"speculative_num_steps": 3, "speculative_num_draft_tokens": 5}, "speculative_num_draft_tokens",
     "speculative_num_steps + 1 = 4"),
    ({"speculative_num_steps": 3, "speculative_eagle_topk": 4}, "speculative_num_draft_tokens",
     "4..=37"),
    ({"speculative_num_steps": 3, "speculative_eagle_topk": 2,
      "speculative_num_draft_tokens": 12}, "speculative_num_draft_tokens", "4..=11"),
    ({"speculative_num_steps": 7, "speculative_eagle_topk": 8,
      "speculative_num_draft_tokens": 66}, "speculative_num_draft_tokens", "8..=65"),
    ({"speculative_num_steps": 0, "speculative_eagle_topk": 2,
      "speculative_num_draft_tokens": 2}, "speculative_eagle_topk", "speculative_num_steps >= 1"),
    ({"speculative_eagle_topk": 0}, "speculative_eagle_topk", ">= 1"),
    ({"speculative_eagle_topk": True}, "speculative_eagle_topk", ">= 1"),
    ({"speculative_num_steps": 3, "speculative_eagle_topk": 65,
      "speculative_num_draft_tokens": 9}, "speculative_eagle_topk", "1..=64"),
    ({"speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens", ">= 1"),
    # fixed steps default to 3: the tree is checked against them
    ({"speculative_adaptive": False, "speculative_eagle_topk": 2,
      "speculative_num_draft_tokens": 3}, "speculative_num_draft_tokens", "4..=11"),
])
def test_bad_tree_options_name_the_field_and_the_allowed_values(kwargs, field, allowed):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kwargs)
    assert str(e.value).startswith(field) and allowed in str(e.value), str(e.value)


def test_the_rust_check_returns_the_tree_without_its_root():
    assert validate_draft_tree(3, 4, 9) == (4, 8)
    assert validate_draft_tree(3, 1, 4) is None and validate_draft_tree(3, 1) is None
    with pytest.raises(ConfigError, match="speculative_num_draft_tokens"):
        validate_draft_tree(3, 4, -1)


def test_sglang_flags_reach_the_engine_options():
    cfg = serve_config("--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
                       "--speculative-num-draft-tokens", "9")
    kw = cfg.engine_kwargs()
    assert (kw["speculative_eagle_topk"], kw["speculative_num_draft_tokens"]) == (4, 9)
    assert cfg.engine_config().speculative_num_draft_tokens == 9
    assert serve_config("--speculative-num-draft-tokens", "4").speculative_num_steps == 3
    bad = serve_config("--speculative-num-steps", "3", "--speculative-num-draft-tokens", "5")
    with pytest.raises(ValueError, match=r"speculative_num_steps \+ 1 = 4"):
        bad.engine_config()
    with pytest.raises(ValueError, match="speculative_num_draft_tokens.*required"):
        serve_config("--speculative-num-steps", "3", "--speculative-eagle-topk", "2"
                     ).engine_config()


def sched(topk: int, count: int | None, steps: int = 3) -> Scheduler:
    return Scheduler(SchedulerConfig(max_running_requests=4, context_length=64, num_pages=64,
                                     page_size=4), speculative_num_steps=steps, adaptive=False,
                     speculative_eagle_topk=topk, speculative_num_draft_tokens=count)


def test_tree_plans_carry_the_shape_and_scratch_slots_the_report_frees():
    s = sched(4, 9)
    assert s.draft_tree == (4, 9)
    for prompt in ([5, 6, 7], [8, 9]):
        s.add_request(prompt, 8)
    plan = s.schedule()
    assert (plan.tree_topk, plan.num_draft_tokens, len(plan.scratch_loc)) == (1, 0, 0)
    s.report([1, 2], [0, 1, 2])
    used = s.stats().kv_pages_used
    plan = s.schedule()
    assert (plan.steps, plan.tree_topk, plan.num_draft_tokens) == (3, 4, 8)
    assert plan.graph_key == (3, 4, 8, 2)
    scratch = np.asarray(plan.scratch_loc)
    assert scratch.dtype == np.int64 and scratch.shape == (16,)
    assert not set(scratch.tolist()) & set(np.asarray(plan.out_loc).tolist())
    assert s.stats().kv_pages_used == used + 2 + 4  # the chains' new pages, 16 scratch slots
    s.report([3, 4], [0, 1, 2], [0, 0])
    assert s.stats().kv_pages_used == used  # the scratch run and rejected slots are back
    # chains: graph key of two, num_draft_tokens = steps, no scratch
    c = sched(1, 4)
    c.add_request([5, 6], 8)
    c.schedule()
    c.report([1], [0, 1])
    plan = c.schedule()
    assert (plan.graph_key, plan.tree_topk, plan.num_draft_tokens, len(plan.scratch_loc)) == (
        (3, 1), 1, 3, 0)


def test_scheduler_tree_errors_are_config_errors():
    with pytest.raises(ConfigError, match="speculative_num_draft_tokens: with speculative_eagle_"):
        sched(1, 5)
    with pytest.raises(ConfigError, match="speculative_eagle_topk"):
        sched(2, 2, steps=0)
    s = sched(2, 5)
    with pytest.raises(ConfigError, match="speculative_num_draft_tokens"):
        s.set_fixed_steps(5)  # 4 nodes cannot reach depth 5
    s.set_draft_tree(1)
    assert s.draft_tree == (1, 4)


def test_server_info_reports_the_tree_options():
    tree = SimpleNamespace(config=EngineConfig(speculative_num_steps=3, speculative_eagle_topk=4,
                                               speculative_num_draft_tokens=9))
    assert _draft_tree(SimpleNamespace(engine=tree, server_args={}), 3) == {
        "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 9}
    chain = SimpleNamespace(config=EngineConfig())
    assert _draft_tree(SimpleNamespace(engine=chain, server_args={}), 2) == {
        "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 3}
    # a front without a config: the server's options
    front = SimpleNamespace(engine=object(), server_args={"speculative_eagle_topk": 2,
                                                          "speculative_num_draft_tokens": 5})
    assert _draft_tree(front, 3)["speculative_num_draft_tokens"] == 5


def test_adaptive_trees_emit_target_only_greedy_and_other_strategies_are_refused(
        tiny, monkeypatch):
    """With adaptation on, the flags bound the trees the goodput policy chooses
    (engine.policy_setup's ``with_tree_bounds``): greedy output identical to target-only, tree
    iterations among the chains (a random drafter: chains accept little, wider trees pay); a
    strategy that chooses no trees, or a tree without a drafter, is refused naming the
    option."""
    import specdial.worker.worker as worker_module

    trees = []
    run = worker_module.run_tree_iteration
    monkeypatch.setattr(worker_module, "run_tree_iteration",
                        lambda *a, **k: trees.append(a[1].tree_topk) or run(*a, **k))
    prompts = [[1, 5, 9, 2], [7, 7, 3], [4, 8, 15, 16, 23, 42], [11]]
    sp = {"temperature": 0.0, "max_new_tokens": 48}
    kw = dict(max_running_requests=4, kv_cache_tokens=2048, page_size=4, log_interval_s=None,
              policy_cache=False)
    ref = Engine.from_modules(tiny.target, None, **kw)
    want = [o["output_ids"] for o in ref.generate(input_ids=prompts, sampling_params=sp)]
    ref.shutdown()
    eng = Engine.from_modules(tiny.target, tiny.draft_random, speculative_eagle_topk=4,
                              speculative_num_draft_tokens=12, **kw)
    try:
        for _ in range(3):
            out = eng.generate(input_ids=prompts, sampling_params=sp)
            assert [o["output_ids"] for o in out] == want
        assert eng.stats().kv_pages_used == 0
    finally:
        eng.shutdown()
    assert trees and set(trees) <= {2, 3, 4}, trees
    with pytest.raises(ConfigError, match="speculative_eagle_topk=4 with adaptive steps needs "
                                          "the goodput strategy"):
        Engine.from_modules(tiny.target, tiny.draft_noisy, speculative_eagle_topk=4,
                            speculative_num_draft_tokens=12,
                            speculative_adaptive_config={"strategy": "ema",
                                                         "candidate_steps": [0, 2, 4]}, **kw)
    # no drafter: plain decoding, steps 0, and a tree needs a depth
    with pytest.raises(ConfigError, match="speculative_eagle_topk: 2 drafts a tree, which needs "
                                          "speculative_num_steps >= 1"):
        Engine.from_modules(tiny.target, None, speculative_adaptive=False,
                            speculative_num_steps=0, speculative_eagle_topk=2,
                            speculative_num_draft_tokens=3, **kw)


@pytest.mark.parametrize("drafter,topk,tokens,steps", [
    ("draft_noisy", 4, 9, 3), ("draft_random", 2, 5, 2), ("eagle_random", 8, 16, 4),
    ("draft_noisy", 3, 3, 2)])
def test_an_engine_with_a_fixed_tree_emits_target_only_greedy(tiny, drafter, topk, tokens, steps):
    """Scheduler tree plans through the tree worker, end to end: greedy output identical to
    target-only, every KV page (scratch included) free afterwards, acceptance counted as a
    chain's (``accepted <= depth``)."""
    prompts = [[1, 5, 9, 2], [7, 7, 3], [4, 8, 15, 16, 23, 42], [11]]
    sp = {"temperature": 0.0, "max_new_tokens": 20}
    kw = dict(max_running_requests=4, kv_cache_tokens=1024, page_size=4, log_interval_s=None)
    ref = Engine.from_modules(tiny.target, None, **kw)
    want = [o["output_ids"] for o in ref.generate(input_ids=prompts, sampling_params=sp)]
    ref.shutdown()
    eng = Engine.from_modules(tiny.target, getattr(tiny, drafter), speculative_adaptive=False,
                              speculative_num_steps=steps, speculative_eagle_topk=topk,
                              speculative_num_draft_tokens=tokens, **kw)
    try:
        out = eng.generate(input_ids=prompts, sampling_params=sp)
        assert [o["output_ids"] for o in out] == want
        stats = eng.stats()
        assert stats.kv_pages_used == 0 and stats.running == 0, stats
        for o in out:
            hist = o["meta_info"]["spec_steps_histogram"]
            assert set(hist) <= {0, steps}, hist
    finally:
        eng.shutdown()
