"""Issue 30's interface (the names the server side codes against): the scheduler's and the
engine's prefix-cache switch, ``flush_cache`` (SGLang's rule: refused while requests are live),
``cached_tokens`` per request and the cache counters in the stats."""

from __future__ import annotations

import numpy as np

from greedy import greedy
from specdial import SchedulerConfig
from specdial._core import Scheduler
from specdial.config import EngineConfig
from specdial.engine import Engine

KW = dict(max_running_requests=4, kv_cache_tokens=1024, page_size=8, log_interval_s=None)


def test_config_switch_defaults():
    assert SchedulerConfig().enable_prefix_caching is False
    assert SchedulerConfig(enable_prefix_caching=True).enable_prefix_caching is True
    assert EngineConfig().enable_prefix_caching is True  # SGLang's and vLLM's default


def test_scheduler_flush_refused_while_requests_are_live():
    sched = Scheduler(SchedulerConfig(enable_prefix_caching=True), speculative_num_steps=0,
                      adaptive=False)
    assert sched.flush_cache() is True
    rid = sched.add_request(np.arange(1, 9, dtype=np.int64), 2)
    assert sched.flush_cache() is False  # waiting
    sched.schedule()
    assert sched.flush_cache() is False  # a plan in flight
    sched.abort(rid)
    assert sched.flush_cache() is False  # the plan is still in flight
    sched.abandon_plan()
    assert sched.flush_cache() is True
    s = sched.stats()
    assert {"cached_pages", "cached_tokens", "prompt_tokens"} <= set(s.as_dict())


def test_engine_flush_cache_stats_and_meta(tiny):
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, **KW)
    try:
        assert engine.flush_cache() is True  # before the loop ran: idle
        out = engine.generate(input_ids=[5, 6, 7, 8, 9], sampling_params=greedy(3))
        assert out["meta_info"]["cached_tokens"] == 0
        assert out["meta_info"]["prompt_tokens"] == 5
        s = engine.stats()
        assert s.prompt_tokens == 5 and s.cached_tokens == 0 and s.cached_pages >= 0
        assert engine.flush_cache() is True
    finally:
        engine.shutdown()


def test_profiling_leaves_neither_cached_pages_nor_prompt_tokens(tiny):
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, steps_schedule=[2], **KW)
    try:
        engine.profile_costs([2], [2], n_warmup=1, n_measure=1, seq_len=16)
        assert engine.scheduler.stats().cached_pages == 0
        engine.generate(input_ids=[5, 6, 7], sampling_params=greedy(2))
        assert engine.stats().prompt_tokens == 3  # submitted requests only
    finally:
        engine.shutdown()
