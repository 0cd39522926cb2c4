"""The OpenAI-compatible server against a live uvicorn on 127.0.0.1, with the FAKE engine of
test_server_fake_engine.py (no models): the official ``openai`` client for completions, chat,
streaming and concurrency; ``httpx`` for malformed requests, errors, disconnects, metrics and
shutdown. The real-Engine end-to-end tests are in test_server_engine.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from specdial.server.chat import simple_chat_prompt
from test_server_fake_engine import FakeEngine, LiveServer
from timeouts import scaled

NAME = "specdial-default"
TIMEOUT = httpx.Timeout(scaled(20.0))


@pytest.fixture(scope="module")
def live():
    engine = FakeEngine(context_length=128, max_running=8, max_queued=64, delay=0.001)
    with LiveServer(engine) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                       timeout=scaled(20.0)) as c:
        yield c


def post(live, path, body, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(live.url + path, content=data, timeout=TIMEOUT,
                      headers={"Content-Type": "application/json"}, **kw)


def wait_for(predicate, timeout=scaled(10.0)):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# ------------------------------------------------------------------ happy paths (openai client)
def test_completion(client, live):
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=7, temperature=0)
    assert r.object == "text_completion" and r.model == NAME and r.id.startswith("cmpl-")
    assert [c.text for c in r.choices] == ["abcdefg"]
    assert r.choices[0].finish_reason == "length" and r.choices[0].index == 0
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 7, 12)
    # the server tokenized the prompt and sent token ids with the OpenAI -> engine mapping
    sub = live.engine.submitted[max(live.engine.submitted)]
    assert sub["input_ids"] == [ord(c) for c in "Hello"]
    assert sub["sampling_params"]["max_new_tokens"] == 7
    assert sub["sampling_params"]["temperature"] == 0


def test_completion_defaults_seed_and_user(client, live):
    r = client.completions.create(model=NAME, prompt="x", seed=3, top_p=0.5, user="someone")
    assert r.choices[0].text == "defghijklmnopqrs"  # OpenAI's default max_tokens: 16
    # temperature unset: left to the engine's sampling defaults (1.0 unless the model says)
    p = live.engine.submitted[max(live.engine.submitted)]["received"]
    assert p == {"max_new_tokens": 16, "top_p": 0.5, "seed": 3}


def test_completion_list_of_prompts_gives_one_choice_each(client):
    r = client.completions.create(model=NAME, prompt=["a", "bb", "ccc"], max_tokens=3,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == ["abc"] * 3
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (6, 9)


def test_stop_strings(client):
    r = client.completions.create(model=NAME, prompt="x", max_tokens=20, stop=["e", "zz"],
                                  temperature=0)
    assert r.choices[0].text == "abcd" and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=NAME, prompt="x", max_tokens=20, stop="c")
    assert r.choices[0].text == "ab"


def test_chat_uses_the_simple_template(client, live):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                             {"type": "text", "text": "!"}]}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4,
                                       temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == "abcd"
    assert r.choices[0].finish_reason == "length"
    expected = "<|system|>\nBe brief.\n<|user|>\nHi!\n<|assistant|>\n"
    assert simple_chat_prompt([{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hi!"}]) == expected
    sub = live.engine.submitted[max(live.engine.submitted)]
    assert sub["input_ids"] == [ord(c) for c in expected]
    assert r.usage.prompt_tokens == len(expected) and r.usage.completion_tokens == 4


def test_chat_default_max_tokens_is_the_rest_of_the_context(client, live):
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=None)
    prompt = len(simple_chat_prompt([{"role": "user", "content": "x"}]))
    assert r.usage.completion_tokens == 128 - prompt
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=2)
    assert r.choices[0].message.content == "ab"


def test_streaming_completion_with_usage(client):
    full = client.completions.create(model=NAME, prompt="Hello", max_tokens=9, temperature=0)
    chunks = list(client.completions.create(model=NAME, prompt="Hello", max_tokens=9,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text == "abcdefghi"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.total_tokens == 14
    # without include_usage: no usage chunk
    chunks = list(client.completions.create(model=NAME, prompt="Hello", max_tokens=3,
                                            stream=True))
    assert all(c.choices and c.usage is None for c in chunks)


def test_streaming_list_of_prompts(client):
    chunks = list(client.completions.create(model=NAME, prompt=["a", "b"], max_tokens=5,
                                            stream=True))
    by_index = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            by_index[ch.index] += ch.text
    assert by_index == {0: "abcde", 1: "abcde"}


def test_streaming_chat(client):
    stream = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "abcdef"
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert chunks[-1].usage.completion_tokens == 6


def test_sse_wire_format_ends_with_done(live):
    with httpx.stream("POST", live.url + "/v1/completions", timeout=TIMEOUT,
                      json={"prompt": "x", "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_32_concurrent_requests_all_complete(live):
    async def main():
        async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused",
                                      max_retries=0, timeout=scaled(30.0)) as c:
            async def one(i):
                if i % 2:
                    r = await c.completions.create(model=NAME, prompt=f"p{i}", max_tokens=8 + i,
                                                   temperature=0)
                    return r.choices[0].text
                stream = await c.chat.completions.create(
                    model=NAME, messages=[{"role": "user", "content": f"q{i}"}],
                    max_tokens=8 + i, stream=True)
                return "".join([ch.choices[0].delta.content or "" async for ch in stream
                                if ch.choices])
            return await asyncio.gather(*(one(i) for i in range(32)))

    texts = asyncio.run(main())
    expected = [("abcdefghijklmnopqrstuvwxyz" * 2)[:8 + i] for i in range(32)]
    assert texts == expected


def test_models_health(client, live):
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    r = httpx.get(live.url + "/health", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_metrics(live, client):
    client.completions.create(model=NAME, prompt="m", max_tokens=5)
    r = httpx.get(live.url + "/metrics", timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("specdial:spec_decode_num_drafts_total",
                 "specdial:spec_decode_num_draft_tokens_total",
                 "specdial:spec_decode_num_accepted_tokens_total",
                 'specdial:spec_decode_num_accepted_tokens_per_pos_total{model_name="specdial-default",position="0"}',
                 'specdial:spec_decode_num_steps{model_name="specdial-default",slot="1"} 3.0',
                 'specdial:spec_decode_num_steps{model_name="specdial-default",slot="8"} 0.0',
                 "specdial:num_requests_running", "specdial:num_requests_waiting",
                 "specdial:kv_cache_usage_perc", "specdial:spec_decode_step_switches_total",
                 "specdial:num_preemptions_total", "specdial:num_requests_finished_total",
                 "specdial:prompt_tokens_total", "specdial:generation_tokens_total",
                 'specdial:request_success_total{finished_reason="length",model_name="specdial-default"}',
                 "specdial:request_queue_time_seconds_bucket",
                 "specdial:inter_token_latency_seconds_count",
                 "specdial:time_to_first_token_seconds_bucket",
                 "specdial:time_per_output_token_seconds_count",
                 "specdial:e2e_request_latency_seconds_sum"):
        assert name in text, name
    ttft = [line for line in text.splitlines()
            if line.startswith("specdial:time_to_first_token_seconds_count")]
    assert float(ttft[0].split()[-1]) >= 1
    # counters are the engine's cumulative totals
    stats = live.engine.stats()
    assert (f"specdial:spec_decode_num_drafts_total{{model_name=\"{NAME}\"}} "
            f"{float(stats.num_drafts)}") in text


def test_two_apps_in_one_process_have_separate_registries():
    from specdial.server.app import create_app

    a, b = FakeEngine(), FakeEngine()
    apps = [create_app(a), create_app(b)]
    a._counts["num_drafts"] = 7
    texts = [app.state.specdial.metrics.render().decode() for app in apps]
    label = '{model_name="specdial-default"}'
    assert f"specdial:spec_decode_num_drafts_total{label} 7.0" in texts[0]
    assert f"specdial:spec_decode_num_drafts_total{label} 0.0" in texts[1]


# ------------------------------------------------------------------ errors
def error_of(r, status, param, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


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
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": "bob"}]},
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


# ------------------------------------------------------------------ disconnects
def test_disconnect_mid_stream_aborts_the_request():
    engine = FakeEngine(delay=0.02)
    with LiveServer(engine) as live:
        with httpx.stream("POST", live.url + "/v1/completions", timeout=TIMEOUT,
                          json={"prompt": "x", "max_tokens": 100, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        # the response is closed after one event: the server notices and aborts
        assert wait_for(lambda: engine.aborted == [0]), engine.aborted
        assert wait_for(lambda: engine.stats().running == 0)
        assert post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_disconnect_during_a_non_streaming_request_aborts_it():
    engine = FakeEngine(delay=0.02)
    with LiveServer(engine) as live:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/chat/completions", timeout=httpx.Timeout(scaled(20), read=0.3),
                       json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 100})
        assert wait_for(lambda: engine.aborted == [0]), engine.aborted
        assert wait_for(lambda: engine.stats().running == 0)


# ------------------------------------------------------------------ shutdown
def test_sigterm_drains_running_requests_then_refuses_and_stops():
    engine = FakeEngine(delay=0.01)
    live = LiveServer(engine, shutdown_timeout=10)
    with live:
        events: list[str] = []
        started = threading.Event()

        def streaming():
            with httpx.stream("POST", live.url + "/v1/completions", timeout=TIMEOUT,
                              json={"prompt": "x", "max_tokens": 60, "stream": True}) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        started.set()

        t = threading.Thread(target=streaming)
        t.start()
        assert started.wait(scaled(10))
        live.server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
        assert live.app.state.specdial.draining
        # a request arriving now is refused: 503, or no connection at all once the socket closed
        try:
            r = post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2})
            error_of(r, 503, None, "shutting_down")
        except httpx.TransportError:
            pass
        t.join(scaled(20))
        assert events[-1] == "data: [DONE]"
        text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
        assert len(text) == 60  # finished, not cut
        live.thread.join(scaled(20))
        assert not live.thread.is_alive()
    assert engine.shutdown_calls == [False] and engine.aborted == []


def test_shutdown_timeout_aborts_what_is_left():
    engine = FakeEngine(delay=0.05)
    live = LiveServer(engine, shutdown_timeout=0.3)
    with live:
        def long_request():
            try:
                post(live, "/v1/completions", {"prompt": "x", "max_tokens": 120})
            except httpx.HTTPError:
                pass

        t = threading.Thread(target=long_request)
        t.start()
        assert wait_for(lambda: engine.stats().running == 1)
        live.server.handle_exit(signal.SIGTERM, None)
        live.thread.join(scaled(20))
        assert not live.thread.is_alive()
        t.join(scaled(20))
    assert engine.aborted == [0] and engine.shutdown_calls == [False]


def test_sigterm_to_a_server_process_exits_cleanly(tmp_path):
    """The process path of `specdial serve` (serve_forever), with the fake engine."""
    tests_dir = Path(__file__).resolve().parent
    script = textwrap.dedent(f"""
        import socket, sys
        sys.path.insert(0, {str(tests_dir)!r})
        from test_server_fake_engine import FakeEngine
        from specdial.server.app import create_app
        from specdial.server.launch import make_server, serve_forever
        engine = FakeEngine()
        sock = socket.socket(); sock.bind(("127.0.0.1", 0))
        print(sock.getsockname()[1], flush=True)
        app = create_app(engine)
        server = make_server(app, port=sock.getsockname()[1], log_level="info")
        code = serve_forever(server, sockets=[sock])
        print("exit", code, "shutdown", engine.shutdown_calls, flush=True)
        sys.exit(code)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        url = f"http://127.0.0.1:{port}"

        def healthy():
            try:
                return httpx.get(url + "/health", timeout=scaled(1)).status_code == 200
            except httpx.TransportError:
                return False

        assert wait_for(healthy, scaled(30))
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=scaled(10))
        assert r.json()["choices"][0]["text"] == "abc"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=scaled(30))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "exit 0 shutdown [False]" in out
    assert "Shutting down" in err


# ------------------------------------------------------------------ nulls, NaN, chat templates
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


class TemplateTokenizer:
    """A character tokenizer with a chat template, recording how prompts were encoded."""

    chat_template = "[role]content..."
    eos_token_id = None

    def __init__(self):
        self.encode_calls = []

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        if messages[0]["role"] == "assistant":
            raise ValueError("conversations must start with a user or system message")
        text = "".join(f"[{m['role']}]{m['content']}" for m in messages)
        return "<s>" + text + ("[assistant]" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=True):
        self.encode_calls.append((text, add_special_tokens))
        return [ord(c) for c in text]


def test_the_tokenizers_chat_template_is_used():
    tok = TemplateTokenizer()
    engine = FakeEngine(tokenizer=tok)
    with LiveServer(engine) as live:
        r = post(live, "/v1/chat/completions", {"messages": [
            {"role": "developer", "content": "d"}, {"role": "user", "content": "u"}],
            "max_tokens": 2})
        assert r.status_code == 200
        assert tok.encode_calls == [("<s>[system]d[user]u[assistant]", False)]
        r = post(live, "/v1/chat/completions", {"messages": [
            {"role": "assistant", "content": "a"}]})
        err = error_of(r, 400, "messages")
        assert "chat template rejected" in err["message"]
        post(live, "/v1/completions", {"prompt": "p", "max_tokens": 1})
        assert tok.encode_calls[-1] == ("p", True)


def test_render_chat_with_an_hf_tokenizer():
    from transformers import AutoTokenizer

    from specdial.builtin import BUILTIN_DIR
    from specdial.server.chat import render_chat

    tok = AutoTokenizer.from_pretrained(BUILTIN_DIR / "target")
    messages = [{"role": "developer", "content": "a"}, {"role": "user", "content": "b"}]
    assert render_chat(tok, messages) == (simple_chat_prompt(messages), False)
    tok.chat_template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}")
    assert render_chat(tok, messages) == ("[system]a[user]b[assistant]", True)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        render_chat(tok, messages)


def test_every_unsupported_field_names_what_to_use_instead():
    from specdial.server.protocol import (INSTEAD, UNSUPPORTED_CHAT_FIELDS,
                                          UNSUPPORTED_COMPLETION_FIELDS)

    assert set(UNSUPPORTED_COMPLETION_FIELDS) | set(UNSUPPORTED_CHAT_FIELDS) == set(INSTEAD)
