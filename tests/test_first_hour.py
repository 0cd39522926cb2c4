"""Defects a new user met in a first hour with a fresh clone (README set-up, ``specdial
serve`` and ``generate``, bad inputs), each pinned here: every bad request is a 4xx naming
the field the client sent and the allowed values, never a 500, an internal name or a 503 that
retrying cannot cure. The server runs the FAKE engine of test_server_fake_engine.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from specdial._core import AdaptiveConfig, ConfigError
from specdial.engine.policy_setup import MAX_TREE_NODES, MAX_TREE_TOPK, policy_options
from specdial.policy_sim import tree_policy
from test_server_fake_engine import FakeEngine, LiveServer
from timeouts import scaled

TIMEOUT = httpx.Timeout(scaled(20.0))
VOCAB = 1000


@pytest.fixture(scope="module")
def live():
    engine = FakeEngine(context_length=128, max_running=2, max_queued=2)
    engine.vocab_size = VOCAB  # what the real Engine says (server.state.vocab_size_of)
    engine.config = SimpleNamespace(max_running_requests=2, max_queued_requests=2, dp_size=1)
    with LiveServer(engine) as server:
        yield server


def post(live, path, body):
    return httpx.post(live.url + path, content=json.dumps(body), timeout=TIMEOUT,
                      headers={"Content-Type": "application/json"})


def error_of(r: httpx.Response) -> dict:
    assert r.status_code == 400, (r.status_code, r.text)
    return r.json()["error"]


# ------------------------------------------------------------------ prompt token ids
@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("bad", [VOCAB, 2**70, -1])
def test_prompt_token_ids_outside_the_vocabulary_are_a_400_naming_the_prompt(live, echo, bad):
    # before: 2**70 with echo decoded the ids first (500 OverflowError), and an id past the
    # vocabulary was "input_ids: needs 1+ token ids" for a request that sent 'prompt'
    e = error_of(post(live, "/v1/completions", {"prompt": [5, bad], "max_tokens": 2,
                                                "echo": echo}))
    assert e["param"] == "prompt"
    if bad >= 0:
        assert f"'prompt': invalid token id {bad}; allowed: token ids in [0, {VOCAB})" \
            in e["message"]
    e = error_of(post(live, "/v1/completions", {"prompt": [[5], [6, VOCAB]], "max_tokens": 2}))
    assert e["message"].startswith("'prompt[1]': invalid token id") and e["param"] == "prompt"


def test_generate_names_input_ids_not_text(live):
    e = error_of(post(live, "/generate", {"input_ids": [], "sampling_params": {}}))
    assert e["message"] == "'input_ids' is empty (0 tokens)" and e["param"] == "input_ids"
    few = {"max_new_tokens": 2}
    e = error_of(post(live, "/generate", {"input_ids": [[1], []], "sampling_params": few}))
    assert e["message"] == "'input_ids[1]' is empty (0 tokens)"
    e = error_of(post(live, "/generate", {"input_ids": [1, 2**70], "sampling_params": few}))
    assert e["param"] == "input_ids" and "allowed: token ids in [0, 1000)" in e["message"]
    e = error_of(post(live, "/generate", {"text": ["a", ""], "sampling_params": few}))
    assert e["message"] == "'text[1]' is empty (0 tokens)" and e["param"] == "text"


# ------------------------------------------------------------------ field paths
@pytest.mark.parametrize("path, body, param, allowed", [
    ("/generate", {"text": "x", "sampling_params": "x"}, "sampling_params", "valid dictionary"),
    ("/generate", {"text": "x", "rid": 5}, "rid", "valid string; or Input should be a valid list"),
    ("/generate", {"text": 5}, "text", "valid string"),
    ("/detokenize", {"tokens": "abc"}, "tokens", "valid list"),
    ("/detokenize", {"tokens": [1.5]}, "tokens.0", "valid integer"),
    ("/tokenize", {"prompt": 5}, "prompt", "valid string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages[0].content", "valid string; or Input should be a valid list"),
])
def test_errors_name_the_field_not_pydantics_union_member(live, path, body, param, allowed):
    # before: 'sampling_params.dict[str,any]', 'rid.str', 'tokens.list[int]', 'prompt.str'
    e = error_of(post(live, path, body))
    assert e["param"] == param and f"Invalid value for '{param}': " in e["message"]
    assert allowed in e["message"] and "[int]" not in e["message"] and ".str" not in e["message"]


# ------------------------------------------------------------------ more than the server holds
def test_more_sequences_than_the_server_holds_is_a_400_not_a_503(live):
    # before: 503 queue_full "retry later" on an idle server, for ever (2 running + 2 queued)
    e = error_of(post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 5}))
    assert e["param"] == "n" and e["code"] == "too_many_sequences"
    assert "at most 4 at once" in e["message"] and "5 sequences" in e["message"]
    e = error_of(post(live, "/v1/completions", {"prompt": ["a", "b", "c", "d", "e"],
                                                "max_tokens": 2}))
    assert e["param"] == "prompt"
    e = error_of(post(live, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 9}))
    assert e["param"] == "n"
    e = error_of(post(live, "/generate", {"text": "x", "sampling_params": {"n": 5,
                                                                          "max_new_tokens": 2}}))
    assert e["param"] == "sampling_params.n"
    e = error_of(post(live, "/generate", {"input_ids": [[1]] * 5,
                                          "sampling_params": {"max_new_tokens": 2}}))
    assert e["param"] == "input_ids"
    # at the capacity it is served, and the server stays usable after the refusals
    r = post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 4})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    assert live.engine.stats().running == 0


# ------------------------------------------------------------------ tree bounds
@pytest.mark.parametrize("tree, field, allowed", [
    ((4, 100), "speculative_num_draft_tokens", "8..=65"),  # before: "tree.max_... got 99"
    ((2, 3), "speculative_num_draft_tokens", "8..=27"),
    ((17, 20), "speculative_eagle_topk", f"2..={MAX_TREE_TOPK}"),  # before: "tree.max_topk"
])
def test_adaptive_tree_bounds_are_errors_in_the_flags_names_and_counting(tree, field, allowed):
    with pytest.raises(ConfigError) as e:
        policy_options(None, True, None, 16, None, None, tree=tree)
    msg = str(e.value)
    assert msg.startswith(f"{field}: must be in {allowed}") and f"got {tree[field.endswith('tokens')]}" in msg
    assert "tree." not in msg


def test_policy_simulate_tree_bounds_name_the_flags():
    with pytest.raises(ConfigError) as e:
        tree_policy(None, 8, 200)
    assert str(e.value).startswith("speculative_num_draft_tokens: must be in 2..=65") \
        and "got 200" in str(e.value)
    with pytest.raises(ConfigError, match="e.g. 8 and 65"):
        tree_policy(None, 8, None)


def test_python_tree_bounds_are_the_rust_configs():
    def config(topk: int, nodes: int) -> AdaptiveConfig:
        return AdaptiveConfig.from_dict({"strategy": "goodput", "candidate_steps": [0, 1, 2],
                                         "tree": {"max_topk": topk,
                                                  "max_num_draft_tokens": nodes}})

    config(MAX_TREE_TOPK, MAX_TREE_NODES)
    for topk, nodes in ((MAX_TREE_TOPK + 1, MAX_TREE_NODES), (MAX_TREE_TOPK, MAX_TREE_NODES + 1)):
        with pytest.raises(ConfigError):
            config(topk, nodes)


# ------------------------------------------------------------------ the offline Engine's words
@pytest.mark.parametrize("prompt, input_ids, message", [
    ("", None, "prompt is empty (0 tokens); allowed: 1+ token ids in [0, 1000)"),
    (None, [], "input_ids is empty (0 tokens)"),
    (None, [3, 1000], "input_ids: invalid token id 1000; allowed: token ids in [0, 1000)"),
])
def test_engine_prompt_errors_say_what_is_wrong(prompt, input_ids, message):
    # before: "prompt: needs 1+ token ids in [0, 1000)" for all three (specdial generate "")
    from specdial.engine.api import RequestError
    from specdial.engine.requests import make_spec
    from test_server_fake_engine import FakeTokenizer

    with pytest.raises(RequestError) as e:
        make_spec(prompt, input_ids, {"max_new_tokens": 2}, None, tokenizer=FakeTokenizer(),
                  vocab_size=VOCAB, context_length=64, eos_token_ids=frozenset())
    assert message in str(e.value) and e.value.param == ("prompt" if prompt is not None
                                                         else "input_ids")


def test_speculative_config_conflict_names_its_key():
    # before: "--speculative-config 3 conflicts with --speculative-num-steps 4"
    from specdial.cli import build_parser
    from specdial.cli_serve import _defaults
    from specdial.server.config import ServeConfig
    from specdial.server.flags import resolve_compat

    args = build_parser().parse_args(["serve", "--speculative-num-steps", "4",
                                      "--speculative-config", '{"num_speculative_tokens": 3}'])
    with pytest.raises(ValueError) as e:
        resolve_compat(args, _defaults(ServeConfig))
    assert str(e.value).startswith("--speculative-config's num_speculative_tokens 3 conflicts "
                                   "with --speculative-num-steps 4")


@pytest.mark.parametrize("stop", [-1, True, [1.5], ["a", 2], {"a": 1}])
def test_generate_stop_of_the_wrong_type_is_a_400(live, stop):
    # before: 500 "TypeError: object of type 'int' has no len()" (found by random bodies)
    e = error_of(post(live, "/generate", {"text": "x", "sampling_params": {
        "max_new_tokens": 2, "stop": stop}}))
    assert e["param"] == "sampling_params.stop" and e["code"] == "invalid_type"
    assert "must be a string or a list of strings" in e["message"]
