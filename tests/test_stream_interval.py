"""``stream_interval`` (SGLang's ``--stream-interval``; issue 32): a streamed request's first
chunk with tokens goes out at once, every later chunk but the final carries at least
``stream_interval`` tokens, the final chunk always goes; what a consumer joins (text, token
ids, logprobs, usage) is what interval 1 and the non-streamed response give. Through the
Engine, the OpenAI and SGLang HTTP streams, an abort with tokens held, and data-parallel
replica processes. Validation: an int >= 1, the error naming the field."""

from __future__ import annotations

import time

import httpx
import pytest

import specdial
from specdial.config import EngineConfig
from specdial.engine.api import LogprobOptions
from specdial.server.config import ServeConfig
from test_server_builtin_extras import stream_events
from test_server_fake_engine import LiveServer
from timeouts import scaled

PROMPTS = ["def fibonacci(n):", "import os\nimport", "class Stack:\n    def"]
INTERVAL = 4
GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
FIXED = {"speculative_adaptive": False, "speculative_num_steps": 3}  # several tokens a verify


def _engine(interval: int, **extra) -> specdial.Engine:
    return specdial.Engine(model_path=None, max_running_requests=4, context_length=256,
                           cpu_threads=1, log_interval_s=None, stream_interval=interval,
                           **{**FIXED, **extra})


@pytest.fixture(scope="module")
def engines():
    one, four = _engine(1), _engine(INTERVAL)
    try:
        yield one, four
    finally:
        one.shutdown(drain=False)
        four.shutdown(drain=False)


def _check_sizes(sizes: list[int], interval: int) -> None:
    """The first chunk with tokens at once, the middle ones >= interval, the last any."""
    assert sizes and sizes[0] >= 1, sizes
    assert all(n >= interval for n in sizes[1:-1]), sizes


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4", None])
def test_stream_interval_must_be_an_int_of_at_least_one(bad):
    with pytest.raises(Exception, match="stream_interval must be an int >= 1") as info:
        EngineConfig(stream_interval=bad)
    assert repr(bad) in str(info.value)
    if bad is not None:  # `specdial serve`'s options (None there: the default)
        with pytest.raises(Exception, match="stream_interval"):
            ServeConfig(stream_interval=bad).build_engine()
    assert EngineConfig(stream_interval=8).stream_interval == 8
    assert EngineConfig().stream_interval == 1  # SGLang's default


def test_engine_stream_chunks_carry_the_interval_and_join_to_interval_one(engines):
    one, four = engines
    counts = [0, 0]
    for prompt in PROMPTS:
        lp = LogprobOptions(top_n=2)
        a = list(one.stream(prompt, sampling_params=GREEDY, logprobs=lp))
        b = list(four.stream(prompt, sampling_params=GREEDY, logprobs=lp))
        _check_sizes([len(c.token_ids) for c in b if c.token_ids], INTERVAL)
        counts[0], counts[1] = counts[0] + len(a), counts[1] + len(b)
        assert [t for c in b for t in c.token_ids] == [t for c in a for t in c.token_ids]
        assert "".join(c.text for c in b) == "".join(c.text for c in a)
        assert [x for c in b for x in c.logprobs] == [x for c in a for x in c.logprobs]
        assert [x for c in b for x in c.top_logprobs] == [x for c in a for x in c.top_logprobs]
        assert all(len(c.logprobs) == len(c.token_ids) for c in b)
        assert [c.finished for c in b] == [False] * (len(b) - 1) + [True]
        assert b[-1].finish_reason == a[-1].finish_reason
        assert b[-1].meta_info["completion_tokens"] == GREEDY["max_new_tokens"]
        whole = four.generate(prompt, sampling_params=GREEDY)
        assert whole["text"] == "".join(c.text for c in b)
        assert whole["output_ids"] == [t for c in b for t in c.token_ids]
    assert counts[1] < counts[0]  # fewer chunks, or the interval did nothing


def test_stop_strings_cut_the_same_text_with_held_chunks(engines):
    one, four = engines
    for prompt in PROMPTS:
        for stop in (["\n"], ["(", ":"], ["self"]):
            sp = {**GREEDY, "ignore_eos": False}
            a = list(one.stream(prompt, sampling_params=sp, stop=stop))
            b = list(four.stream(prompt, sampling_params=sp, stop=stop))
            _check_sizes([len(c.token_ids) for c in b if c.token_ids], INTERVAL)
            assert "".join(c.text for c in b) == "".join(c.text for c in a), stop
            assert [t for c in b for t in c.token_ids] == [t for c in a for t in c.token_ids]
            assert b[-1].finish_reason == a[-1].finish_reason


def test_an_abort_sends_the_held_tokens_with_its_final_chunk():
    """Interval 1000: after the first chunk every token is held; an abort's final chunk
    carries them (and their text), so the chunks join to ``completion_tokens``."""
    engine = _engine(1000)
    try:
        it = engine.stream(PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 200})
        first = next(it)
        assert len(first.token_ids) >= 1
        # tokens are held after the first chunk: wait for two more by count (a fixed sleep
        # could see none on a loaded machine, or all 200 on a fast one)
        deadline = time.monotonic() + scaled(30)
        while engine.stats().generation_tokens < len(first.token_ids) + 2:
            assert time.monotonic() < deadline, engine.stats()
            time.sleep(0.002)
        engine.abort(first.request_id)
        chunks = [first, *it]
        last = chunks[-1]
        assert last.finished and last.finish_reason["type"] == "abort", last.finish_reason
        tokens = [t for c in chunks for t in c.token_ids]
        assert len(tokens) == last.meta_info["completion_tokens"] < 200
        assert len(chunks) == 2 and len(last.token_ids) >= 1  # the held ones came with it
        text = "".join(c.text for c in chunks)
        assert engine.tokenizer.decode(tokens).startswith(text) and text
    finally:
        engine.shutdown(drain=False)


def test_http_streams_carry_the_interval_and_join_to_the_whole_response(engines):
    _, four = engines
    with LiveServer(four, name="m") as server:
        info = httpx.get(server.url + "/server_info", timeout=scaled(30)).json()
        assert info["stream_interval"] == INTERVAL
        for prompt in PROMPTS:
            body = {"model": "m", "prompt": prompt, "max_tokens": 40, "temperature": 0,
                    "ignore_eos": True, "logprobs": 1}
            whole = httpx.post(server.url + "/v1/completions", json=body,
                               timeout=scaled(120)).json()
            events = stream_events(server, "/v1/completions",
                             {**body, "stream_options": {"include_usage": True}})
            lps = [e["choices"][0]["logprobs"] for e in events
                   if e.get("choices") and e["choices"][0]["logprobs"]]
            _check_sizes([len(lp["tokens"]) for lp in lps if lp["tokens"]], INTERVAL)
            choice = whole["choices"][0]
            assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) \
                == choice["text"]
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                assert [x for lp in lps for x in lp[key]] == choice["logprobs"][key]
            assert events[-1]["usage"] == whole["usage"]
            # SGLang's /generate: cumulative events, completion_tokens grows by >= interval
            sg = {"text": prompt, "sampling_params": {"max_new_tokens": 40, "temperature": 0,
                                                      "ignore_eos": True}}
            sg_whole = httpx.post(server.url + "/generate", json=sg, timeout=scaled(120)).json()
            sg_events = stream_events(server, "/generate", sg)
            counts = [e["meta_info"]["completion_tokens"] for e in sg_events]
            _check_sizes([b - a for a, b in zip([0] + counts, counts)], INTERVAL)
            assert sg_events[-1]["text"] == sg_whole["text"]
            assert sg_events[-1]["output_ids"] == sg_whole["output_ids"]


def test_data_parallel_replica_processes_hold_chunks_too():
    engine = specdial.Engine(model_path=None, dp_size=2, log_interval_s=None,
                             max_running_requests=4, context_length=256,
                             stream_interval=INTERVAL, **FIXED)
    try:
        for prompt in PROMPTS[:2]:
            chunks = list(engine.stream(prompt, sampling_params=GREEDY))
            _check_sizes([len(c.token_ids) for c in chunks if c.token_ids], INTERVAL)
            whole = engine.generate(prompt, sampling_params=GREEDY)
            assert whole["output_ids"] == [t for c in chunks for t in c.token_ids]
            assert whole["text"] == "".join(c.text for c in chunks)
    finally:
        engine.shutdown(drain=False)
