"""Issue 30's "done means" through the engine: outputs identical with the prefix cache on and
off (greedy and seeded, hits, partial hits, evictions, preemptions; a draft model and EAGLE
heads), lm-eval's one-context-several-continuations pattern prefilled once, and acceptance
right after a hit equal to acceptance without the cache (same drafts: the drafter's KV and the
EAGLE features come with the cached pages).

Requests run one ``generate`` call after another so later ones hit what earlier ones cached
(multi-turn: a turn resends the conversation with the previous output)."""

from __future__ import annotations

from typing import Any

import pytest

from greedy import greedy
from specdial.engine import Engine

KW = dict(max_running_requests=4, page_size=4, log_interval_s=None)
SYSTEM = list(range(40, 63))  # 23 tokens: 5 full pages, a partial one


def _calls(turn_one: list[int]) -> list[list[list[int]]]:
    """Call after call of prompts: a shared system prompt, a partial-page match, the same
    prompt twice, a batch sharing a prefix, and a second turn built from ``turn_one``."""
    return [[SYSTEM + [1, 2]], [SYSTEM + [3]], [SYSTEM[:9] + [7, 7, 7]], [SYSTEM + [1, 2]],
            [SYSTEM + [5], SYSTEM + [6, 6], SYSTEM[:14] + [9]], [turn_one + [11, 12]]]


#: four prompts that share nothing with SYSTEM or each other (a burst for a small KV cache)
BURST = [[[90 + i] + list(range(1 + 9 * i, 20 + 9 * i)) for i in range(4)]]


def _run(engine: Engine, sampling: dict, burst: bool = False
         ) -> tuple[list[list[int]], list[dict]]:
    first = engine.generate(input_ids=SYSTEM + [1, 2], sampling_params=sampling)
    turn_one = SYSTEM + [1, 2] + first["output_ids"]
    outs, metas = [first["output_ids"]], [first["meta_info"]]
    calls = _calls(turn_one)
    if burst:  # between the hits: evicts the cached pages, preempts, then hits again
        calls = calls[:2] + BURST + calls[2:] + BURST
    for call in calls:
        for o in engine.generate(input_ids=call, sampling_params=sampling):
            outs.append(o["output_ids"])
            metas.append(o["meta_info"])
    return outs, metas


def _both(target, drafter, sampling: dict, burst: bool = False, **kw) -> tuple[tuple, tuple, Any]:
    """(outputs, metas) with the cache on, then off, and the on engine's scheduler stats."""
    got = []
    for on in (True, False):
        engine = Engine.from_modules(target, drafter, enable_prefix_caching=on, **{**KW, **kw})
        try:
            got.append(_run(engine, sampling, burst))
            if on:
                stats = engine.scheduler.stats()
        finally:
            engine.shutdown()
    return got[0], got[1], stats


@pytest.mark.parametrize("drafter", ["draft_noisy", "eagle_random"])
def test_greedy_outputs_identical_with_and_without_the_cache(tiny, drafter):
    on, off, stats = _both(tiny.target, getattr(tiny, drafter), greedy(12),
                           kv_cache_tokens=1024, steps_schedule=[2, 0, 3])
    assert on[0] == off[0]
    cached = [m["cached_tokens"] for m in on[1]]
    # the same prompt (one token left to prefill), a hit ending in a partial page, a partial
    # match (8 of 9 shared tokens: whole pages only), the same prompt again
    assert cached[:5] == [0, 24, 20, 8, 24]
    assert cached[-1] >= 24  # the second turn hits the first turn's prompt and output pages
    assert all(m["cached_tokens"] == 0 for m in off[1])
    assert stats.cached_tokens == sum(cached) and stats.cached_pages > 0


def test_greedy_identical_under_evictions_and_preemptions(tiny):
    # 80 KV tokens for up to 4 running requests of up to 61: cached pages are evicted and
    # requests are preempted; every output is still the one without the cache
    on, off, stats = _both(tiny.target, tiny.draft_noisy, greedy(16), burst=True,
                           kv_cache_tokens=80, context_length=64, steps_schedule=[3])
    assert on[0] == off[0]
    assert stats.preemptions > 0 and stats.evicted_pages > 0


def test_seeded_outputs_identical_with_and_without_the_cache(tiny):
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_new_tokens": 12}
    on, off, _ = _both(tiny.target, tiny.eagle_random, sampling, kv_cache_tokens=1024,
                       steps_schedule=[3, 0, 2])
    assert on[0] == off[0]
    assert sum(m["cached_tokens"] for m in on[1]) > 0


@pytest.mark.parametrize("head", ["eagle_noisy", "draft"])
def test_acceptance_after_a_hit_equals_acceptance_without(tiny, tiny1, head):
    target, drafter = ((tiny1.target, tiny1.eagle_noisy) if head == "eagle_noisy"
                       else (tiny.target, tiny.draft_noisy))
    on, off, _ = _both(target, drafter, greedy(12), kv_cache_tokens=1024, steps_schedule=[3])
    assert on[0] == off[0]
    assert on[1][1]["cached_tokens"] > 0
    for m_on, m_off in zip(on[1], off[1]):
        assert m_on["spec_verify_ct"] == m_off["spec_verify_ct"]
        assert m_on["spec_accept_length"] == m_off["spec_accept_length"]


def test_one_context_several_continuations_prefills_it_once(tiny):
    context = list(range(100, 116))  # 4 pages
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, kv_cache_tokens=1024, **KW)
    try:
        outs = engine.generate(input_ids=[context + [c, c + 1] for c in (1, 3, 5, 7)],
                               sampling_params=greedy(1))
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 16, 16, 16]
        s = engine.stats()
        assert (s.prompt_tokens, s.cached_tokens) == (72, 48)
        assert engine.flush_cache() is True
        assert engine.stats().cached_pages == 0
    finally:
        engine.shutdown()


def test_prompt_logprobs_are_computed_not_cached(tiny):
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, kv_cache_tokens=1024, **KW)
    try:
        plain = engine.generate(input_ids=SYSTEM + [1], sampling_params=greedy(2))
        out = engine.generate(input_ids=SYSTEM + [1], sampling_params=greedy(2),
                              return_logprob=True, logprob_start_len=3)
        lps = out["meta_info"]["input_token_logprobs"]
        assert len(lps) == len(SYSTEM) + 1 - 3 and all(lp[0] is not None for lp in lps)
        assert out["meta_info"]["cached_tokens"] == 0  # positions 2.. are needed: no page
        assert out["output_ids"] == plain["output_ids"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("head", ["eagle_noisy", "draft"])
def test_acceptance_after_a_hit_on_pages_no_drafter_reached(tiny, tiny1, head):
    """Pages cached by a request that decoded plainly (steps 0 with the draft extend skipped,
    its drafter prefill deferred behind an earlier plain decode) are cached without the
    drafter's KV. The next turn, drafting at steps 3, hits them: the plan tells the worker how
    much of the hit carries the drafter's KV (none), its drafter runs over the rest first, and
    its drafts, acceptance and tokens equal those without the cache; a third request hits the
    pages that turn's drafter filled in, with the same acceptance as without the cache."""
    target, drafter = ((tiny1.target, tiny1.eagle_noisy) if head == "eagle_noisy"
                       else (tiny.target, tiny.draft_noisy))

    def run(on: bool) -> list[dict]:
        steps = {"k": 0}
        engine = Engine.from_modules(target, drafter, enable_prefix_caching=on,
                                     kv_cache_tokens=1024, steps_schedule=lambda i, n: steps["k"],
                                     **KW)
        try:
            engine.generate(input_ids=[5, 6, 7], sampling_params=greedy(3))
            first = engine.generate(input_ids=SYSTEM + [1, 2], sampling_params=greedy(12))
            steps["k"] = 3
            turn = SYSTEM + [1, 2] + first["output_ids"]
            return [first] + [engine.generate(input_ids=turn + tail, sampling_params=greedy(12))
                              for tail in ([11, 12], [13])]
        finally:
            engine.shutdown()

    on, off = run(True), run(False)
    assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
    assert on[1]["meta_info"]["cached_tokens"] >= len(SYSTEM) + 2 - 3
    assert on[2]["meta_info"]["cached_tokens"] > on[1]["meta_info"]["cached_tokens"] - 4
    for m_on, m_off in zip(on[1:], off[1:]):
        assert m_on["meta_info"]["spec_verify_ct"] == m_off["meta_info"]["spec_verify_ct"]
        assert m_on["meta_info"]["spec_accept_length"] == m_off["meta_info"]["spec_accept_length"]
