"""Issue 25 over the live server and the REAL Engine (tiny random models with the built-in
tokenizer, vocabulary 4096, context 256):

- a failing step is never a 200 with empty text: a plain request gets 500 naming the cause,
  a stream (``openai`` client) an error event and then ``[DONE]``, ``/generate`` 500 with
  ``meta_info.finish_reason`` carrying the message;
- a loop made to die (the ``Crash`` test hook) turns ``/health`` to 503 naming the cause and
  ``specdial:engine_up`` to 0;
- the hostile inputs of the issue (``stop_token_ids: [2**63]``, ``top_k: 2**63``, stop ids
  outside the vocabulary) are 400s while 12 innocent requests beside them complete;
- a Hypothesis test sends extreme values (2**63, 2**64, -2**63, 1e308, NaN, infinities, huge
  lists) in every numeric field of every endpoint beside innocent concurrent requests: each
  bad one is a 4xx (or a 200 where the value is in range), every innocent one completes.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdial.engine.loop import Crash
from specdial.server.config import ServeConfig
from test_server_cli import save_tiny_model
from test_server_fake_engine import LiveServer
from timeouts import scaled

NAME = "tiny"
INNOCENT = {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _engine(target) -> Any:
    return ServeConfig(model_path=str(target), max_running_requests=16, context_length=256,
                       page_size=16, log_interval_s=0).build_engine()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("ends_target"), seed=40)


@pytest.fixture(scope="module")
def live(target):
    with LiveServer(_engine(target), name=NAME) as server:
        yield server


def _innocent(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json=INNOCENT, timeout=scaled(120))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 8
    assert body["choices"][0]["finish_reason"] == "length"


def test_a_failing_step_is_a_500_or_an_error_event(live, monkeypatch):
    engine = live.engine
    real = engine.worker.decode
    broken = {"on": True}

    def flaky(*args, **kwargs):
        if broken["on"]:
            raise RuntimeError("injected step failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.worker, "decode", flaky)
    r = httpx.post(live.url + "/v1/completions", json=INNOCENT, timeout=scaled(60))
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert "injected step failure" in err["message"] and err["code"] == "engine_error"
    r = httpx.post(live.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}, timeout=scaled(60))
    assert r.status_code == 500 and "injected step failure" in r.text
    r = httpx.post(live.url + "/generate", json={
        "text": "hi", "sampling_params": {"max_new_tokens": 8}}, timeout=scaled(60))
    assert r.status_code == 500, r.text
    reason = r.json()["meta_info"]["finish_reason"]
    assert reason["type"] == "error" and "injected step failure" in reason["message"]
    with openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.APIError, match="injected step failure"):
            for _ in client.completions.create(model=NAME, prompt="def f(x):", max_tokens=8,
                                               stream=True):
                pass
    with httpx.stream("POST", live.url + "/v1/completions",
                      json={**INNOCENT, "stream": True}, timeout=scaled(60)) as r:
        data = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and "injected step failure" in data[-2], data
    assert "error" in json.loads(data[-2][6:])
    broken["on"] = False  # the engine serves on
    _innocent(live.url)
    assert httpx.get(live.url + "/health").status_code == 200


def test_a_dead_loop_turns_health_and_metrics_down(target):
    engine = _engine(target)
    with LiveServer(engine, name=NAME) as server:
        _innocent(server.url)
        metrics = httpx.get(server.url + "/metrics").text
        assert 'specdial:engine_up{model_name="tiny"} 1.0' in metrics
        engine._loop.post(Crash("injected loop death"))
        engine._loop.thread.join(scaled(30))
        r = httpx.get(server.url + "/health")
        assert r.status_code == 503 and "injected loop death" in r.text, r.text
        metrics = httpx.get(server.url + "/metrics").text
        assert 'specdial:engine_up{model_name="tiny"} 0.0' in metrics
        r = httpx.post(server.url + "/v1/completions", json=INNOCENT, timeout=scaled(30))
        assert r.status_code == 503 and "injected loop death" in r.text


@pytest.mark.parametrize("bad, param", [
    ({"stop_token_ids": [9223372036854775808]}, "stop_token_ids"),
    ({"stop_token_ids": [4096]}, "stop_token_ids"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": 4097}, "top_k")])
def test_the_issue_reproductions_are_400s_beside_innocent_requests(live, bad, param):
    with ThreadPoolExecutor(13) as pool:
        innocents = [pool.submit(_innocent, live.url) for _ in range(12)]
        r = pool.submit(httpx.post, live.url + "/v1/completions",
                        json={**INNOCENT, "temperature": 0.7, **bad}, timeout=scaled(60)).result()
        for f in innocents:
            f.result()
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]
    assert httpx.get(live.url + "/health").status_code == 200


# ------------------------------------------------------------------ extreme values everywhere
BASE = {
    "/v1/completions": {"prompt": "hello there", "max_tokens": 4, "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/generate": {"text": "hello there", "sampling_params": {"max_new_tokens": 4,
                                                             "temperature": 0}},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
_OPENAI_COMMON = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n",
                  "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                  "stop_token_ids"]
FIELDS = {
    "/v1/completions": _OPENAI_COMMON + ["logprobs", "best_of", "prompt"],
    "/v1/chat/completions": _OPENAI_COMMON + ["max_completion_tokens", "top_logprobs"],
    "/generate": [f"sampling_params.{k}" for k in (
        "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "min_new_tokens", "stop_token_ids",
        "sampling_seed", "n")] + ["input_ids", "logprob_start_len", "top_logprobs_num"],
    "/tokenize": ["prompt"],
    "/detokenize": ["tokens"],
}
HUGE = [1] * 20_000  # past the context, the vocabulary and the stop-id cap
EXTREMES = [2**63, 2**64, -2**63, 10**400, 1e308, -1e308, math.nan, math.inf, -math.inf,
            [2**63], [2**64, -2**63], [1e308], HUGE, [HUGE]]
#: (field, index in EXTREMES) of the values that are in range (served with a 200)
VALID = {("seed", 0), ("sampling_params.sampling_seed", 0), ("tokens", 12), ("tokens", 13),
         ("temperature", 0), ("temperature", 1), ("sampling_params.temperature", 0),
         ("sampling_params.temperature", 1)}  # temperatures up to float32's largest value


def _body(path: str, field: str, value: Any) -> dict[str, Any]:
    body = json.loads(json.dumps(BASE[path]))
    if field.startswith("sampling_params."):
        body["sampling_params"][field.split(".", 1)[1]] = value
    elif field == "input_ids":
        del body["text"]
        body["input_ids"] = value
    else:
        body[field] = value
    return body


case = st.sampled_from(sorted(BASE)).flatmap(
    lambda path: st.tuples(st.just(path), st.sampled_from(FIELDS[path]),
                           st.sampled_from(range(len(EXTREMES)))))


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=case)
def test_extreme_values_in_every_numeric_field(live, case):
    path, field, i = case
    value = EXTREMES[i]
    raw = json.dumps(_body(path, field, value), allow_nan=True)
    with ThreadPoolExecutor(3) as pool:
        innocents = [pool.submit(_innocent, live.url) for _ in range(2)]
        r = pool.submit(httpx.post, live.url + path, content=raw,
                        headers={"Content-Type": "application/json"}, timeout=scaled(120)).result()
        for f in innocents:
            f.result()
    if (field, i) in VALID:
        assert r.status_code in (200, 400), (path, field, r.status_code, r.text[:300])
    else:
        assert 400 <= r.status_code < 500, (path, field, r.status_code, r.text[:300])
    if r.status_code != 200:
        assert r.json()["error"]["message"]


def test_every_extreme_value_in_every_field_once(live):
    """The whole table above, each (endpoint, field, value) once (the Hypothesis test samples
    it beside innocent requests): never a 5xx; a 4xx unless the value is in range."""
    with httpx.Client(timeout=scaled(120)) as client:
        for path in sorted(BASE):
            for field in FIELDS[path]:
                for i, value in enumerate(EXTREMES):
                    raw = json.dumps(_body(path, field, value), allow_nan=True)
                    r = client.post(live.url + path, content=raw,
                                    headers={"Content-Type": "application/json"})
                    allowed = (200, 400) if (field, i) in VALID else range(400, 500)
                    assert r.status_code in allowed, (path, field, i, r.status_code,
                                                      r.text[:300])
    _innocent(live.url)
