"""The OpenAI-compatible server against a live uvicorn on 127.0.0.1, with the FAKE engine of
test_server_fake_engine.py (no models): the official ``openai`` client for completions, chat,
streaming and concurrency, metrics, and the tokenizer's chat template; the shared fixtures
(``live``, ``client``) and helpers (``post``, ``wait_for``, ``error_of``). Malformed requests and
errors: test_server_api_errors.py; disconnects and shutdown: test_server_api_lifecycle.py. The
real-Engine end-to-end tests are in test_server_engine.py."""

from __future__ import annotations

import asyncio
import json
import time

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


def error_of(r, status, param, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err




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


def test_chat_message_name_reaches_the_template(client, live):
    """OpenAI's optional ``messages[].name`` (AutoGen and other clients send it) is accepted:
    the simple template writes it into the role marker; a name outside OpenAI's rule is a 400
    naming the field."""
    r = client.chat.completions.create(model=NAME, max_tokens=2, temperature=0, messages=[
        {"role": "user", "name": "alice", "content": "Hi"}])
    assert r.choices[0].message.content == "ab"
    expected = "<|user:alice|>\nHi\n<|assistant|>\n"
    sub = live.engine.submitted[max(live.engine.submitted)]
    assert sub["input_ids"] == [ord(c) for c in expected]
    for bad in ("", "a b", "x" * 65, 3):
        r = post(live, "/v1/chat/completions", {"max_tokens": 2, "messages": [
            {"role": "user", "name": bad, "content": "Hi"}]})
        error_of(r, 400, "messages[0].name")


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


# ------------------------------------------------------------------ chat templates
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
    named = [{"role": "user", "content": "b", "name": "bob"}]
    tok.chat_template = ("{% for m in messages %}[{{ m.role }}|{{ m.name }}]{{ m.content }}"
                         "{% endfor %}")
    assert render_chat(tok, named) == ("[user|bob]b", True)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        render_chat(tok, messages)
