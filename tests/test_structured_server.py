"""Issue 31 over HTTP on the built-in models: the openai client's structured-output call
(``response_format`` json_schema, ``client.chat.completions.parse`` with a pydantic model),
vLLM's ``guided_choice`` / ``structured_outputs``, SGLang's ``/generate`` with ``json_schema``
and ``regex``, and 400s naming the field for bad or doubled constraints; over chains and over
draft trees."""

from __future__ import annotations

import json
import math
import re

import httpx
import openai
import pydantic
import pytest

from specdial.server.config import ServeConfig
from test_server_fake_engine import LiveServer
from timeouts import scaled

NAME = "builtin"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["chains", "tree"])
def server(request):
    """The server over chains (the default adaptive engine) and over fixed draft trees
    (topk 2, depth 3, 6 nodes)."""
    tree = ({} if request.param == "chains" else dict(
        speculative_adaptive=False, speculative_num_steps=3, speculative_eagle_topk=2,
        speculative_num_draft_tokens=7))
    cfg = ServeConfig(max_running_requests=8, log_interval_s=0, **tree)
    with LiveServer(cfg.build_engine(), name=NAME) as s:
        yield s


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=scaled(120))


class Point(pydantic.BaseModel):
    n: int
    ok: bool


def test_openai_client_structured_call(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        parsed = 0
        for seed in range(8):
            try:
                r = c.chat.completions.parse(
                    model=NAME, messages=[{"role": "user", "content": "a point"}],
                    response_format=Point, max_tokens=120, temperature=1.0, seed=seed)
            except openai.LengthFinishReasonError:  # cut by max_tokens (the model is tiny)
                continue
            assert isinstance(r.choices[0].message.parsed, Point)
            parsed += 1
        assert parsed  # the parse path ran at least once
        r = c.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=60,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}})
        if r.choices[0].finish_reason == "stop":
            json.loads(r.choices[0].message.content)


def test_vllm_guided_fields(server):
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "pick:", "max_tokens": 20,
                                         "temperature": 1.0, "guided_choice": ["red", "green"]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("red", "green")
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "n:", "max_tokens": 20,
                                         "structured_outputs": {"regex": "[0-9]{3}"}})
    assert r.status_code == 200, r.text
    assert re.fullmatch("[0-9]{3}", r.json()["choices"][0]["text"])


def test_sglang_generate_json_schema_and_regex(server):
    r = post(server, "/generate", {"text": "x", "sampling_params": {
        "max_new_tokens": 16, "temperature": 1.0, "regex": "(ab|cd){2}"}})
    assert r.status_code == 200, r.text
    assert re.fullmatch("(ab|cd){2}", r.json()["text"])
    r = post(server, "/generate", {"text": "obj:", "sampling_params": {
        "max_new_tokens": 200, "temperature": 0.0, "json_schema": json.dumps(SCHEMA)}})
    assert r.status_code == 200, r.text
    out = r.json()
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        assert set(json.loads(out["text"])) == {"n", "ok"}


def test_chat_logprobs_under_a_choice_list_only_the_allowed_tokens(server):
    """vLLM's ``guided_choice`` with ``logprobs``: the first token's alternatives are the
    tokens that start a choice (here only "r" and "g"; 2 < top_logprobs) and their
    probabilities sum to 1: the constrained distribution, serialised as finite JSON numbers."""
    r = post(server, "/v1/chat/completions", {
        "model": NAME, "messages": [{"role": "user", "content": "pick"}], "max_tokens": 10,
        "guided_choice": ["red", "green"], "logprobs": True, "top_logprobs": 10})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    first = content[0]["top_logprobs"]
    assert {e["token"] for e in first} <= {"r", "g", "re", "gr", "red", "green", "gre"}
    assert sum(math.exp(e["logprob"]) for e in first) == pytest.approx(1, abs=1e-4)
    assert all(math.isfinite(e["logprob"]) for c in content for e in c["top_logprobs"])

@pytest.mark.parametrize("path, body, param", [
    ("/generate", {"text": "x", "sampling_params": {"regex": "(bad"}}, "regex"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}},
     "regex"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "(bad"}, "guided_regex"),
    # an empty language, and a dead end after 3 letters (a 400 when the output stops there)
    ("/v1/completions", {"prompt": "x", "guided_regex": "[^\\x00-\\U0010FFFF]"},
     "guided_regex"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 8, "logprobs": 2,
                         "guided_regex": "[a-z]{3}[^\\x00-\\U0010FFFF]"}, "guided_regex"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]},
     "guided_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, "response_format.type"),
])
def test_bad_constraints_are_400_naming_the_field(server, path, body, param):
    r = post(server, path, {"model": NAME, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in (err.get("param") or "") or param in err["message"], err


def test_a_request_held_for_its_grammar_is_answered_when_the_server_stops(monkeypatch):
    """SIGTERM while a request's grammar compiles (the compile blocked): the server's graceful
    timeout passes, the request is answered with ``abort`` (no hang), the engine shuts down
    (``drain=False``) and the server stops."""
    import signal
    import threading

    from test_grammar_shutdown import BlockedCompiles, held_spec

    regex = "held-http[0-9]{3}"
    blocked = BlockedCompiles(monkeypatch, regex)
    engine = ServeConfig(max_running_requests=2, log_interval_s=0).build_engine()
    try:
        with LiveServer(engine, name=NAME, shutdown_timeout=0.2) as s:
            got: list = []
            t = threading.Thread(target=lambda: got.append(post(s, "/generate", {
                "text": "x", "sampling_params": {"max_new_tokens": 8, "regex": regex}})))
            t.start()
            held_spec(engine)
            s.server.handle_exit(signal.SIGTERM, None)
            t.join(scaled(30))
            assert not t.is_alive(), "the held request was not answered"
            s.thread.join(scaled(30))
            assert not s.thread.is_alive(), "the server did not stop"
        r = got[0]
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert engine.stats().kv_pages_used == 0
    finally:
        blocked.release.set()
        engine.shutdown(drain=False)
