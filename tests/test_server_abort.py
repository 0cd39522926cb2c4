"""SGLang's ``POST /abort_request`` as SGLang's users expect it, end to end with the built-in
models behind a live uvicorn (the basics, a bad body and an unknown rid:
``test_server_sglang_parity.py``):

- an aborted ``/generate`` answers what it generated until the abort: text, ``output_ids``,
  logprobs when asked, ``meta_info.completion_tokens`` equal to the tokens returned, and
  ``finish_reason`` ``{"type": "abort", "message": ...}`` (SGLang's ``FINISH_ABORT``), for a
  non-streamed request, each prompt of a batch, and a stream (whose last event says abort and
  holds every token the engine generated for it);
- an OpenAI completion or chat request that carried SGLang's ``rid`` field is ended by that
  rid (finish reason ``abort``, the text so far, ``usage`` counting it); ``abort_all`` ends
  requests of every route, with or without a rid; a bad ``rid`` is a 400 naming it;
- after the aborts the engine holds no request and no KV page;
- on an engine whose ``async_stream`` takes no ``on_submitted`` (the fake), a stream is
  aborted by the id of its first chunk and its usage counts what it sent.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable

import httpx
import pytest

from specdial.server.config import ServeConfig
from test_server_fake_engine import FakeEngine, LiveServer
from test_server_sglang_parity import _idle, post
from timeouts import scaled

#: Long enough that an abort always lands mid-generation.
LONG = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def server():
    cfg = ServeConfig(max_running_requests=4, log_interval_s=0)
    with LiveServer(cfg.build_engine(), name="builtin") as s:
        yield s
        s.engine.shutdown()


def generated_tokens(server: LiveServer) -> int:
    return int(server.engine.stats().generation_tokens)


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    return t, out


def after_tokens(server: LiveServer, before: int, tokens: int, running: int = 1) -> None:
    """Wait until ``running`` requests decode and ``tokens`` more tokens were generated."""
    deadline = time.monotonic() + scaled(60)
    while server.engine.stats().running < running or generated_tokens(server) < before + tokens:
        assert time.monotonic() < deadline, server.engine.stats()
        time.sleep(0.01)


def check_partial(out: dict[str, Any], rid: str, tok: Any) -> None:
    """An aborted output holds what it generated: tokens, their text, consistent counts."""
    meta = out["meta_info"]
    assert meta["id"] == rid and meta["finish_reason"]["type"] == "abort", meta
    assert 0 < len(out["output_ids"]) < LONG["max_new_tokens"], meta
    assert meta["completion_tokens"] == len(out["output_ids"]), meta
    # its text is theirs: all of it, short only of an incomplete character at the end
    full = tok.decode(out["output_ids"])
    assert full == out["text"] or (full.startswith(out["text"]) and full.endswith("\ufffd")), out


def test_an_aborted_generate_answers_what_it_generated(server):
    before = generated_tokens(server)
    t, res = in_background(lambda: post(server, "/generate", {
        "text": "x = 1\n", "rid": "partial", "return_logprob": True, "sampling_params": LONG}))
    after_tokens(server, before, 8)
    assert post(server, "/abort_request", {"rid": "partial"}).status_code == 200
    t.join(scaled(120))
    assert res[0].status_code == 200, res[0].text
    out = res[0].json()
    check_partial(out, "partial", server.engine.tokenizer)
    assert "partial" in out["meta_info"]["finish_reason"]["message"]
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
    _idle(server.engine)


def test_each_prompt_of_an_aborted_batch_answers_its_own_partial_output(server):
    before = generated_tokens(server)
    t, res = in_background(lambda: post(server, "/generate", {
        "text": ["def f(x):", "import os\n"], "rid": ["b1", "b2"], "sampling_params": LONG}))
    after_tokens(server, before, 16, running=2)
    assert post(server, "/abort_request", {"rid": "b1"}).status_code == 200
    time.sleep(0.05)  # b2 goes on a little
    assert post(server, "/abort_request", {"abort_all": True}).status_code == 200
    t.join(scaled(120))
    outs = res[0].json()
    assert [o["meta_info"]["id"] for o in outs] == ["b1", "b2"]
    for o, rid in zip(outs, ("b1", "b2")):
        check_partial(o, rid, server.engine.tokenizer)
    assert "b1" in outs[0]["meta_info"]["finish_reason"]["message"]
    _idle(server.engine)


def test_an_aborted_stream_ends_with_an_abort_event_holding_every_token(server):
    before = generated_tokens(server)
    events = []
    with httpx.stream("POST", server.url + "/generate", timeout=scaled(120), json={
            "text": "import os\n", "rid": "s1", "stream": True, "sampling_params": LONG}) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                break
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 2:
                    assert post(server, "/abort_request", {"rid": "s1"}).status_code == 200
    _idle(server.engine)
    last = events[-1]
    check_partial(last, "s1", server.engine.tokenizer)
    # every token the engine generated for it reached the client
    assert len(last["output_ids"]) == generated_tokens(server) - before


def _completion(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return post(server, path, {"max_tokens": 400, "ignore_eos": True, "temperature": 0.0,
                               **body})


def test_openai_requests_are_aborted_by_their_rid(server):
    before = generated_tokens(server)
    t1, r1 = in_background(lambda: _completion(server, "/v1/completions", {
        "prompt": "x = 1\n", "rid": "oa-1", "logprobs": 1}))
    t2, r2 = in_background(lambda: _completion(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "rid": "oa-2", "n": 2}))
    after_tokens(server, before, 24, running=3)
    assert post(server, "/abort_request", {"rid": "oa-1"}).status_code == 200
    t1.join(scaled(120))
    assert r1[0].status_code == 200, r1[0].text
    body = r1[0].json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "abort" and choice["text"], body
    n = len(choice["logprobs"]["tokens"])
    assert 0 < n < 400 and body["usage"]["completion_tokens"] == n, body
    assert t2.is_alive()  # the other request goes on
    assert post(server, "/abort_request", {"rid": "oa-2"}).status_code == 200
    t2.join(scaled(120))
    body = r2[0].json()
    assert [c["finish_reason"] for c in body["choices"]] == ["abort", "abort"], body
    assert all(c["message"]["content"] for c in body["choices"]), body
    assert 0 < body["usage"]["completion_tokens"] < 800
    _idle(server.engine)


def test_abort_all_ends_requests_of_every_route(server):
    before = generated_tokens(server)
    t1, r1 = in_background(lambda: _completion(server, "/v1/completions",
                                                {"prompt": "def f(x):"}))
    t2, r2 = in_background(lambda: post(server, "/generate", {
        "text": "import os\n", "sampling_params": LONG}))
    events = []

    def stream() -> None:
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=scaled(120),
                          json={"messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 400, "ignore_eos": True, "temperature": 0.0,
                                "stream": True}) as r:
            events.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))

    t3 = threading.Thread(target=stream)
    t3.start()
    after_tokens(server, before, 24, running=3)
    assert post(server, "/abort_request", {"abort_all": True}).status_code == 200
    for t in (t1, t2, t3):
        t.join(scaled(120))
    assert r1[0].json()["choices"][0]["finish_reason"] == "abort", r1[0].text
    check_partial(r2[0].json(), r2[0].json()["meta_info"]["id"], server.engine.tokenizer)
    assert events[-1] == "[DONE]"
    reasons = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"]]
    assert reasons[-1] == "abort", events[-3:]
    _idle(server.engine)


@pytest.mark.parametrize("rid", ["", 5, ["a"]])
def test_a_bad_openai_rid_is_refused_naming_it(server, rid):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "rid": rid})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text


def test_a_stream_aborted_by_rid_counts_what_it_sent_on_an_engine_without_on_submitted():
    """An engine whose ``async_stream`` takes no ``on_submitted`` (the fake): the stream's
    first chunk names its request id, ``engine.abort`` ends it, and the usage counts every
    token the stream sent."""
    engine = FakeEngine(delay=0.02)
    with LiveServer(engine) as live:
        events = []
        with httpx.stream("POST", live.url + "/v1/completions", timeout=scaled(60), json={
                "prompt": "x", "max_tokens": 100, "rid": "f1", "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) == 2:
                        assert post(live, "/abort_request", {"rid": "f1"}).status_code == 200
    assert engine.aborted == [0]
    text = "".join(c["text"] for e in events for c in e["choices"])
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert reasons == ["abort"] and 0 < len(text) < 100
    assert events[-1]["usage"]["completion_tokens"] == len(text)  # one letter per token


def test_a_running_rid_is_not_taken_by_another_request():
    """A rid names one request at a time (vLLM refuses a running request id too): while a
    request with rid ``dup`` runs, another /generate or OpenAI request naming ``dup`` is a 400
    naming ``rid`` (code ``duplicate_rid``), so one /abort_request cannot end both; once it
    ended, the rid is free again. An empty rid (which /abort_request could never name) is a
    400 naming ``rid``."""
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    with LiveServer(engine) as live:
        try:
            check_rids_while_gated(live, engine, gate)
        finally:
            gate.set()  # a failed check must not leave the gated request holding the server


def check_rids_while_gated(live: LiveServer, engine: FakeEngine, gate: threading.Event) -> None:
    """The checks of the test above, with ``engine`` holding its requests until ``gate``."""
    t, res = in_background(lambda: post(live, "/generate", {
        "text": "x", "rid": "dup", "sampling_params": {"max_new_tokens": 4}}))
    deadline = time.monotonic() + scaled(30)
    while not engine.submitted:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for path, body in [
            ("/generate", {"text": "y", "rid": "dup"}),
            ("/generate", {"text": ["y", "z"], "rid": ["free", "dup"]}),
            ("/v1/completions", {"prompt": "y", "max_tokens": 2, "rid": "dup"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y"}],
                                      "max_tokens": 2, "rid": "dup"})]:
        # a refused request answers at once; one the engine took waits on the gate
        r = httpx.post(live.url + path, json=body, timeout=scaled(10))
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"] if "error" in r.json() else r.json()
        assert "rid" in json.dumps(err) and "dup" in json.dumps(err), (path, r.text)
    r = post(live, "/generate", {"text": "y", "rid": "", "sampling_params": {
        "max_new_tokens": 2}})
    assert r.status_code == 400 and "rid" in r.text, r.text
    assert len(engine.submitted) == 1  # none of the refused requests reached the engine
    gate.set()
    t.join(scaled(60))
    assert res[0].status_code == 200, res[0].text
    r = post(live, "/generate", {"text": "y", "rid": "dup", "sampling_params": {
        "max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == "dup", r.text
