"""Request-schema fuzzing (issue 12) with Hypothesis: the live server over the REAL Engine (tiny
random models with the built-in tokenizer, context 256) gets generated request bodies for
``/v1/completions`` and ``/v1/chat/completions``: every known field (supported, unsupported,
vLLM/SGLang extensions) with values of the right type, edge values (NaN and infinities written
as JSON ``NaN``/``Infinity``, integers past 64 bits, float32 overflows, empty and lone-surrogate
strings) and values of any JSON type, unknown keys, any JSON document as the body, truncated
JSON, bytes that are not UTF-8, and other content types.

Properties: never a 5xx; every error is OpenAI's JSON ``{"error": {...}}``; every 200 is a
complete response (a JSON body with choices, or SSE events ending with ``data: [DONE]``); the
engine is idle afterwards (no request running or waiting, no KV page held). The number of
inputs tried is printed (``pytest -s``).
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdial.engine import Engine
from specdial.server.config import ServeConfig
from test_server_cli import save_tiny_model
from test_server_fake_engine import LiveServer
from timeouts import scaled

pytestmark = pytest.mark.skipif(not hasattr(Engine, "async_stream"),
                                reason="needs the continuous-batching Engine")

NAME = "tiny"
EXAMPLES = 250  # per endpoint
TRIED: dict[str, int] = {"completions": 0, "chat": 0, "statuses": {}}  # type: ignore[dict-item]

leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
        | st.text(max_size=16))
anything = st.recursive(leaf, lambda c: st.lists(c, max_size=4)
                        | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12)
text = st.text(max_size=40) | st.sampled_from(["", "\ud800", "def f(x):\n", "\x00", "🙂" * 5])
small_int = st.integers(-3, 24) | st.sampled_from([0, 255, 256, 10**6, 2**63, 2**64, -2**63])
real = (st.floats(-2.0, 2.0) | st.floats() | st.sampled_from(
    [0, 1, 1e-46, 5e-324, 1e-6, 3.4e38, 3.5e38, 1e39, 1e308, -0.0]))
stop = text | st.lists(text, max_size=20) | st.lists(st.text(max_size=300), max_size=2)


def fields(**specific: Any) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies with any subset of the common fields plus ``specific``, each value either of
    the field's own shape or any JSON value, and now and then an unknown key."""
    common = {
        "model": st.sampled_from([NAME, "other", None]),
        "max_tokens": small_int, "temperature": real, "top_p": real, "seed": small_int,
        "stop": stop, "stream": st.booleans(), "ignore_eos": st.booleans(),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
        "user": text, "n": small_int, "logprobs": st.booleans() | small_int,
        "top_logprobs": small_int, "frequency_penalty": real, "presence_penalty": real,
        "logit_bias": st.dictionaries(st.text(max_size=4), real, max_size=2),
        "top_k": small_int, "repetition_penalty": real, "service_tier": text,
    }
    common.update(specific)
    optional = {k: v | anything if k != "model" else v for k, v in common.items()}
    return st.fixed_dictionaries({}, optional={**optional, "an_unknown_key": anything})


def valid(**specific: Any) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies of supported fields with allowed values only (most are served: 200)."""
    good_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
                        max_size=30)
    optional = {"model": st.just(NAME), "temperature": st.floats(0, 2), "top_p": st.floats(1e-3, 1),
                "seed": st.integers(0, 2**64 - 1), "stop": st.lists(good_text, max_size=3),
                "ignore_eos": st.booleans(), "user": good_text, "n": st.just(1)}
    stream = st.sampled_from([{}, {"stream": False}, {"stream": True},
                              {"stream": True, "stream_options": {"include_usage": True}}])
    required = {"max_tokens": st.integers(1, 8),  # chat's default is the rest of the context
                **{k: v(good_text) for k, v in specific.items()}}
    return st.tuples(st.fixed_dictionaries(required, optional=optional), stream).map(
        lambda t: {**t[0], **t[1]})


def mutated(bodies: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid body with one field (or a new one) set to any JSON value, or one removed."""
    keys = st.sampled_from(["model", "prompt", "messages", "max_tokens", "temperature", "top_p",
                            "seed", "stop", "stream", "stream_options", "n", "logprobs", "echo",
                            "max_completion_tokens", "ignore_eos", "tools", "another"])
    return st.tuples(bodies, keys, anything, st.booleans()).map(
        lambda t: {k: v for k, v in t[0].items() if k != t[1]} if t[3]
        else {**t[0], t[1]: t[2]})


completion_ok = valid(prompt=lambda good: good | st.lists(good, min_size=1, max_size=3))
completion_body = st.one_of(
    completion_ok, mutated(completion_ok),
    fields(prompt=text | st.lists(text, max_size=5), echo=st.booleans(), best_of=small_int,
           suffix=text))
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", ""]) | anything,
     "content": text | st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url"]), "text": text}), max_size=3)},
    optional={"name": text})
chat_ok = valid(messages=lambda good: st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": good}), min_size=1,
    max_size=3))
chat_body = st.one_of(
    chat_ok, mutated(chat_ok),
    fields(messages=st.lists(message, max_size=4), max_completion_tokens=small_int,
           tools=anything,
           response_format=st.sampled_from([{"type": "text"}, {"type": "json_object"}])))


def encodings(bodies: st.SearchStrategy[Any]) -> st.SearchStrategy[tuple[bytes, str]]:
    """(raw body, content type): JSON (NaN/Infinity allowed, as Python writes them), any JSON
    document, cut JSON, non-UTF-8 bytes; mostly application/json."""
    as_json = st.one_of(bodies, bodies, bodies, anything).map(
        lambda b: json.dumps(b, allow_nan=True).encode("utf-8", "surrogatepass"))
    cut = st.tuples(as_json, st.floats(0, 1)).map(lambda t: t[0][:int(len(t[0]) * t[1])])
    raw = st.binary(max_size=64) | st.just(b"\xff\xfe{}")
    ctype = st.sampled_from(["application/json"] * 8 + ["application/json; charset=utf-8",
                                                         "text/plain", ""])
    return st.tuples(st.one_of(as_json, as_json, as_json, cut, raw), ctype)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    mk = tmp_path_factory.mktemp
    target = save_tiny_model(mk("fuzz_target"), seed=30)
    draft = save_tiny_model(mk("fuzz_draft"), seed=31, perturb_of=target, noise=0.01)
    engine = ServeConfig(model_path=str(target), draft_model_path=str(draft),
                         max_running_requests=8, context_length=256, page_size=16,
                         log_interval_s=0).build_engine()
    with LiveServer(engine, name=NAME) as server:
        yield server
    print(f"\n[fuzz] inputs tried: {TRIED}")


def check_response(r: httpx.Response, stream_lines: list[str] | None) -> None:
    statuses = TRIED["statuses"]
    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1  # type: ignore[index]
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code != 200:
        err = json.loads(r.text)["error"]
        assert isinstance(err["message"], str) and err["message"]
        return
    if stream_lines is None:
        assert json.loads(r.text)["choices"]
        return
    data = [line for line in stream_lines if line.startswith("data: ")]
    assert data and data[-1] == "data: [DONE]", data[-3:]
    for line in data[:-1]:
        json.loads(line[6:])


def send(live: LiveServer, path: str, raw: bytes, ctype: str) -> None:
    headers = {"Content-Type": ctype} if ctype else {}
    with httpx.stream("POST", live.url + path, content=raw, headers=headers, timeout=scaled(60)) as r:
        if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
            lines = list(r.iter_lines())
            check_response(r, lines)
        else:
            r.read()
            check_response(r, None)


FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(case=encodings(completion_body))
def test_fuzz_completions(live, case):
    TRIED["completions"] += 1
    send(live, "/v1/completions", *case)


@FUZZ
@given(case=encodings(chat_body))
def test_fuzz_chat_completions(live, case):
    TRIED["chat"] += 1
    send(live, "/v1/chat/completions", *case)


def test_engine_idle_after_fuzzing(live):
    deadline = time.monotonic() + scaled(30)
    while True:
        s = live.engine.stats()
        if s.running == 0 and s.queued == 0 and s.kv_pages_used == 0:
            break
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    statuses = TRIED["statuses"]
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses  # both paths reached
