"""SGLang and vLLM drop-in parity of the server, end to end with the built-in models behind a
live uvicorn:

- SGLang's ``GET /health_generate``: a one-token generation, 200 once it completes (the
  engine counts a finished request), 503 when the generation fails; vLLM's ``/ping`` answers
  as ``/health``;
- SGLang's ``POST /abort_request`` by ``rid`` (and ``abort_all``): the ``/generate`` request
  with that ``rid`` (streamed or not) ends with SGLang's abort finish reason while the others
  finish normally, and every KV page comes back; a bad body is a 400 naming the field;
- errors about the context name what the user set and sent: with ``kv_cache_tokens`` cutting
  the context, the message names ``kv_cache_tokens`` and the page rounding (not
  ``context_length``, which the user never set); a prompt that only overflows with the default
  ``max_new_tokens`` is a 400 naming the prompt field, not ``sampling_params.max_new_tokens``.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, AsyncIterator

import httpx
import pytest

from specdial.engine.api import RequestError, StreamChunk
from specdial.engine.ends import failed
from specdial.server.config import ServeConfig
from test_server_fake_engine import FakeEngine, LiveServer
from timeouts import scaled


@pytest.fixture(scope="module")
def server():
    cfg = ServeConfig(max_running_requests=4, log_interval_s=0)
    with LiveServer(cfg.build_engine(), name="builtin") as s:
        yield s
        s.engine.shutdown()


def post(server: LiveServer, path: str, body: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=scaled(120))


def _idle(engine: Any) -> None:
    """Wait until the engine holds no request and no KV page (aborts are asynchronous)."""
    deadline = time.monotonic() + scaled(30)
    while True:
        st = engine.stats()
        if not (st.running or st.queued or st.kv_pages_used):
            return
        assert time.monotonic() < deadline, st
        time.sleep(0.01)


LONG = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0.0}


def test_health_generate_runs_one_token(server):
    before = server.engine.stats().requests_finished
    r = httpx.get(server.url + "/health_generate", timeout=scaled(60))
    assert r.status_code == 200 and r.content == b""
    assert server.engine.stats().requests_finished == before + 1
    for method in ("GET", "POST"):
        r = httpx.request(method, server.url + "/ping", timeout=scaled(10))
        assert r.status_code == 200 and r.json() == {"status": "ok"}


class _FailingEngine(FakeEngine):
    """A fake whose every generation ends with the engine's failure finish reason."""

    async def async_stream(self, prompt: str | None = None, **kw: Any
                           ) -> AsyncIterator[StreamChunk]:
        yield StreamChunk(0, "", [], True, failed("a pass raised"))


def test_health_generate_is_503_when_the_generation_fails():
    with LiveServer(_FailingEngine()) as s:
        assert httpx.get(s.url + "/health_generate", timeout=scaled(30)).status_code == 503
        assert httpx.get(s.url + "/health", timeout=scaled(30)).status_code == 200


def test_abort_request_ends_a_streamed_generate_and_frees_its_pages(server):
    other: list[httpx.Response] = []
    t = threading.Thread(target=lambda: other.append(post(server, "/generate", {
        "text": "def f(x):", "rid": "other",
        "sampling_params": {"max_new_tokens": 24, "temperature": 0.0}})))
    events = []
    with httpx.stream("POST", server.url + "/generate", timeout=scaled(120), json={
            "text": "import os\n", "rid": "victim", "stream": True,
            "sampling_params": LONG}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            events.append(json.loads(line[6:]))
            if len(events) == 2:
                t.start()
                assert post(server, "/abort_request", {"rid": "victim"}).status_code == 200
    t.join(scaled(120))
    last = events[-1]["meta_info"]
    assert last["id"] == "victim" and last["finish_reason"]["type"] == "abort", last
    assert "victim" in last["finish_reason"]["message"]
    assert len(events[-1]["output_ids"]) < 400
    done = other[0].json()["meta_info"]
    assert done["finish_reason"] == {"type": "length", "length": 24}, done
    _idle(server.engine)


def test_abort_request_ends_a_whole_generate_and_abort_all(server):
    outs: dict[str, Any] = {}

    def run(rid: str) -> None:
        outs[rid] = post(server, "/generate", {"text": "x = 1\n", "rid": rid,
                                               "sampling_params": LONG})

    threads = [threading.Thread(target=run, args=(rid,)) for rid in ("a1", "a2")]
    for t in threads:
        t.start()
    deadline = time.monotonic() + scaled(60)
    while server.engine.stats().running < 2:  # both decode before they are aborted
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert post(server, "/abort_request", {"rid": "no-such-rid"}).status_code == 200
    assert post(server, "/abort_request", {"abort_all": True}).status_code == 200
    for t in threads:
        t.join(scaled(120))
    for rid in ("a1", "a2"):
        meta = outs[rid].json()["meta_info"]
        assert outs[rid].status_code == 200 and meta["id"] == rid
        assert meta["finish_reason"]["type"] == "abort", meta
    _idle(server.engine)


@pytest.mark.parametrize("body, param", [({"rid": 5}, "rid"), ({}, "rid"),
                                         ({"abort_all": "yes"}, "abort_all")])
def test_abort_request_refuses_a_bad_body_naming_the_field(server, body, param):
    r = post(server, "/abort_request", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.fixture(scope="module")
def small():
    """A server whose context the KV cache cuts: kv_cache_tokens 40 -> 3 pages of 16."""
    cfg = ServeConfig(max_running_requests=2, log_interval_s=0, kv_cache_tokens=40)
    with LiveServer(cfg.build_engine(), name="small") as s:
        yield s
        s.engine.shutdown()


def test_context_errors_name_what_the_user_set_and_sent(small):
    assert small.engine.context_length == 48
    r = post(small, "/generate", {"input_ids": [5] * 60})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "input_ids", err
    assert "kv_cache_tokens=40" in err["message"] and "page_size 16" in err["message"]
    assert "allowed: at most 47 prompt tokens" in err["message"]
    # 20 tokens + the default max_new_tokens 128 overflow: the prompt is what the user sent
    r = post(small, "/generate", {"input_ids": [5] * 20})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "input_ids", err
    assert "default 'sampling_params.max_new_tokens' 128 (not sent)" in err["message"], err
    assert "send 'sampling_params.max_new_tokens' <= 28" in err["message"]
    r = post(small, "/generate", {"text": "hi " * 20})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text", r.text
    r = post(small, "/generate", {"input_ids": [5] * 20,
                                  "sampling_params": {"max_new_tokens": 40}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "sampling_params.max_new_tokens", err
    assert "(allowed: <= 28 for this prompt)" in err["message"], err
    r = post(small, "/generate", {"input_ids": [5] * 20,
                                  "sampling_params": {"max_new_tokens": 28}})
    assert r.status_code == 200, r.text
    with pytest.raises(RequestError, match="kv_cache_tokens=40") as e:
        small.engine.generate(input_ids=[5] * 20, sampling_params={"max_new_tokens": 40})
    assert "context_length" not in str(e.value)
