"""A stop string ends the output at the token whose text completed it, whatever the speculative
depth: one verify emits several tokens, and the ones after the completing token are neither
output ids nor ``completion_tokens`` (nor logprobs), as with plain decoding (steps 0), where
each iteration emits one token (vLLM's multi-step output processor appends a multi-token step
one token at a time and stops at the first that finishes).

Every greedy request runs on engines at steps 0, fixed steps 3 and 5, adaptive steps, and a
draft tree (topk 4, 8 draft tokens), over the same random target with a near-copy draft model
(high acceptance, so verifies emit several tokens) and the built-in byte-level BPE tokenizer:

- the offline Engine: ``output_ids``, ``meta_info.completion_tokens`` and the text, against the
  count of the shortest output prefix whose text holds the stop string; also with
  ``no_stop_trim`` (the stop string kept in the text), ``min_tokens`` (an earlier occurrence does
  not count; reference: the text state fed one token at a time), logprobs; and the token rules:
  a stop token id in the middle of an accepted run and ``max_new_tokens``;
- HTTP (a live uvicorn per engine): ``usage.completion_tokens`` of /v1/completions and
  /v1/chat/completions, plain and streamed (``include_usage``), with ``n = 2``; SGLang
  ``/generate``'s ``output_ids`` and ``completion_tokens``, plain and streamed.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from greedy import greedy
from specdial.detokenize import IncrementalText, decode
from specdial.engine import Engine
from specdial.engine.stops import check_stop_strings
from test_engine_serving import build_text_models
from test_server_builtin_extras import stream_events
from test_server_fake_engine import LiveServer
from timeouts import scaled

KW = dict(max_running_requests=4, kv_cache_tokens=2048, page_size=8, log_interval_s=None)
CONFIGS = {
    "steps0": dict(speculative_adaptive=False, speculative_num_steps=0),
    "steps3": dict(speculative_adaptive=False, speculative_num_steps=3),
    "steps5": dict(speculative_adaptive=False, speculative_num_steps=5),
    "adaptive": dict(),
    "tree": dict(speculative_adaptive=False, speculative_num_steps=3, speculative_eagle_topk=4,
                 speculative_num_draft_tokens=8),
}
PROMPT = "def add(a, b):\n    return"
MAX_NEW = 48
NAME = "m"


@pytest.fixture(scope="module")
def engines():
    target, draft, tok = build_text_models(noise=0.01)
    built = {name: Engine.from_modules(target, draft, tok, **KW, **cfg)
             for name, cfg in CONFIGS.items()}
    yield built
    for engine in built.values():
        engine.shutdown()


@pytest.fixture(scope="module")
def ref(engines):
    """The steps-0 output of PROMPT without stop strings: ``(ids, text, tokenizer)``."""
    out = engines["steps0"].generate(PROMPT, greedy(MAX_NEW, ignore_eos=True))
    return out["output_ids"], out["text"], engines["steps0"].tokenizer


def completing(tok, ids: list[int], stop: str) -> int:
    """Tokens of the shortest prefix of ``ids`` whose text holds ``stop``."""
    return next(k for k in range(1, len(ids) + 1) if stop in decode(tok, ids[:k]))


def one_token_at_a_time(tok, ids: list[int], stop: str, min_tokens: int) -> int:
    """Where plain decoding's text state, fed one token per iteration, matches ``stop``."""
    state = IncrementalText(tok, [stop], min_tokens=min_tokens)
    for n in range(1, len(ids) + 1):
        state.update(ids[:n], final=False)
        if state.matched is not None:
            return n
    raise AssertionError(f"{stop!r} never matches after {min_tokens} tokens")


def stops_of(text: str) -> list[str]:
    """3-character stop strings at many places of ``text`` (their first occurrence counts)."""
    return list(dict.fromkeys(text[i:i + 3] for i in range(2, min(len(text), 90) - 3, 4)))


def test_check_stop_strings_keeps_the_emitted_tokens_up_to_the_completing_one(ref):
    """The check alone: per request, ``(id, keep)`` with keep the shortest prefix of the
    emitted tokens whose text matches; the text state and delta kept for reuse are those of
    that prefix; requests without a match (or stop strings) are not stopped."""
    ids, text, tok = ref
    stop = stops_of(text)[5]
    k = completing(tok, ids, stop)
    assert k >= 3

    def live(before: int, stops: list[str]) -> SimpleNamespace:
        state = IncrementalText(tok, stops)
        state.update(ids[:before], final=False)
        return SimpleNamespace(spec=SimpleNamespace(stop=stops), text=state,
                               output=list(ids[:before]))

    # request 1 emits k - 2 .. k + 3 (its stop completes at its 2nd emitted token), request 2
    # the same tokens without stop strings, request 3 tokens before the stop completes
    lives = {1: live(k - 2, [stop]), 2: live(k - 2, []), 3: live(0, [stop])}
    emitted = [ids[k - 2:k + 3], ids[k - 2:k + 3], ids[:k - 1]]
    offsets = np.cumsum([0] + [len(e) for e in emitted])
    check = check_stop_strings(lives, [1, 2, 3], np.array(sum(emitted, []), np.int64), offsets)
    assert check.stopped == [(1, 2)]
    state, delta = check.trials[1]
    assert state.matched == stop and lives[1].text.matched is None  # checked on a copy
    assert lives[1].text.sent + delta == text[:text.index(stop)]
    assert check.trials[3][0].matched is None and 2 not in check.trials
    finished = SimpleNamespace(reason="stop", stop_token_id=None)
    assert check.text_for(1, finished) == (state, delta)
    assert check.text_for(1, SimpleNamespace(reason="length", stop_token_id=None)) is None


def test_the_speculative_engines_emit_several_tokens_per_verify(engines):
    """Without it the other tests could not fail: a verify emitting one token never overshoots."""
    for name in ("steps3", "steps5", "tree"):
        meta = engines[name].generate(PROMPT, greedy(MAX_NEW, ignore_eos=True))["meta_info"]
        assert meta["spec_accept_length"] >= 2.0, (name, meta)


def test_output_ids_and_completion_tokens_end_at_the_completing_token(engines, ref):
    ids, text, tok = ref
    for stop in stops_of(text):
        k = completing(tok, ids, stop)
        for name, engine in engines.items():
            sp = greedy(MAX_NEW, ignore_eos=True, stop=[stop])
            out = engine.generate(PROMPT, sp)
            meta = out["meta_info"]
            assert out["text"] == text[:text.index(stop)], (name, stop)
            assert (meta["completion_tokens"], out["output_ids"]) == (k, ids[:k]), (name, stop)
            assert meta["finish_reason"] == {"type": "stop", "matched": stop}, (name, stop)
            kept = engine.generate(PROMPT, {**sp, "no_stop_trim": True})
            assert kept["text"] == text[:text.index(stop) + len(stop)], (name, stop)
            assert kept["output_ids"] == ids[:k], (name, stop)
    for engine in engines.values():
        stats = engine.stats()
        assert (stats.running, stats.kv_pages_used) == (0, 0)


def test_stream_chunks_and_logprobs_follow_the_kept_tokens(engines, ref):
    ids, text, tok = ref
    for stop in stops_of(text)[::3]:
        k = completing(tok, ids, stop)
        want = None
        for name, engine in engines.items():
            sp = greedy(MAX_NEW, ignore_eos=True, stop=[stop])
            chunks = list(engine.stream(PROMPT, sampling_params=sp))
            assert [t for c in chunks for t in c.token_ids] == ids[:k], (name, stop)
            assert "".join(c.text for c in chunks) == text[:text.index(stop)], (name, stop)
            assert chunks[-1].meta_info["completion_tokens"] == k
            out = engine.generate(PROMPT, sp, return_logprob=True, top_logprobs_num=1,
                                  return_text_in_logprobs=True)
            entries = out["meta_info"]["output_token_logprobs"]
            assert len(entries) <= k and len(out["meta_info"]["output_top_logprobs"]) == len(
                entries)
            assert "".join(e[2] for e in entries) == out["text"]
            got = [e[1] for e in entries]
            want = got if want is None else want
            assert got == want, (name, stop)


def test_min_tokens_skips_an_earlier_occurrence_at_every_depth(engines, ref):
    ids, text, tok = ref
    counts = {c: text.count(c) for c in set(text) if c.strip()}
    stop = max(counts, key=lambda c: (counts[c], c))
    assert counts[stop] >= 2, text
    first = completing(tok, ids, stop)
    for m in (first, first + 2):
        k = one_token_at_a_time(tok, ids, stop, m)
        assert k > first
        for name, engine in engines.items():
            out = engine.generate(PROMPT, greedy(MAX_NEW, ignore_eos=True, stop=[stop],
                                                 min_tokens=m))
            assert (out["meta_info"]["completion_tokens"], out["output_ids"]) == (k, ids[:k]), (
                name, m)


def test_token_rules_count_the_same_at_every_depth(engines, ref):
    """A stop token id in the middle of an accepted run ends the output at it; max_new_tokens
    is never overshot (the core caps each verify)."""
    ids, _, _ = ref
    stop_id = ids[len(ids) // 2]
    k = ids.index(stop_id) + 1
    for name, engine in engines.items():
        out = engine.generate(PROMPT, greedy(MAX_NEW, ignore_eos=True, stop_token_ids=[stop_id]))
        assert (out["meta_info"]["completion_tokens"], out["output_ids"]) == (k, ids[:k]), name
        for n in (1, 2, 7, 13):
            out = engine.generate(PROMPT, greedy(n, ignore_eos=True))
            assert (out["meta_info"]["completion_tokens"], out["output_ids"]) == (n, ids[:n])


def test_min_tokens_masks_a_stop_token_the_same_at_every_depth(engines, ref):
    """A stop token id masked by ``min_tokens`` (it cannot be sampled before that many tokens,
    at every draft position of a verify too) gives the steps-0 output at every depth."""
    ids, _, _ = ref
    stop_id = ids[len(ids) // 3]
    m = ids.index(stop_id) + 1  # its first occurrence is masked
    sp = greedy(MAX_NEW, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=m)
    want = engines["steps0"].generate(PROMPT, sp)
    assert want["output_ids"][:m - 1] == ids[:m - 1] and stop_id not in want["output_ids"][:m]
    for name, engine in engines.items():
        out = engine.generate(PROMPT, sp)
        assert out["output_ids"] == want["output_ids"], name
        assert out["meta_info"]["completion_tokens"] == len(want["output_ids"]), name


# ---------------------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def servers(engines):
    live = {name: LiveServer(engine, name=NAME) for name, engine in engines.items()}
    for s in live.values():
        s.__enter__()
    yield live
    for s in live.values():
        s.__exit__(None, None, None)


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=scaled(120))
    assert r.status_code == 200, r.text
    return r.json()


def http_counts(server, stop: str, messages: list[dict] | None) -> list[int]:
    """``usage.completion_tokens`` of a greedy completion (chat with ``messages``) with
    ``stop``: plain, streamed with ``include_usage``, and plain with ``n = 2`` (summed)."""
    path = "/v1/chat/completions" if messages else "/v1/completions"
    body = {"model": NAME, "max_tokens": MAX_NEW, "temperature": 0, "stop": [stop],
            "ignore_eos": True, **({"messages": messages} if messages else {"prompt": PROMPT})}
    plain = post(server, path, body)["usage"]["completion_tokens"]
    streamed = stream_events(server, path, {**body, "stream_options": {"include_usage": True}})
    two = post(server, path, {**body, "n": 2})["usage"]["completion_tokens"]
    return [plain, streamed[-1]["usage"]["completion_tokens"], two]


def test_openai_usage_is_the_same_at_every_depth(servers, ref):
    ids, text, tok = ref
    messages = [{"role": "user", "content": "add two numbers"}]
    chat = post(servers["steps0"], "/v1/chat/completions",
                {"model": NAME, "messages": messages, "max_tokens": MAX_NEW, "temperature": 0,
                 "ignore_eos": True})["choices"][0]["message"]["content"]
    for stop in stops_of(text)[::4]:
        k = completing(tok, ids, stop)
        for name, server in servers.items():
            assert http_counts(server, stop, None) == [k, k, 2 * k], (name, stop)
    for stop in stops_of(chat)[::4]:
        want = http_counts(servers["steps0"], stop, messages)
        assert want[0] < MAX_NEW and want[1:] == [want[0], 2 * want[0]], (stop, want)
        for name, server in servers.items():
            assert http_counts(server, stop, messages) == want, (name, stop)


def test_sglang_generate_output_ids_are_the_same_at_every_depth(servers, ref):
    ids, text, tok = ref
    for stop in stops_of(text)[::4]:
        k = completing(tok, ids, stop)
        sp = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "stop": [stop]}
        for name, server in servers.items():
            for body in ({"text": PROMPT, "sampling_params": sp},
                         {"text": PROMPT, "sampling_params": {**sp, "no_stop_trim": True}}):
                out = post(server, "/generate", body)
                assert (out["meta_info"]["completion_tokens"], out["output_ids"]) == (
                    k, ids[:k]), (name, stop)
                last = stream_events(server, "/generate", body)[-1]
                assert last["output_ids"] == ids[:k] and last["text"] == out["text"], name
            both = post(server, "/generate", {"text": PROMPT, "sampling_params": {**sp, "n": 2}})
            assert [o["meta_info"]["completion_tokens"] for o in both] == [k, k], (name, stop)
