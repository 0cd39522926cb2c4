"""Issue 30 end to end: the server over the REAL Engine (tiny random models, the built-in
tokenizer, a drafter) with its prefix cache: the usage's ``cached_tokens`` after a repeated
prompt, ``/generate``'s ``meta_info``, the /metrics counters agreeing with them, greedy outputs
unchanged by a hit, ``/flush_cache`` making the next request a miss, and the cache switched
off (``--disable-radix-cache``) reporting no hit."""

from __future__ import annotations

import httpx
import pytest

from specdial.server.flush import FLUSHED
from test_server_engine import NAME, build, client, dirs, metric  # noqa: F401 - fixture
from test_server_fake_engine import LiveServer
from timeouts import scaled

# 4 pages of 16 tokens or more with the built-in tokenizer
PROMPT = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(8))


def _complete(server, prompt: str, **kw):
    with client(server) as c:
        return c.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                    **kw)


def test_a_repeated_prompt_is_served_from_the_cache_with_the_same_output(dirs):  # noqa: F811
    with LiveServer(build(dirs, "noisy"), name=NAME) as server:
        first = _complete(server, PROMPT)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        second = _complete(server, PROMPT)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert 16 <= cached < second.usage.prompt_tokens and cached % 16 == 0
        assert second.choices[0].text == first.choices[0].text  # greedy: a hit changes nothing
        r = httpx.post(server.url + "/generate", timeout=scaled(60), json={
            "text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert r.json()["meta_info"]["cached_tokens"] == cached
        assert metric(server, "specdial:prefix_cache_hits_total") == 2 * cached
        queries = metric(server, "specdial:prefix_cache_queries_total")
        assert queries == 3 * first.usage.prompt_tokens
        assert metric(server, "specdial:cache_hit_rate") == pytest.approx(2 * cached / queries)
        assert metric(server, "specdial:prefix_cache_pages") >= cached // 16
        r = httpx.post(server.url + "/flush_cache", timeout=scaled(60))
        assert r.status_code == 200 and r.text == FLUSHED
        assert metric(server, "specdial:prefix_cache_pages") == 0
        third = _complete(server, PROMPT)
        assert third.usage.prompt_tokens_details.cached_tokens == 0
        assert third.choices[0].text == first.choices[0].text


def test_the_cache_switched_off_reports_no_hit(dirs):  # noqa: F811
    with LiveServer(build(dirs, "noisy", enable_prefix_caching=False), name=NAME) as server:
        for _ in range(2):
            assert _complete(server, PROMPT).usage.prompt_tokens_details.cached_tokens == 0
        assert metric(server, "specdial:prefix_cache_hits_total") == 0
        assert httpx.get(server.url + "/flush_cache", timeout=scaled(60)).status_code == 200
