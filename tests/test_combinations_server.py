"""Features meeting in one verify, over HTTP (a live uvicorn per engine, built-in models): a
fixed draft tree and adaptive trees with per-request node budgets (goodput, ``"verify":
"per_request"``, ``"min_survival": "auto"``) against target-only decoding (steps 0):

- ``n = 2`` with a seed and a grammar (``guided_regex``, ``response_format`` json_schema) on
  /v1/completions and /v1/chat/completions and SGLang's /generate: the same choices as
  target-only (choice ``i`` seeded from ``(seed, i)``), two different ones;
- greedy with a JSON schema, stop strings and logprobs, plain and streamed: the same text,
  finish reasons, usage and logprobs as target-only;
- two replica processes (``dp_size`` 2) with a fixed tree: greedy with a grammar and a stop
  string, seeded with a grammar, equal to target-only;
- combinations refused on purpose name the field and the allowed values: two output
  constraints in one request (400), ``min_tokens`` with a grammar (a request error, 400),
  ``min_survival`` without per-request verify, trees under a strategy that cannot size them
  and trees without a drafter (``ConfigError`` when the engine builds).
"""

from __future__ import annotations

import json

import httpx
import pytest

from specdial import ConfigError
from specdial.engine import Engine
from test_combinations import KW, LONG_REGEX, POLICY_TREES, PROMPTS, SCHEMA
from test_server_builtin_extras import stream_events
from test_server_fake_engine import LiveServer
from timeouts import scaled

NAME = "m"
CONFIGS = {
    "plain": dict(speculative_num_steps=0),
    "tree_fixed": dict(speculative_adaptive=False, speculative_num_steps=3,
                       speculative_eagle_topk=2, speculative_num_draft_tokens=7),
    "tree_policy": POLICY_TREES,
}


def verify_token_cost(plan, measured: float) -> float:
    """The policy server's deterministic iteration cost (the loop's ``decode_seconds`` hook):
    20 ms, 0.2 ms per draft step, 0.1 ms per verify token (every tree node): trees pay, so
    the policy drafts them whatever the machine's load."""
    tokens = plan.batch_size * ((plan.num_draft_tokens if plan.tree_topk > 1 else plan.steps) + 1)
    return 0.020 + 0.0002 * plan.steps + 0.0001 * tokens


@pytest.fixture(scope="module")
def servers():
    started = {}
    try:
        for name, cfg in CONFIGS.items():
            engine = Engine(model_path=None, **KW, **cfg)
            if name == "tree_policy":  # warmed until its trees' node budgets cut
                engine._loop.decode_seconds = verify_token_cost
                for _ in range(4):
                    engine.generate(PROMPTS, {"max_new_tokens": 40, "temperature": 0.0})
                    if any(n < 8 for n in engine.stats().tree_node_histogram):
                        break
            s = LiveServer(engine, name=NAME)
            started[name] = s.__enter__()
        yield started
    finally:
        for s in started.values():
            s.__exit__(None, None, None)
            s.engine.shutdown()


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json={"model": NAME, **body}, timeout=scaled(120))
    assert r.status_code == 200, r.text
    return r.json()


def _same_on_every_server(servers, path: str, body: dict, key) -> list:
    """``key(response)`` from each server, checked equal to target-only's; returns it. The
    fixed tree verified trees for it; the policy's server has drafted trees whose node
    budgets cut (some request verified fewer than its 8 nodes) by now (its policy may settle on
    chains for a while: what it chooses per iteration is its own)."""
    want = key(post(servers["plain"], path, body))
    for name in CONFIGS:
        if name != "plain":
            before = sum(servers[name].engine.stats().tree_node_histogram.values())
            assert key(post(servers[name], path, body)) == want, name
            hist = servers[name].engine.stats().tree_node_histogram
            if name == "tree_fixed":
                assert sum(hist.values()) > before
            else:
                assert any(n < 8 for n in hist), hist
    return want


BODIES = {
    "/v1/completions": {"prompt": "Record:", "guided_regex": LONG_REGEX},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Give me a record"}],
                             "response_format": {"type": "json_schema", "json_schema": {
                                 "name": "r", "schema": json.loads(SCHEMA)}}},
}


@pytest.mark.parametrize("path", list(BODIES))
def test_n2_seeded_with_a_grammar_equals_target_only(servers, path):
    body = {**BODIES[path], "n": 2, "seed": 7, "temperature": 1.0, "max_tokens": 24}
    chat = path.endswith("chat/completions")

    def key(r):
        return [(c["message"]["content"] if chat else c["text"], c["finish_reason"])
                for c in sorted(r["choices"], key=lambda c: c["index"])]
    got = _same_on_every_server(servers, path, body, key)
    assert len(got) == 2 and got[0] != got[1]


def test_sglang_generate_n2_seeded_with_a_grammar(servers):
    body = {"text": "def f(x):", "sampling_params": {
        "n": 2, "seed": 3, "temperature": 1.0, "max_new_tokens": 24, "regex": LONG_REGEX}}
    got = _same_on_every_server(servers, "/generate", body,
                                lambda r: [o["output_ids"] for o in r])
    assert len(got) == 2 and got[0] != got[1]


def test_greedy_grammar_stop_and_logprobs_equal_target_only(servers):
    body = {"prompt": "Record:", "max_tokens": 40, "temperature": 0,
            "guided_json": SCHEMA, "stop": ['"ok'], "logprobs": 2}

    def key(r):
        c = r["choices"][0]
        lp = c["logprobs"]
        return (c["text"], c["finish_reason"], r["usage"], lp["tokens"],
                [round(x, 3) for x in lp["token_logprobs"]],
                [sorted(d) for d in lp["top_logprobs"]])
    text, finish, usage, tokens, *_ = _same_on_every_server(servers, "/v1/completions", body,
                                                            key)
    assert finish == "stop" and "".join(tokens) == text and usage["completion_tokens"] > 3
    for name, s in servers.items():  # streamed: the same text and usage
        events = stream_events(s, "/v1/completions", {
            "model": NAME, **body, "stream_options": {"include_usage": True}})
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == text, name
        assert events[-1]["usage"] == usage, name


def test_two_output_constraints_are_refused_naming_both(servers):
    body = {"model": NAME, "prompt": "x", "max_tokens": 4, "guided_regex": "[0-9]+",
            "response_format": {"type": "json_object"}}
    r = httpx.post(servers["tree_fixed"].url + "/v1/completions", json=body,
                   timeout=scaled(60))
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "guided_regex" in msg and "response_format" in msg, msg


@pytest.mark.parametrize("config, words", [
    (dict(speculative_eagle_topk=4, speculative_num_draft_tokens=9,
          speculative_adaptive_config={"strategy": "goodput", "min_survival": 0.5,
                                       "1": {"candidate_steps": [0, 1, 2, 3]}}),
     ["min_survival", '"verify": "per_request"']),
    (dict(speculative_eagle_topk=4, speculative_num_draft_tokens=9,
          speculative_adaptive_config={"strategy": "ema", "1": {"candidate_steps": [1, 2, 3]}}),
     ["speculative_eagle_topk", "goodput", "'ema'"]),
    (dict(speculative_algorithm=None, speculative_eagle_topk=4, speculative_num_draft_tokens=9),
     ["speculative_eagle_topk=4", "needs a drafter", "allowed without a drafter: "
      "speculative_eagle_topk 1"]),
])
def test_combinations_refused_on_purpose_name_the_field(config, words):
    with pytest.raises(ConfigError) as e:
        Engine(model_path=None, **KW, **config).shutdown()
    assert all(w in str(e.value) for w in words), str(e.value)


def test_min_tokens_with_a_grammar_is_refused_naming_the_field(servers):
    """The grammar decides where the output ends: ``min_tokens`` above 0 is refused (the
    offline Engine's ``RequestError`` and HTTP 400 name it and the allowed value)."""
    from specdial.engine.api import RequestError

    with pytest.raises(RequestError) as e:
        servers["tree_fixed"].engine.generate("x", {"max_new_tokens": 8, "regex": "(yes|no)",
                                                    "min_tokens": 5})
    assert e.value.param == "min_tokens" and "allowed: 0" in str(e.value), str(e.value)
    r = httpx.post(servers["tree_fixed"].url + "/v1/completions", timeout=scaled(60), json={
        "model": NAME, "prompt": "x", "max_tokens": 8, "guided_regex": "(yes|no)",
        "min_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


def test_replica_processes_with_trees_and_grammars_equal_target_only(servers):
    """``dp_size`` 2 (one process per replica, each its own scheduler) with a fixed draft tree:
    greedy under a JSON schema with a stop string, and seeded sampling under a regex, give
    the tokens of target-only decoding in one process, with the prompts spread over both."""
    sp = [{"max_new_tokens": 24, "temperature": 0.0, "json_schema": SCHEMA, "stop": ['"id']},
          {"max_new_tokens": 24, "temperature": 1.0, "seed": 5, "regex": LONG_REGEX}]
    prompts = [p for p in PROMPTS[:2] for _ in sp]
    params = sp * 2
    ref = servers["plain"].engine.generate(prompts, params)
    want = [o["output_ids"] for o in ref]
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in ref[::2])
    with Engine(model_path=None, dp_size=2, **KW, **CONFIGS["tree_fixed"]) as dp:
        got = [o["output_ids"] for o in dp.generate(prompts, params)]
        per_replica = [s.requests_finished for s in dp.data_parallel.replica_stats()]
        trees = [sum(s.tree_node_histogram.values()) for s in dp.data_parallel.replica_stats()]
    assert got == want
    assert min(per_replica) >= 1 and min(trees) > 0, (per_replica, trees)
