"""Issue 14 over HTTP: the sampling controls users send, top level or in ``extra_body``.

- The FAKE engine (test_server_fake_engine.py) records what the server submits: every control
  reaches the engine under its name, from the top level or from a nested ``extra_body``;
  out-of-range values are a 400 naming the field and its range; a field given in both places
  with different values is a 400 naming it; SGLang's ``/generate`` keys (``min_new_tokens``,
  ``no_stop_trim``, the penalties) map to the engine's.
- The REAL engine (tiny random Llama with the built-in tokenizer, a perturbed copy as draft
  model, adaptive steps): ``vllm bench serve``'s exact request payloads (from vLLM's
  ``vllm/benchmarks/lib/endpoint_request_func.py`` and ``serve.py``: completions with
  ``repetition_penalty: 1.0``, ``logprobs: null``, ``ignore_eos``, streaming with usage, the
  ``--top-k/--top-p/--min-p/--temperature/--*-penalty`` extras; chat with text content parts
  and ``max_completion_tokens``) stream to the end; ``/v1/models`` carries ``root``, which the
  bench reads; greedy completions with penalties and ``min_tokens`` over HTTP equal the
  engine's own output for the same controls and differ from the output without them.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from specdial.server.config import ServeConfig
from test_server_api import live, post  # noqa: F401 - the fake-engine server fixture
from test_server_cli import save_tiny_model
from test_server_fake_engine import LiveServer
from timeouts import scaled

NAME = "tiny"
TIMEOUT = httpx.Timeout(scaled(120.0))

CONTROLS = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.3, "presence_penalty": -0.5,
            "frequency_penalty": 1.5, "min_tokens": 2, "stop_token_ids": [7, 9],
            "include_stop_str_in_output": True, "skip_special_tokens": False}


def _last_params(server) -> dict:
    return server.engine.submitted[max(server.engine.submitted)]["sampling_params"]


def _body(path: str) -> dict:
    return ({"prompt": "x", "max_tokens": 4} if path == "/v1/completions" else
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4})


PATHS = ["/v1/completions", "/v1/chat/completions"]


# ------------------------------------------------------------------ fake engine: plumbing
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("nested", [False, True], ids=["top level", "extra_body"])
def test_controls_reach_the_engine(live, path, nested):
    body = {**_body(path), **({"extra_body": CONTROLS} if nested else CONTROLS)}
    r = post(live, path, body)
    assert r.status_code == 200, r.text
    p = _last_params(live)
    assert {k: p[k] for k in CONTROLS} == CONTROLS
    # null means the engine's default: nothing is sent
    r = post(live, path, {**_body(path), **{k: None for k in CONTROLS}})
    assert r.status_code == 200 and not set(CONTROLS) & set(_last_params(live))


BAD = [("top_k", -2, "greater than or equal to -1"), ("top_k", 1.5, None),
       ("min_p", 1.5, "less than or equal to 1"), ("min_p", -0.1, None),
       ("repetition_penalty", 0, "greater than or equal to 0.0001"),
       ("repetition_penalty", 1e5, "less than or equal to 10000"),
       ("presence_penalty", 2.5, "less than or equal to 2"),
       ("frequency_penalty", -2.01, "greater than or equal to -2"),
       ("min_tokens", -1, "greater than or equal to 0"), ("min_tokens", "3", None),
       ("stop_token_ids", [1, -1], None), ("stop_token_ids", "7", None),
       ("include_stop_str_in_output", "yes", None), ("skip_special_tokens", 1, None)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("field, value, words", BAD)
@pytest.mark.parametrize("nested", [False, True], ids=["top level", "extra_body"])
def test_bad_values_are_400_naming_the_field(live, path, field, value, words, nested):
    extra = {"extra_body": {field: value}} if nested else {field: value}
    r = post(live, path, {**_body(path), **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err
    if words:
        assert words in err["message"], err


def test_extra_body_conflicts_and_shapes(live):
    r = post(live, "/v1/completions", {**_body("/v1/completions"), "top_k": 3,
                                       "extra_body": {"top_k": 4}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "top_k" and "extra_body" in err["message"]
    r = post(live, "/v1/completions", {**_body("/v1/completions"), "top_k": 3,
                                       "extra_body": {"top_k": 3}})
    assert r.status_code == 200 and _last_params(live)["top_k"] == 3
    r = post(live, "/v1/completions", {**_body("/v1/completions"), "extra_body": [1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "extra_body"
    r = post(live, "/v1/completions", {**_body("/v1/completions"),
                                       "extra_body": {"no_such_field": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "no_such_field"
    # logit_bias (issue 25) reaches the engine as given, from the top level or extra_body
    r = post(live, "/v1/completions", {**_body("/v1/completions"),
                                       "extra_body": {"logit_bias": {"5": 1}}})
    assert r.status_code == 200 and _last_params(live)["logit_bias"] == {"5": 1}


def test_openai_client_extra_body(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0) as c:
        c.completions.create(model="specdial-default", prompt="x", max_tokens=2,
                             presence_penalty=0.5,
                             extra_body={"top_k": 3, "min_tokens": 1, "repetition_penalty": 1.1})
    p = _last_params(live)
    assert (p["top_k"], p["min_tokens"], p["repetition_penalty"], p["presence_penalty"]) == (
        3, 1, 1.1, 0.5)


def test_sglang_generate_keys_map_to_the_engine(live):
    sp = {"max_new_tokens": 3, "min_new_tokens": 2, "no_stop_trim": True, "min_p": 0.2,
          "repetition_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": 0.1,
          "skip_special_tokens": False, "sampling_seed": 5}
    r = post(live, "/generate", {"text": "x", "sampling_params": sp})
    assert r.status_code == 200, r.text
    p = _last_params(live)
    assert (p["min_tokens"], p["include_stop_str_in_output"], p["min_p"], p["seed"],
            p["skip_special_tokens"]) == (2, True, 0.2, 5, False)
    r = post(live, "/generate", {"text": "x", "sampling_params": {"seed": 1, "sampling_seed": 2}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.sampling_seed"
    r = post(live, "/generate", {"text": "x", "sampling_params": {
        "spaces_between_special_tokens": False}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"


# ------------------------------------------------------------------ the real engine
@pytest.fixture(scope="module")
def real(tmp_path_factory):
    target = save_tiny_model(tmp_path_factory.mktemp("sampling_target"), seed=41)
    draft = save_tiny_model(tmp_path_factory.mktemp("sampling_draft"), seed=42,
                            perturb_of=target, noise=0.02)
    cfg = ServeConfig(model_path=str(target), draft_model_path=str(draft),
                      max_running_requests=8, context_length=256, log_interval_s=0)
    with LiveServer(cfg.build_engine(), name=NAME) as s:
        yield s


def _sse(r: httpx.Response) -> tuple[list[dict], bool]:
    events, done = [], False
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
            else:
                events.append(json.loads(data))
    return events, done


def test_vllm_bench_serve_payloads_are_served(real):
    """The payloads of vLLM's benchmark request functions, byte for byte in their keys."""
    models = httpx.get(real.url + "/v1/models").json()["data"]
    model_name, model_id = models[0]["id"], models[0]["root"]  # get_first_model_from_server
    assert model_name == NAME and model_id
    sampling = {"top_p": 0.9, "top_k": 20, "min_p": 0.05, "temperature": 0.8,
                "frequency_penalty": 0.1, "presence_penalty": 0.2, "repetition_penalty": 1.1}
    completions = {"model": model_name, "prompt": "def fibonacci(n):", "repetition_penalty": 1.0,
                   "max_tokens": 12, "logprobs": None, "stream": True,
                   "stream_options": {"include_usage": True}, "ignore_eos": True}
    chat = {"model": model_name,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}],
            "max_completion_tokens": 12, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    for path, payload in (("/v1/completions", completions), ("/v1/chat/completions", chat)):
        for extra in ({}, sampling):  # no --temperature etc., then all of them (extra_body)
            body = {**payload, **extra}
            with httpx.stream("POST", real.url + path, json=body, timeout=TIMEOUT,
                              headers={"x-request-id": "bench-1234-0"}) as r:
                assert r.status_code == 200, r.read()
                events, done = _sse(r)
            assert done and events[-1]["usage"]["completion_tokens"] == 12, events[-1]
            assert any(e["choices"] for e in events)


def test_penalties_over_http_equal_the_engine(real):
    engine = real.engine
    prompt = "import os\nimport"
    ids = engine.tokenizer.encode(prompt)
    controls = {"repetition_penalty": 1.4, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                "min_tokens": 5}
    direct = engine.generate(input_ids=ids, sampling_params={
        "max_new_tokens": 24, "temperature": 0.0, **controls})
    plain = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 24,
                                                             "temperature": 0.0})
    assert direct["output_ids"] != plain["output_ids"]
    for extra in (controls, {"extra_body": controls}):
        r = httpx.post(real.url + "/v1/completions", timeout=TIMEOUT, json={
            "prompt": prompt, "max_tokens": 24, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == direct["text"]
    r = httpx.post(real.url + "/v1/completions", timeout=TIMEOUT, json={
        "prompt": prompt, "max_tokens": 4, "min_tokens": 5})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "min_tokens" and "max_new_tokens" in \
        err["message"], err
