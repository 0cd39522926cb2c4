"""Issue 30, what users see of the prefix cache on the server (against the fake engine, whose
"cache" reports the longest prefix shared with an earlier prompt in whole pages of
``FAKE_PAGE`` tokens): ``usage.prompt_tokens_details.cached_tokens`` (completions, chat,
streaming usage, ``n`` choices), SGLang's ``meta_info.cached_tokens``, the /metrics counters
and SGLang's ``/flush_cache`` (200 text, 400 while requests are live, ``timeout``)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from specdial.server.flush import FLUSHED
from specdial.server.security import SecurityConfig
from test_server_fake_engine import FAKE_PAGE, FakeEngine, LiveServer
from timeouts import scaled

PROMPT = "the same long system prompt; "  # 29 characters = tokens


def _client(live: LiveServer) -> httpx.Client:
    return httpx.Client(base_url=live.url, timeout=scaled(20))


def _cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_completions_usage_reports_the_cached_prompt_tokens():
    with LiveServer(FakeEngine()) as live, _client(live) as c:
        first = c.post("/v1/completions", json={"prompt": PROMPT + "one", "max_tokens": 3})
        assert first.status_code == 200 and _cached(first.json()) == 0
        second = c.post("/v1/completions", json={"prompt": PROMPT + "two", "max_tokens": 3})
        usage = second.json()["usage"]
        assert usage["prompt_tokens"] == len(PROMPT) + 3
        assert _cached(second.json()) == len(PROMPT) // FAKE_PAGE * FAKE_PAGE > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_n_choices_count_the_cached_tokens_of_the_counted_prompt_only():
    """Usage counts a prompt once for its ``n`` choices; its cached tokens are the first
    choice's, so they never exceed the prompt tokens."""
    with LiveServer(FakeEngine()) as live, _client(live) as c:
        c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        body = c.post("/v1/completions", json={"prompt": PROMPT + "x", "max_tokens": 2,
                                               "n": 3}).json()
        assert body["usage"]["prompt_tokens"] == len(PROMPT) + 1
        assert 0 < _cached(body) <= body["usage"]["prompt_tokens"]


def _events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[5:]) for line in r.text.splitlines()
            if line.startswith("data:") and line[5:].strip() != "[DONE]"]


def test_chat_and_streaming_usage_carry_the_cached_tokens():
    history = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "hi"}]
    with LiveServer(FakeEngine()) as live, _client(live) as c:
        r = c.post("/v1/chat/completions", json={"messages": history, "max_tokens": 4})
        assert r.status_code == 200 and _cached(r.json()) == 0
        turn2 = history + [{"role": "assistant", "content": "abcd"},
                           {"role": "user", "content": "more"}]
        r = c.post("/v1/chat/completions", json={
            "messages": turn2, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}})
        last = _events(r)[-1]
        assert last["choices"] == [] and _cached(last) >= len(PROMPT) // FAKE_PAGE * FAKE_PAGE
        c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        r = c.post("/v1/completions", json={"prompt": PROMPT + "s", "max_tokens": 2,
                                            "stream": True,
                                            "stream_options": {"include_usage": True}})
        assert _cached(_events(r)[-1]) > 0


def test_generate_meta_info_cached_tokens():
    with LiveServer(FakeEngine()) as live, _client(live) as c:
        r = c.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 2}})
        assert r.json()["meta_info"]["cached_tokens"] == 0
        r = c.post("/generate", json={"text": [PROMPT + "a", PROMPT + "b"],
                                      "sampling_params": {"max_new_tokens": 2}})
        assert [o["meta_info"]["cached_tokens"] for o in r.json()] == [
            len(PROMPT) // FAKE_PAGE * FAKE_PAGE] * 2
        r = c.post("/generate", json={"text": PROMPT + "c", "stream": True,
                                      "sampling_params": {"max_new_tokens": 2}})
        assert _events(r)[-1]["meta_info"]["cached_tokens"] > 0


def _metric(text: str, name: str) -> float:
    [value] = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{")]
    return value


def test_metrics_report_hits_queries_hit_rate_and_pages():
    engine = FakeEngine()
    with LiveServer(engine) as live, _client(live) as c:
        text = c.get("/metrics").text
        assert _metric(text, "specdial:cache_hit_rate") == 0.0  # no query yet: 0, not NaN
        for suffix in ("a", "b"):
            c.post("/v1/completions", json={"prompt": PROMPT + suffix, "max_tokens": 2})
        text = c.get("/metrics").text
    hits, queries = len(PROMPT) // FAKE_PAGE * FAKE_PAGE, 2 * (len(PROMPT) + 1)
    assert _metric(text, "specdial:prefix_cache_hits_total") == hits
    assert _metric(text, "specdial:prefix_cache_queries_total") == queries
    assert _metric(text, "specdial:prompt_tokens_total") == queries
    assert abs(_metric(text, "specdial:cache_hit_rate") - hits / queries) < 1e-9
    assert _metric(text, "specdial:prefix_cache_pages") == engine.stats().cached_pages > 0
    with LiveServer(engine) as live, _client(live) as c:
        [info] = c.get("/server_info").json()["internal_states"]
    assert (info["cached_tokens"], info["prompt_tokens"]) == (hits, queries)
    assert info["cache_hit_rate"] == pytest.approx(hits / queries) and info["cached_pages"] > 0


def test_flush_cache_get_and_post_as_sglang_answers():
    engine = FakeEngine()
    with LiveServer(engine) as live, _client(live) as c:
        for method in ("GET", "POST"):
            c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            r = c.request(method, "/flush_cache")
            assert r.status_code == 200 and r.text == FLUSHED
            r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert _cached(r.json()) == 0  # flushed: a miss
        for bad in ("-1", "soon", "nan", "inf"):
            r = c.post("/flush_cache", params={"timeout": bad})
            assert r.status_code == 400 and "timeout" in r.text, bad


def test_flush_cache_is_refused_while_requests_are_live_unless_it_may_wait():
    engine = FakeEngine(delay=scaled(0.05))
    with LiveServer(engine) as live, _client(live) as c:
        started = threading.Event()

        def long_request() -> None:
            with httpx.Client(base_url=live.url, timeout=scaled(30)) as c2:
                with c2.stream("POST", "/v1/completions", json={
                        "prompt": PROMPT, "max_tokens": 12, "stream": True}) as r:
                    for _ in r.iter_lines():
                        started.set()

        t = threading.Thread(target=long_request)
        t.start()
        assert started.wait(scaled(10))
        r = c.post("/flush_cache")
        assert r.status_code == 400 and "running or waiting" in r.text, r.text
        r = c.post("/flush_cache", params={"timeout": str(scaled(30))})  # waits for it
        assert r.status_code == 200 and r.text == FLUSHED
        t.join(scaled(30))


def test_flush_cache_needs_the_api_key_and_an_engine_that_can_flush():
    with LiveServer(FakeEngine(), security=SecurityConfig(api_key="k")) as live, \
            _client(live) as c:
        assert c.post("/flush_cache").status_code == 401
        r = c.post("/flush_cache", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200
    engine = FakeEngine()
    engine.flush_cache = None  # type: ignore[assignment, method-assign]
    with LiveServer(engine) as live, _client(live) as c:
        r = c.get("/flush_cache")
        assert r.status_code == 501 and "no prefix cache" in r.text
