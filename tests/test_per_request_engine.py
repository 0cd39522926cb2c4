"""Issue 28 end to end: the ``goodput`` strategy with ``"verify": "per_request"`` decides a
verify budget per request; through the engine (plans -> worker -> report with the drafts'
confidences) greedy output stays identical to target-only for every drafter (docs/design.md
invariant 1), a seeded request's tokens do not depend on its batch (invariant 2), every KV page
comes back (invariant 4), and the verify-length histogram counts each request at its budget."""

from __future__ import annotations

import pytest

from conftest import PROMPTS
from greedy import greedy
from specdial.engine import Engine
from test_engine_greedy import assert_no_leak

KW = dict(max_running_requests=4, kv_cache_tokens=2048, page_size=8)
PER_REQUEST = {"strategy": "goodput", "verify": "per_request",
               "1": {"candidate_steps": [0, 1, 2, 3, 4]}}
N = 24


def outputs(engine: Engine, prompts=PROMPTS, **sp) -> list[list[int]]:
    out = engine.generate(input_ids=prompts, sampling_params={**greedy(N), **sp})
    assert_no_leak(engine)
    return [o["output_ids"] for o in out]


@pytest.mark.parametrize("name", ["draft", "eagle", "eagle3"])
def test_per_request_budgets_keep_greedy_output(request, name):
    fixture, attr = {"draft": ("tiny", "draft_noisy"), "eagle": ("tiny1", "eagle_noisy"),
                     "eagle3": ("exact", "eagle3_noisy")}[name]
    models = request.getfixturevalue(fixture)
    with Engine.from_modules(models.target, None, **KW) as plain:
        want = outputs(plain)
    with Engine.from_modules(models.target, getattr(models, attr),
                             speculative_adaptive_config=PER_REQUEST, **KW) as engine:
        assert outputs(engine) == want
        assert outputs(engine, PROMPTS * 2) == want * 2  # a fuller batch, a warmer policy
        hist = engine.stats().verify_length_histogram
    assert sum(hist.values()) > 0 and max(hist) <= 4


def test_seeded_tokens_do_not_depend_on_the_batch(tiny):
    seeded = {"temperature": 1.0, "seed": 11}
    with Engine.from_modules(tiny.target, tiny.draft_noisy,
                             speculative_adaptive_config=PER_REQUEST, **KW) as engine:
        alone = outputs(engine, PROMPTS[:1], **seeded)[0]
        out = engine.generate(
            input_ids=PROMPTS + [PROMPTS[0]],
            sampling_params=[greedy(N), {**greedy(N), "temperature": 1.0},
                             {**greedy(N), "temperature": 0.7}, {**greedy(N), **seeded}])
        assert_no_leak(engine)
    assert out[3]["output_ids"] == alone
