"""One owner per fact in the engine (issue 27): the core decides every finish (stop strings
included, in ``report``), says which steps start-up profiling can reach, defers the drafter's
prefill and counts its catch-up; the wiring lives in ``engine/build.py``."""

from __future__ import annotations

from typing import Any

import pytest

from greedy import greedy
from specdial._core import AdaptiveConfig, Scheduler, SchedulerConfig
from specdial.engine import Engine
from test_engine_serving import build_text_models

KW = dict(max_running_requests=4, kv_cache_tokens=1024, page_size=8)


class Recording:
    """A scheduler stand-in that forwards every call and records the names and keywords."""

    def __init__(self, sched: Any) -> None:
        self._sched = sched
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._sched, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, kwargs))
            return attr(*args, **kwargs)
        return call


@pytest.fixture(scope="module")
def text_models():
    return build_text_models(noise=0.05)


def test_a_stop_string_finish_is_decided_in_the_report(text_models):
    target, draft, tok = text_models
    engine = Engine.from_modules(target, draft, tok, speculative_adaptive=False,
                                 speculative_num_steps=3, **KW)
    sp = greedy(60, ignore_eos=True)  # the same text twice
    prompt = "def add(a, b):\n    return"
    text = engine.generate(prompt, sp)["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    recording = engine._loop.sched = Recording(engine._loop.sched)
    finished_before = engine.stats().requests_finished
    got = list(engine.stream(prompt, sampling_params=sp, stop=[stop]))
    assert "".join(c.text for c in got) == text[:text.index(stop)]
    assert got[-1].finish_reason == {"type": "stop", "matched": stop}
    names = [name for name, _ in recording.calls]
    assert "finish_request" not in names and "abort" not in names, names
    stopped = [kw["stop_strings"] for name, kw in recording.calls if name == "report"]
    [(rid, keep)] = stopped[-1]  # the last report finished it, keeping `keep` tokens
    assert rid == got[-1].request_id and keep >= 1
    assert got[-1].meta_info["completion_tokens"] == sum(len(c.token_ids) for c in got)
    assert all(ids == [] for ids in stopped[:-1])
    # the snapshot the final chunk followed is the report's own: the finish is in it
    assert engine.stats().requests_finished == finished_before + 1
    engine.shutdown()


def test_stop_strings_are_checked_only_for_requests_with_them(text_models):
    target, draft, tok = text_models
    engine = Engine.from_modules(target, draft, tok, speculative_num_steps=2,
                                 speculative_adaptive=False, **KW)
    recording = engine._loop.sched = Recording(engine._loop.sched)
    out = engine.generate("abc", {"max_new_tokens": 12, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert all(kw.get("stop_strings") == [] for name, kw in recording.calls if name == "report")
    engine.shutdown()


def test_reachable_steps_are_the_cores_routing():
    config = AdaptiveConfig.from_dict({"1": {"candidate_steps": [1, 3]},
                                       "4": {"candidate_steps": [0, 1]}})
    sched = Scheduler(SchedulerConfig(), speculative_num_steps=3, adaptive_config=config,
                      cuda_graph_bs=[1, 2, 8])
    assert sched.reachable_steps(1) == [1, 3]
    assert sched.reachable_steps(3) == [0, 1]  # 3 replays the graph of 8: slot 4
    assert sched.reachable_steps(20) == [0, 1]  # above every graph: eager, slot 4
    with pytest.raises(ValueError, match="batch_size"):
        sched.reachable_steps(0)
    fixed = Scheduler(SchedulerConfig(), speculative_num_steps=2, adaptive=False)
    assert fixed.reachable_steps(4) == []


def test_startup_profiling_times_what_the_core_says_is_reachable(tiny):
    cfg = {"strategy": "goodput", "profile_run_batch_sizes": [1, 2, 3], "profile_run_n_measure": 1,
           "profile_run_n_warmup": 0, "profile_run_seq_len": 8,
           "1": {"candidate_steps": [0, 2]}, "3": {"candidate_steps": [0, 1]}}
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, speculative_adaptive_config=cfg,
                                 **KW)
    want = {(bs, k) for bs in (1, 2, 3) for k in engine.scheduler.reachable_steps(bs)}
    assert want == {(1, 0), (1, 2), (2, 0), (2, 2), (3, 0), (3, 1)}
    assert {(p.batch_size, p.steps) for p in engine.profile_points} == want
    engine.shutdown()


def test_the_drafter_prefill_is_deferred_while_decoding_runs_steps_zero():
    def run(sched: Scheduler, kind: str) -> Any:
        plan = sched.schedule()
        assert plan.kind == kind
        n = plan.sample_first.tolist() if plan.is_prefill else [1] * plan.batch_size
        offsets = [0]
        for c in n:
            offsets.append(offsets[-1] + c)
        sched.report([5] * offsets[-1], offsets)
        return plan

    for skip in (True, False):
        sched = Scheduler(SchedulerConfig(skip_zero_step_draft_extend=skip),
                          speculative_num_steps=0, adaptive=False)
        assert sched.config.skip_zero_step_draft_extend is skip
        sched.add_request([1, 2, 3], 8)
        assert run(sched, "prefill").draft_prefill  # no decode yet
        assert run(sched, "decode").draft_prefill
        sched.add_request([1, 2, 3], 8)
        assert run(sched, "prefill").draft_prefill is not skip


def test_the_engine_reads_its_parts_without_copies(tiny):
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, **KW)
    for name in ("target", "drafter", "scheduler", "worker", "generator", "eos_token_ids",
                 "cuda_graph_bs", "profile_points"):
        assert getattr(engine, name) is getattr(engine._parts, name), name
    assert (engine.context_length, engine.device) == (engine._parts.context_length,
                                                      engine._parts.device)
    with pytest.raises(AttributeError):
        engine.scheduler = None  # read-only: one owner
    engine.shutdown()
    assert engine.worker is None
