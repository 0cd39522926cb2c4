"""One request never hurts another (issue 25): the engine-level part. Every numeric field is
bounded where it enters (token ids by the vocabulary, huge ints refused, not overflowed); a
request whose sampling options fail when its batch is built fails alone with a typed ``error``
end while the rest of the batch runs on; a loop made to die (the ``Crash`` test hook) fails
its requests and turns ``Engine.failure`` on. Tiny CPU models (tests/conftest.py)."""

from __future__ import annotations

import pytest

from conftest import PROMPTS, VOCAB
from greedy import greedy
from specdial.engine import Engine
from specdial.engine.api import RequestError
from specdial.engine.bounds import MAX_STOP_TOKEN_IDS
from specdial.engine.ends import aborted, end_kind, error_body, failed, shut_down
from specdial.engine.isolation import sampling_isolated
from specdial.engine.loop import Crash
from specdial.worker.sampling import BatchSampling, SamplingParams

KW = dict(max_running_requests=4, kv_cache_tokens=1024, page_size=8)


def test_end_kinds_and_error_body():
    assert end_kind(None) is None
    assert end_kind({"type": "length", "length": 3}) == "finished"
    assert end_kind({"type": "stop", "matched": 2}) == "finished"
    assert end_kind(aborted("x")) == "aborted"
    assert end_kind({"type": "abort", "message": "old"}) == "aborted"
    assert end_kind(shut_down("x")) == "shutdown"
    assert end_kind(failed("boom")) == "failed"
    status, body = error_body(failed("rank 1 died"))
    assert status == 500 and "rank 1 died" in body["error"]["message"]
    assert body["error"]["type"] == "internal_error"
    assert error_body(failed("down", 503))[0] == 503
    status, body = error_body(failed("regex: no continuation", 400))
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("params, param, words", [
    ({"stop_token_ids": [2**63]}, "stop_token_ids", f"[0, {VOCAB})"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids", f"[0, {VOCAB})"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", ">= 0"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids", "at most"),
    ({"top_k": 2**63}, "top_k", "1.."),
    ({"top_k": VOCAB + 1}, "top_k", f"1..{VOCAB}"),
    ({"top_k": -2**63}, "top_k", "-1 or 0"),
    ({"top_p": 10**400}, "top_p", "(0, 1]"),
    ({"temperature": 10**400}, "temperature", "float32"),
    ({"min_p": float("nan")}, "min_p", "[0, 1]"),
    ({"repetition_penalty": 1e308}, "repetition_penalty", "10000"),
    ({"presence_penalty": -1e308}, "presence_penalty", "[-2, 2]"),
    ({"seed": 2**64}, "seed", "2**64 - 1"),
    ({"seed": -1}, "seed", "2**64 - 1"),
    ({"max_new_tokens": 2**63}, "max_new_tokens", "context_length"),
    ({"min_tokens": 2**63}, "min_tokens", "max_new_tokens"),
])
def test_numeric_fields_are_bounded_where_they_enter(tiny, params, param, words):
    with Engine.from_modules(tiny.target, **KW) as engine:
        with pytest.raises(RequestError) as e:
            engine.generate(input_ids=[1, 2, 3], sampling_params=params)
        assert e.value.param == param and words in str(e.value), str(e.value)
        # the loop still serves, and the extreme-but-valid values are served
        ok = engine.generate(input_ids=[1, 2, 3], sampling_params={
            "max_new_tokens": 4, "top_k": VOCAB, "stop_token_ids": [VOCAB - 1],
            "seed": 2**64 - 1, "temperature": 0.5})
        assert ok["meta_info"]["completion_tokens"] >= 1


def test_sampling_isolated_finds_the_culprit_rows():
    def build(params, lens, mins):
        if any(p.top_k == 7 for p in params):
            raise ValueError("top_k 7 cannot be built")
        return [p.top_k for p in params]

    params = [SamplingParams(top_k=k) for k in (3, 7, 5)]
    batch, culprits = sampling_isolated(params, [1, 1, 1], [(), (), ()], build)
    assert batch == [3, -1, 5] and list(culprits) == [1]
    assert "top_k 7" in str(culprits[1])
    assert sampling_isolated(params[:1], [1], [()], build) == ([3], {})

    def combination(params, lens, mins):
        if len(params) > 1:
            raise RuntimeError("only together")
        return params

    with pytest.raises(RuntimeError, match="only together"):
        sampling_isolated(params, [1, 1, 1], [(), (), ()], combination)


def test_a_request_failing_in_its_batch_fails_alone(tiny, monkeypatch):
    """A request whose options pass validation but fail when the batch's tensors are built
    (injected): it ends with ``error``; the three others of its batch give exactly their
    greedy outputs."""
    real = BatchSampling.from_params

    def fragile(params, *args, **kwargs):
        if any(p.top_k == 77 for p in params):
            raise OverflowError("top_k 77 cannot be built (injected)")
        return real(params, *args, **kwargs)

    with Engine.from_modules(tiny.target, **KW) as ref_engine:
        want = [o["output_ids"] for o in ref_engine.generate(
            input_ids=PROMPTS, sampling_params=greedy(12))]
    monkeypatch.setattr(BatchSampling, "from_params", staticmethod(fragile))
    with Engine.from_modules(tiny.target, tiny.draft_noisy, **KW) as engine:
        params = [greedy(12)] * len(PROMPTS) + [
            {"max_new_tokens": 12, "top_k": 77, "temperature": 0.7}]
        out = engine.generate(input_ids=PROMPTS + [PROMPTS[0]], sampling_params=params)
        assert [o["output_ids"] for o in out[:-1]] == want
        reason = out[-1]["meta_info"]["finish_reason"]
        assert end_kind(reason) == "failed" and "top_k 77" in reason["message"], reason
        assert engine.failure is None
        assert engine.stats().kv_pages_used == 0


def test_a_scheduler_error_at_submission_does_not_stop_the_loop(tiny, monkeypatch):
    with Engine.from_modules(tiny.target, **KW) as engine:
        real = engine.scheduler.add_request
        calls = {"n": 0}

        class Sched:
            def __getattr__(self, name):
                return getattr(engine.scheduler, name)

            def add_request(self, *args, **kwargs):
                calls["n"] += 1
                if calls["n"] == 1:
                    raise OverflowError("int too big to convert (injected)")
                return real(*args, **kwargs)

        engine._loop.sched = Sched()
        with pytest.raises(RequestError, match="injected"):
            engine.generate(input_ids=[1, 2], sampling_params=greedy(2))
        out = engine.generate(input_ids=[1, 2], sampling_params=greedy(2))
        assert out["meta_info"]["completion_tokens"] == 2 and engine.failure is None


def test_a_loop_made_to_die_fails_its_requests_and_reports_the_failure(tiny):
    engine = Engine.from_modules(tiny.target, **KW)
    try:
        stream = engine.stream(input_ids=[1, 2, 3], sampling_params=greedy(200, ignore_eos=True))
        first = next(stream)
        assert engine.failure is None
        engine._loop.post(Crash("injected loop death"))
        last = first
        for last in stream:
            pass
        assert last.finished and end_kind(last.finish_reason) == "failed"
        assert "injected loop death" in last.finish_reason["message"]
        assert "injected loop death" in (engine.failure or "")
        with pytest.raises(RuntimeError, match="injected loop death"):
            engine.generate(input_ids=[1, 2], sampling_params=greedy(2))
    finally:
        engine.shutdown(drain=False)
