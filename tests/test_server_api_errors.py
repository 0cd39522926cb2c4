"""The OpenAI-compatible server's answers to malformed and failing requests (with the FAKE
engine behind a live uvicorn, fixtures of test_server_api.py): 400s naming the field, refused
unsupported fields and their neutral values, nulls as defaults, NaN and infinity, lone
surrogates, JSON 404/500, a full queue (503) and a bad prompt in a list."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from test_server_api import (TIMEOUT, client, error_of, live,  # noqa: F401 - fixtures
                             post, wait_for)
from test_server_fake_engine import FakeEngine, LiveServer
from timeouts import scaled

NAME = "specdial-default"


BAD = [
    # (path, body, status, param, code)
    ("/v1/completions", b"{not json", 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "x"}]},
     404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x" * 128}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x" * 100, "max_tokens": 40}, 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 200}]}, 400,
     "messages", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 500}, 400, "max_completion_tokens",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [1, -2, 3]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "n": True}, 400, "n", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, 400, "echo", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, 400, "top_logprobs",
     "unrecognized_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "invalid_value"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", None),
    ("/v1/completions", {}, 400, "prompt", "missing_required_parameter"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"prompt": "x", "stop": 3}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "seed": "1"}, 400, "seed", None),
    ("/v1/completions", {"prompt": "x", "ignore_eos": 1}, 400, "ignore_eos", None),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options", None),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"foo": 1}}, 400,
     "stream_options", None),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": "b b"}]},
     400, "messages[0].name", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400,
     "messages[0].content[0]", "unsupported_content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                              "max_completion_tokens": 3}, 400, "max_completion_tokens", None),
    ("/v1/completions", {"prompt": "x", "foo": 1}, 400, "foo", "unrecognized_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True},
     400, "echo", "unrecognized_parameter"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed", "invalid_value"),  # engine
    # lone surrogates (valid JSON escapes, not encodable text)
    ("/v1/completions", {"prompt": "\ud800abc", "max_tokens": 4}, 400, "prompt",
     "invalid_value"),
    ("/v1/completions", {"prompt": ["ok", "\udfff"]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stop": ["\ud800"]}, 400, "stop", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800abc"}]}, 400,
     "messages[0].content", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {
        "role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, 400,
     "messages[1].content[0]", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role",
     "missing_required_parameter"),
]

UNSUPPORTED = [
    ("/v1/completions", "best_of", 2), ("/v1/completions", "suffix", "x"),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "tool_choice", "auto"),
]


@pytest.mark.parametrize("path, body, status, param, code", BAD)
def test_bad_requests(live, path, body, status, param, code):
    error_of(post(live, path, body), status, param, code)


@pytest.mark.parametrize("path, field, value", UNSUPPORTED)
def test_unsupported_fields_are_refused(live, path, field, value):
    body = {"prompt": "x"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "x"}]}
    err = error_of(post(live, path, {**body, field: value}), 400, field, "unsupported_parameter")
    assert "not supported" in err["message"]


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"n": 1, "echo": False, "best_of": 1, "logprobs": None,
                         "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
                         "suffix": None, "user": "u"}),
    ("/v1/chat/completions", {"n": 1, "logprobs": False, "tools": None,
                              "response_format": {"type": "text"}, "store": False,
                              "presence_penalty": 0.0})])
def test_neutral_values_of_unsupported_fields_are_accepted(live, path, extra):
    body = {"prompt": "x"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "x"}]}
    r = post(live, path, {**body, "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text


def test_openai_client_sees_errors_and_the_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="x", n=2, best_of=3)
    assert client.completions.create(model=NAME, prompt="x", max_tokens=2).choices[0].text == "ab"


def test_lone_surrogates_are_400_and_the_connection_stays_usable(live):
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/completions", content='{"prompt": ["ok", "\\udfff"], "max_tokens": 4}',
                   headers={"Content-Type": "application/json"})
        err = error_of(r, 400, "prompt", "invalid_value")
        assert "'prompt[1]'" in err["message"] and "surrogate" in err["message"]
        body = json.dumps({"messages": [{"role": "user", "content": "\ud800abc"}]})
        err = error_of(c.post("/v1/chat/completions", content=body,
                              headers={"Content-Type": "application/json"}),
                       400, "messages[0].content")
        assert "'messages[0].content'" in err["message"]
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_missing_role_names_the_message():
    from specdial.server.protocol import APIError, parse_request

    with pytest.raises(APIError) as e:
        parse_request(b'{"messages": [{"content": "x"}]}', "chat")
    assert e.value.param == "messages[0].role" and "'messages[0].role'" in e.value.message


class _BrokenTokenizer:
    """Raises for the prompt "boom" (an internal error outside the engine call)."""

    eos_token_id = None
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        if text == "boom":
            raise RuntimeError("tokenizer exploded")
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_unexpected_errors_are_json_500_and_the_connection_stays_usable():
    with LiveServer(FakeEngine(tokenizer=_BrokenTokenizer())) as live:
        with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
            r = c.post("/v1/completions", json={"prompt": "boom"})
            err = error_of(r, 500, None, "internal_error")
            assert err["type"] == "internal_error" and "tokenizer exploded" in err["message"]
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"


def test_queue_full_message_says_retry_later_once():
    from specdial._core import QueueFullError
    from specdial.server.errors import engine_error

    for core in ("queue full: 3 requests (max_queued_requests = 2); retry later",
                 "2 requests already queued"):
        err = engine_error(QueueFullError(core), {})
        assert err.status == 503 and err.code == "queue_full"
        assert err.message.count("retry later") == 1, err.message
        assert err.message.startswith("The server is overloaded (") and err.message.endswith(
            "); retry later")
        assert "max_queued_requests = 2" in err.message or "already queued" in err.message


def test_unknown_route_is_json_404(live):
    r = httpx.get(live.url + "/v2/nothing", timeout=TIMEOUT)
    assert r.status_code == 404 and "error" in r.json()


def test_full_queue_is_503_and_the_server_recovers():
    # the two requests are held running and queued until the 503 is seen (by a delay of 0.4 s
    # before, which a loaded machine's round trip could outlast: the queue had room again)
    gate = threading.Event()
    engine = FakeEngine(max_running=1, max_queued=1, delay=0.02, gate=gate)
    with LiveServer(engine) as live:
        results: list[int] = []

        def slow():
            results.append(post(live, "/v1/completions", {"prompt": "x", "max_tokens": 40}).status_code)

        threads = [threading.Thread(target=slow) for _ in range(2)]
        for t in threads:
            t.start()
        assert wait_for(lambda: len(engine._running) + len(engine._waiting) == 2)
        r = post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        err = error_of(r, 503, None, "queue_full")
        assert r.headers["retry-after"] == "1"
        assert err["message"].count("retry later") == 1, err["message"]
        gate.set()
        for t in threads:
            t.join(scaled(20))
        assert results == [200, 200]
        assert post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_one_bad_prompt_in_a_list_aborts_the_others():
    engine = FakeEngine(max_running=1, max_queued=1, delay=0.01)
    with LiveServer(engine) as live:
        r = post(live, "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 30})
        error_of(r, 503, None, "queue_full")
        assert wait_for(lambda: not engine._running and not engine._waiting)
        assert len(engine.aborted) == 2  # the two admitted ones


# ------------------------------------------------------------------ nulls, NaN
def test_null_means_default(live):
    r = post(live, "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": None,
                                       "stop": None, "temperature": None, "top_p": None,
                                       "seed": None, "user": None, "model": None, "n": None})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc"


@pytest.mark.parametrize("raw, param", [(b'{"prompt": "x", "temperature": NaN}', "temperature"),
                                        (b'{"prompt": "x", "temperature": Infinity}', "temperature"),
                                        (b'{"prompt": "x", "top_p": -Infinity}', "top_p")])
def test_nan_and_infinity_are_refused(live, raw, param):
    err = error_of(post(live, "/v1/completions", raw), 400, param)
    assert "finite" in err["message"]


def test_every_unsupported_field_names_what_to_use_instead():
    from specdial.server.protocol import (INSTEAD, UNSUPPORTED_CHAT_FIELDS,
                                          UNSUPPORTED_COMPLETION_FIELDS)

    assert set(UNSUPPORTED_COMPLETION_FIELDS) | set(UNSUPPORTED_CHAT_FIELDS) == set(INSTEAD)
