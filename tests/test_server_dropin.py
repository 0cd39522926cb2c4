"""Issue 13 end to end: the server over the REAL Engine (a tiny random Llama with the built-in
tokenizer, a perturbed copy as draft model, adaptive steps) against a live uvicorn, driven by
the clients users bring: the official ``openai`` client (logprobs, echo, n, token-id prompts),
lm-evaluation-harness's exact ``local-completions`` loglikelihood payload and its remote
tokenizer probes, and SGLang's ``/generate`` / ``/server_info`` requests as its adaptive
speculation tests send them."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest
import torch
import transformers

from specdial.server.config import ServeConfig
from test_server_cli import save_tiny_model
from test_server_fake_engine import LiveServer
from timeouts import scaled

NAME = "tiny"
TIMEOUT = httpx.Timeout(scaled(120.0))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target = save_tiny_model(tmp_path_factory.mktemp("dropin_target"), seed=31)
    draft = save_tiny_model(tmp_path_factory.mktemp("dropin_draft"), seed=32, perturb_of=target,
                            noise=0.02)
    return {"target": target, "draft": draft}


@pytest.fixture(scope="module")
def hf(dirs):
    return transformers.LlamaForCausalLM.from_pretrained(dirs["target"]).eval()


@pytest.fixture(scope="module")
def server(dirs):
    cfg = ServeConfig(model_path=str(dirs["target"]), draft_model_path=str(dirs["draft"]),
                      max_running_requests=8, context_length=256, log_interval_s=0)
    with LiveServer(cfg.build_engine(), name=NAME) as s:
        s.app.state.specdial.server_args = {"model_path": str(dirs["target"])}
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=scaled(120.0)) as c:
        yield c


def tok(server):
    return server.engine.tokenizer


def ref_logprobs(hf, ids):
    """transformers' log_softmax over ``ids``: row ``i`` predicts ``ids[i + 1]``."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=TIMEOUT)


# ------------------------------------------------------------------ openai client
def test_completion_logprobs_match_transformers(client, server, hf):
    prompt = "def add(a, b):\n    return"
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                  logprobs=2)
    choice = r.choices[0]
    lp = choice.logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == 8
    ids = tok(server).encode(prompt)
    out = tok(server).encode(prompt + choice.text)[len(ids):]
    ref = ref_logprobs(hf, ids + out)
    for i, (t, v, top) in enumerate(zip(out, lp.token_logprobs, lp.top_logprobs)):
        assert v == pytest.approx(ref[len(ids) - 1 + i, t].item(), abs=1e-4)
        assert max(top.values()) == pytest.approx(v, abs=1e-6)  # greedy: chosen is the max
        assert 2 <= len(top) <= 3
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_chat_logprobs_and_top_logprobs(client):
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and "".join(c.token for c in content) == \
        r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        # a token's own bytes (issue 25): a stray byte of a random model shows as U+FFFD
        assert c.bytes == list(c.token.encode()) or "\ufffd" in c.token or not c.token
    text = r.choices[0].message.content
    assert bytes(b for c in content for b in c.bytes).decode("utf-8", "replace") == text
    stream = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=1, stream=True)
    streamed = [c for ch in stream for choice in ch.choices if choice.logprobs
                for c in choice.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]


def test_echo_with_token_id_prompts(client, server, hf):
    ids = [tok(server).encode("import os\nimport"), tok(server).encode("class A:")]
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=3, temperature=0,
                                  logprobs=1, echo=True)
    assert [c.index for c in r.choices] == [0, 1]
    for prompt, choice in zip(ids, r.choices):
        lp = choice.logprobs
        assert choice.text.startswith(tok(server).decode(prompt))
        assert len(lp.tokens) == len(prompt) + 3
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = ref_logprobs(hf, prompt)
        for q in range(1, len(prompt)):
            assert lp.token_logprobs[q] == pytest.approx(ref[q - 1, prompt[q]].item(), abs=1e-4)
    assert r.usage.prompt_tokens == sum(len(p) for p in ids)


def test_n_choices_independent_and_seeded(client):
    kw = dict(model=NAME, prompt="x = ", max_tokens=8, temperature=1.0)
    r = client.completions.create(n=4, seed=5, **kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # distinct seeds per choice
    again = client.completions.create(n=4, seed=5, **kw)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts
    single = client.completions.create(n=1, seed=5, **kw)
    assert single.choices[0].text == texts[0]  # choice 0 keeps the seed
    assert r.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "q"}],
                                          n=2, max_tokens=4, temperature=0)
    assert [c.message.content for c in chat.choices][0] == chat.choices[1].message.content
    stream = client.completions.create(n=3, seed=5, stream=True, **kw)
    got: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            got[c.index] = got.get(c.index, "") + c.text
    assert [got[i] for i in range(3)] == texts[:3]


# ------------------------------------------------------------------ lm-evaluation-harness
def test_lm_eval_loglikelihood_payload(server, hf):
    """``LocalCompletionsAPI._create_payload(generate=False)`` with tokenized requests (its
    default): a batch of token-id prompts, and ``parse_logprobs`` over the response."""
    context = tok(server).encode("The answer is")
    continuations = [tok(server).encode(" yes"), tok(server).encode(" no")]
    prompts = [context + c for c in continuations]
    payload = {"model": NAME, "prompt": prompts, "temperature": 0, "max_tokens": 1,
               "logprobs": 1, "seed": 1234, "echo": True}
    r = post(server, "/v1/completions", payload)
    assert r.status_code == 200, r.text
    out = r.json()
    # lm-eval's parse_logprobs, verbatim in effect
    results = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]),
                              [len(context)] * 2):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(t == max(top.values()) for t, top in zip(lps, tops))
        results.append((sum(lps), greedy))
    for (value, greedy), cont, prompt in zip(results, continuations, prompts):
        ref = ref_logprobs(hf, prompt)
        want = sum(ref[len(context) - 1 + i, t].item() for i, t in enumerate(cont))
        assert value == pytest.approx(want, abs=1e-3)
        want_greedy = all(ref[len(context) - 1 + i].argmax().item() == t
                          for i, t in enumerate(cont))
        assert greedy == want_greedy
        assert math.isfinite(value)


def test_lm_eval_remote_tokenizer_endpoints(server):
    """What ``check_remote_tokenizer_support`` / ``RemoteTokenizer`` read."""
    info = httpx.get(server.url + "/tokenizer_info", timeout=TIMEOUT).json()
    assert "eos_token" in info and info["model_max_length"] == 256
    t = post(server, "/tokenize", {"prompt": "test", "add_special_tokens": False}).json()
    assert t["tokens"] == tok(server).encode("test", add_special_tokens=False)
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 256
    d = post(server, "/detokenize", {"tokens": t["tokens"]}).json()
    assert d["prompt"] == d["text"] == "test"
    many = post(server, "/v1/tokenize", {"prompt": ["a", "bc"]}).json()
    assert many["count"] == [len(x) for x in many["tokens"]]
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 0
    assert post(server, "/detokenize", {"tokens": "x"}).status_code == 400
    assert httpx.get(server.url + "/version", timeout=TIMEOUT).json()["version"]


# ------------------------------------------------------------------ SGLang native API
def test_generate_text_and_input_ids(server):
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    a = post(server, "/generate", {"text": "def f(x):", "sampling_params": sp}).json()
    ids = tok(server).encode("def f(x):")
    b = post(server, "/generate", {"input_ids": ids, "sampling_params": sp}).json()
    assert a["text"] == b["text"] and a["output_ids"] == b["output_ids"]
    m = a["meta_info"]
    assert m["completion_tokens"] == 12 and m["prompt_tokens"] == len(ids)
    assert m["finish_reason"] == {"type": "length", "length": 12}
    assert m["spec_verify_ct"] >= 1 and m["id"] and m["cached_tokens"] == 0
    batch = post(server, "/generate", {"input_ids": [ids, ids[:2]], "sampling_params": sp,
                                       "return_logprob": True, "top_logprobs_num": 2,
                                       "logprob_start_len": 0,
                                       "return_text_in_logprobs": True}).json()
    assert isinstance(batch, list) and batch[0]["output_ids"] == a["output_ids"]
    lp = batch[0]["meta_info"]
    assert [t for _, t, _ in lp["output_token_logprobs"]] == a["output_ids"]
    assert [t for _, t, _ in lp["input_token_logprobs"]] == ids
    assert lp["input_token_logprobs"][0][0] is None
    assert len(lp["output_top_logprobs"][0]) == 2


def test_generate_stream_is_cumulative(server):
    body = {"text": "import os\n", "sampling_params": {"temperature": 0, "max_new_tokens": 10},
            "stream": True}
    chunks = []
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=TIMEOUT) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
            elif line == "data: [DONE]":
                chunks.append(None)
    assert chunks[-1] is None and len(chunks) >= 2
    texts = [c["text"] for c in chunks[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    whole = post(server, "/generate", {**body, "stream": False}).json()
    assert texts[-1] == whole["text"]


def test_generate_errors_name_the_field(server):
    r = post(server, "/generate", {"text": "x", "sampling_params": {"n": 0}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.n"
    r = post(server, "/generate", {"text": ["x", "y"], "sampling_params": [{"n": 2}, {"n": 3}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.n"
    r = post(server, "/generate", {"text": "x", "sampling_params": {"bogus": 1}})
    assert r.json()["error"]["code"] == "unrecognized_parameter"
    r = post(server, "/generate", {"text": "x", "input_ids": [1]})
    assert r.status_code == 400
    r = post(server, "/generate", {"text": "x", "image_data": "y"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "image_data"


def test_server_info_reports_the_serving_slot(server):
    post(server, "/generate", {"text": "def g():", "sampling_params": {
        "temperature": 0, "max_new_tokens": 16, "ignore_eos": True}})
    info = httpx.get(server.url + "/server_info", timeout=TIMEOUT).json()
    state = info["internal_states"][0]
    slots = state["slots"]
    assert slots and all({"lower_bound", "steps", "ema_accept_len", "verify_count"} <= set(s)
                         for s in slots)
    bs = state["last_decode_batch_size"]
    serving = [s for s in slots if s["lower_bound"] <= bs][-1]
    assert state["speculative_num_steps"] == serving["steps"]
    # SGLang's draft-tree fields (issue 29): a chain verifies its steps + 1 tokens
    assert (state["speculative_eagle_topk"], state["speculative_num_draft_tokens"]) == (
        1, state["speculative_num_steps"] + 1)
    assert info["speculative_eagle_topk"] == 1
    assert state["avg_spec_accept_length"] >= 1.0
    assert info["model_path"] and info["version"]
    assert httpx.get(server.url + "/get_server_info", timeout=TIMEOUT).json()[
        "internal_states"][0]["speculative_num_steps"] == state["speculative_num_steps"]
