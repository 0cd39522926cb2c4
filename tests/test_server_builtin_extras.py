"""Issue 25 end to end with the BUILT-IN models (byte-level BPE tokenizer, EAGLE drafter,
adaptive steps) behind a live uvicorn:

- logprobs agree with the text: joined ``logprobs.tokens`` (completions, streamed or not),
  chat ``token`` strings and SGLang's ``output_token_logprobs`` texts (``/generate``, the
  offline Engine) equal the text, also when a stop string cut the text inside a token and
  when non-ASCII characters span several tokens (echoed prompts included); chat ``bytes``
  joined are the text's UTF-8;
- ``logit_bias`` on /v1/completions, /v1/chat/completions, /generate and the offline Engine:
  a +100 bias makes greedy decoding emit that token; an id outside the vocabulary, a value
  outside [-100, 100] and more than 300 entries are refused naming the field;
- ``/generate`` with ``n = 2``: a list of two outputs, seeded as /v1/completions seeds its
  choices;
- ``/detokenize`` refuses ids outside the vocabulary with a 400 naming ``tokens`` and the range.
"""

from __future__ import annotations

import json

import httpx
import pytest

from specdial.server.config import ServeConfig
from specdial.server.protocol import choice_seed
from test_server_fake_engine import LiveServer
from timeouts import scaled

NAME = "builtin"
PROMPTS = ["def add(a, b):\n    return", "# café: naïve résumé, 日本語\nx = '", "import os\n"]
STOPS = [["e"], ["\n"], [" ", "("], ["ab", "de"], ["é"], ["'"]]


@pytest.fixture(scope="module")
def server():
    cfg = ServeConfig(max_running_requests=16, log_interval_s=0)
    with LiveServer(cfg.build_engine(), name=NAME) as s:
        yield s


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=scaled(120))


def stream_events(server, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                      timeout=scaled(120)) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_completion_logprobs_join_to_the_text_after_stop_strings(server):
    cut = 0
    for i, (prompt, stop) in enumerate((p, s) for p in PROMPTS for s in STOPS):
        body = {"model": NAME, "prompt": prompt, "max_tokens": 24, "temperature": 1.0,
                "seed": i, "stop": stop, "logprobs": 1}
        r = post(server, "/v1/completions", body).json()["choices"][0]
        lp = r["logprobs"]
        assert "".join(lp["tokens"]) == r["text"], (stop, lp["tokens"], r["text"])
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"])
        offsets = [sum(len(t) for t in lp["tokens"][:j]) for j in range(len(lp["tokens"]))]
        assert lp["text_offset"] == offsets
        cut += r["finish_reason"] == "stop"
        events = stream_events(server, "/v1/completions", body)
        text = "".join(e["choices"][0]["text"] for e in events)
        tokens = [t for e in events if e["choices"][0]["logprobs"]
                  for t in e["choices"][0]["logprobs"]["tokens"]]
        assert text == r["text"] and "".join(tokens) == text, (stop, tokens, text)
    assert cut >= 6  # stop strings did cut texts


def test_echoed_non_ascii_prompt_joins_to_the_text(server):
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0,
            "logprobs": 1, "echo": True}
    r = post(server, "/v1/completions", body).json()["choices"][0]
    assert r["text"].startswith(PROMPTS[1])
    assert "".join(r["logprobs"]["tokens"]) == r["text"]
    assert not any("\ufffd" in t for t in r["logprobs"]["tokens"])


def test_n_echoed_choices_share_one_prompt_logprobs_computation(server):
    """Non-streaming ``echo`` + ``logprobs`` with ``n``: only choice 0's engine request
    computes the prompt logprobs (each one is a full prefill without the prefix cache); every
    choice reports them, as a single choice does, and a stream's choices each carry them."""
    from specdial.engine.api import LogprobOptions
    from specdial.server.jobs import choices
    from specdial.server.runs import Job

    job = Job(0, None, [1, 2, 3], {"seed": 1}, None,
              logprobs=LogprobOptions(top_n=2, prompt_start=0), echo="abc")
    whole = choices([job, Job(1, None, [4], {}, None, logprobs=job.logprobs, echo="d")], 3,
                    whole=True)
    assert [j.logprobs.prompt_start for j in whole] == [0, None, None] * 2
    assert [j.prompt_logprobs_from for j in whole] == [None, 0, 0, None, 3, 3]
    assert all(j.logprobs.prompt_start == 0 for j in choices([job], 3))  # a stream
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 1.0,
            "seed": 3, "logprobs": 2, "echo": True}
    r = post(server, "/v1/completions", body).json()
    one, p = r["choices"][0]["logprobs"], r["usage"]["prompt_tokens"]
    many = post(server, "/v1/completions", {**body, "n": 3}).json()["choices"]
    events = stream_events(server, "/v1/completions", {**body, "n": 3})
    streamed = {}
    for e in events:
        c = e["choices"][0]
        if c["logprobs"]:
            streamed.setdefault(c["index"], []).extend(c["logprobs"]["token_logprobs"])
    assert len(many) == 3 and len(streamed) == 3
    for c in many:
        lp = c["logprobs"]
        assert c["text"].startswith(PROMPTS[0]) and "".join(lp["tokens"]) == c["text"]
        assert lp["tokens"][:p] == one["tokens"][:p]
        assert lp["token_logprobs"][:p] == pytest.approx(one["token_logprobs"][:p], abs=1e-4)
        assert [sorted(t) for t in lp["top_logprobs"][1:p]] == [
            sorted(t) for t in one["top_logprobs"][1:p]]
    for lps in streamed.values():
        assert lps[:p] == pytest.approx(one["token_logprobs"][:p], abs=1e-4)


def test_chat_tokens_and_bytes_join_to_the_content(server):
    for seed, stop in enumerate([None, ["e"], ["é", "\n"]]):
        body = {"model": NAME, "messages": [{"role": "user", "content": PROMPTS[1]}],
                "max_tokens": 20, "temperature": 1.0, "seed": seed, "stop": stop,
                "logprobs": True, "top_logprobs": 2}
        r = post(server, "/v1/chat/completions", body).json()["choices"][0]
        content = r["logprobs"]["content"]
        text = r["message"]["content"]
        assert "".join(c["token"] for c in content) == text
        assert bytes(b for c in content for b in c["bytes"]) == text.encode()


def _check_sglang_entries(out: dict) -> bool:
    """``out``'s output logprob entries join to its text and name a prefix of its output ids;
    True when a stop string left tokens out."""
    meta, text = out["meta_info"], out["text"]
    entries = meta["output_token_logprobs"]
    assert "".join(t for _, _, t in entries) == text, (entries, text)
    assert len(meta["output_top_logprobs"]) == len(entries)
    assert [t for _, t, _ in entries] == out["output_ids"][:len(entries)]
    return len(entries) < len(out["output_ids"])


def test_generate_and_engine_logprobs_join_to_the_text_after_stop_strings(server):
    """SGLang's ``output_token_logprobs`` (``/generate`` plain and streamed, the offline
    Engine) follow the text as the OpenAI routes' do: they end where a stop string cut it
    (multi-byte characters: tests/test_token_align.py)."""
    cut = 0
    for i, (prompt, stop) in enumerate((p, s) for p in PROMPTS for s in STOPS):
        sp = {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": i, "stop": stop}
        body = {"text": prompt, "sampling_params": sp, "return_logprob": True,
                "top_logprobs_num": 1, "return_text_in_logprobs": True}
        out = post(server, "/generate", body).json()
        cut += _check_sglang_entries(out)
        last = stream_events(server, "/generate", body)[-1]
        assert last["text"] == out["text"]
        _check_sglang_entries(last)
        osp = {**{k: v for k, v in sp.items() if k != "sampling_seed"}, "seed": i}
        offline = server.engine.generate(prompt, osp, return_logprob=True, top_logprobs_num=1,
                                         return_text_in_logprobs=True)
        assert offline["text"] == out["text"]
        _check_sglang_entries(offline)
        # without texts in the logprobs the entries end at the same place
        plain = server.engine.generate(prompt, osp, return_logprob=True)
        assert [e[1] for e in plain["meta_info"]["output_token_logprobs"]] == [
            e[1] for e in offline["meta_info"]["output_token_logprobs"]]
    assert cut >= 6  # stop strings did cut tokens off


# ------------------------------------------------------------------ logit_bias
def test_logit_bias_steers_greedy_decoding_on_every_endpoint(server):
    tok = server.engine.tokenizer
    target = tok.encode("x", add_special_tokens=False)[0]
    bias = {str(target): 100}
    r = post(server, "/v1/completions", {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 6,
                                         "temperature": 0, "logit_bias": bias}).json()
    assert r["choices"][0]["text"] == "x" * 6, r
    r = post(server, "/v1/chat/completions", {
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "temperature": 0, "logit_bias": bias}).json()
    assert r["choices"][0]["message"]["content"] == "x" * 5, r
    r = post(server, "/generate", {"text": PROMPTS[2], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "logit_bias": bias}}).json()
    assert r["output_ids"] == [target] * 4, r
    out = server.engine.generate(PROMPTS[2], {"max_new_tokens": 3, "logit_bias": {target: 100.0}})
    assert out["output_ids"] == [target] * 3
    # without the bias the model says something else
    plain = post(server, "/v1/completions", {"model": NAME, "prompt": PROMPTS[0],
                                             "max_tokens": 6, "temperature": 0}).json()
    assert plain["choices"][0]["text"] != "x" * 6


@pytest.mark.parametrize("bias, words", [
    ({"1000000": 1}, "vocabulary"), ({"5": 101}, "bias 101"), ({"5": -100.5}, "-100.5"),
    ({str(i): 1 for i in range(301)}, "301 entries"), ({"abc": 1}, "'abc'")])
def test_logit_bias_refusals_name_the_field(server, bias, words):
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = post(server, path, {"model": NAME, "max_tokens": 2, **body, "logit_bias": bias})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "logit_bias" and words in err["message"], err
    r = post(server, "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2,
                                                                    "logit_bias": bias}})
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"], r.text


# ------------------------------------------------------------------ /generate n > 1
def test_generate_n_2_is_seeded_like_completions(server):
    sp = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 7}
    two = post(server, "/generate", {"text": PROMPTS[0], "sampling_params": {**sp, "n": 2},
                                     "rid": "r"}).json()
    assert isinstance(two, list) and len(two) == 2
    assert [o["meta_info"]["id"] for o in two] == ["r-0", "r-1"]
    for j, out in enumerate(two):
        alone = post(server, "/generate", {"text": PROMPTS[0], "sampling_params": {
            **sp, "sampling_seed": choice_seed(7, j)}}).json()
        assert out["output_ids"] == alone["output_ids"]
    assert two[0]["output_ids"] != two[1]["output_ids"]
    # two prompts x n = 2: prompt-major, streamed with an index each
    many = post(server, "/generate", {"text": PROMPTS[:2], "sampling_params": {**sp, "n": 2}})
    assert [o["output_ids"] for o in many.json()[:2]] == [o["output_ids"] for o in two]
    assert len(many.json()) == 4
    events = stream_events(server, "/generate", {"text": PROMPTS[0],
                                                 "sampling_params": {**sp, "n": 2}})
    last = {e["index"]: e for e in events}
    assert [last[j]["output_ids"] for j in (0, 1)] == [o["output_ids"] for o in two]


# ------------------------------------------------------------------ /detokenize ids
def test_detokenize_refuses_ids_outside_the_vocabulary_as_generate_does(server):
    """The built-in tokenizer decodes an id past its vocabulary to "" (and 2**63 overflows),
    so without the check /detokenize answered 200 with an empty text."""
    vocab = server.engine.target.config.vocab_size
    ok = post(server, "/detokenize", {"tokens": [vocab - 1, 0]})
    assert ok.status_code == 200, ok.text
    for tokens in ([vocab], [1, -1], [10**9], [2**63], [[1, 2], [3, vocab]]):
        r = post(server, "/detokenize", {"tokens": tokens})
        assert r.status_code == 400, (tokens, r.text)
        err = r.json()["error"]
        assert err["param"] == "tokens" and err["code"] == "invalid_value", err
        assert f"[0, {vocab})" in err["message"], err
    # the same range as /generate's input_ids
    r = post(server, "/generate", {"input_ids": [vocab], "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and f"[0, {vocab})" in r.json()["error"]["message"], r.text
