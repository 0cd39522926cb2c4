"""Issue 13's offline API (SGLang's ``Engine`` surface): ``async_generate``, ``generate(...,
stream=True)`` (cumulative dicts), ``stop`` inside ``sampling_params``, on the built-in models
(a real tokenizer) and the tiny ones (token ids)."""

from __future__ import annotations

import asyncio
import time

import pytest

from conftest import PROMPTS
from greedy import greedy
from specdial.engine import Engine
from specdial.engine.api import RequestError
from timeouts import scaled

KW = dict(max_running_requests=4, kv_cache_tokens=1024, page_size=8, log_interval_s=None)


@pytest.fixture(scope="module")
def builtin():
    engine = Engine(model_path=None, **KW)
    yield engine
    engine.shutdown()


def test_async_generate_equals_generate(tiny):
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, steps_schedule=[2, 0, 3], **KW)
    try:
        sp = greedy(10)
        want = engine.generate(input_ids=PROMPTS, sampling_params=sp)

        async def run():
            one = await engine.async_generate(input_ids=PROMPTS[0], sampling_params=sp)
            many = await engine.async_generate(input_ids=PROMPTS, sampling_params=sp,
                                               return_logprob=True)
            chunks = [d async for d in await engine.async_generate(
                input_ids=PROMPTS[1], sampling_params=sp, stream=True)]
            return one, many, chunks

        one, many, chunks = asyncio.run(run())
        assert one["output_ids"] == want[0]["output_ids"]
        assert [m["output_ids"] for m in many] == [w["output_ids"] for w in want]
        assert all(len(m["meta_info"]["output_token_logprobs"]) == 10 for m in many)
        assert chunks[-1]["output_ids"] == want[1]["output_ids"]
        assert all(b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
                   for a, b in zip(chunks, chunks[1:]))  # cumulative
        assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    finally:
        engine.shutdown()


def test_stop_in_sampling_params_and_stream(builtin):
    prompt = "def fibonacci(n):"
    full = builtin.generate(prompt, {"max_new_tokens": 40, "temperature": 0})
    text = full["text"]
    stop = text[8:12]  # a string the greedy output contains
    cut = builtin.generate(prompt, {"max_new_tokens": 40, "temperature": 0, "stop": stop})
    assert cut["text"] == text[:text.index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    same = builtin.generate(prompt, {"max_new_tokens": 40, "temperature": 0, "stop": [stop]})
    assert same["text"] == cut["text"]
    streamed = list(builtin.generate(prompt, {"max_new_tokens": 40, "temperature": 0,
                                              "stop": stop}, stream=True))
    assert streamed[-1]["text"] == cut["text"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(streamed, streamed[1:]))
    with pytest.raises(RequestError, match="stop"):
        list(builtin.stream(prompt, sampling_params={"stop": ["a"]}, stop=["b"]))
    with pytest.raises(RequestError, match="stop"):
        builtin.generate(prompt, {"stop": [""]})


def test_generate_stream_close_aborts(builtin):
    it = builtin.generate("import os", {"max_new_tokens": 200, "ignore_eos": True,
                                        "temperature": 0}, stream=True)
    first = next(it)
    assert first["output_ids"]
    it.close()
    deadline = time.monotonic() + scaled(2.5)
    while builtin.stats().running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert builtin.stats().running == 0 and builtin.stats().kv_pages_used == 0


def test_held_until_end_hands_over_each_request_once_at_its_end():
    """``generate`` / ``async_generate`` take a request's chunks when it ends: the sink holds
    the chunks before the last and hands them over, in order, with the item that ends them
    (or at once: ``Submitted``, an error)."""
    from specdial.engine.api import StreamChunk
    from specdial.engine.messages import Submitted
    from specdial.engine.requests import held_until_end

    got: list[list] = []
    sink = held_until_end(got.append)
    first = Submitted(7)
    sink(first)
    chunks = [StreamChunk(7, str(i), [i], finished=i == 2) for i in range(3)]
    sink(chunks[0])
    sink(chunks[1])
    assert got == [[first]]  # the chunks that do not finish it are held
    sink(chunks[2])
    assert got == [[first], chunks]
    err = RuntimeError("the engine loop failed")
    sink(err)
    assert got[-1] == [err]


@pytest.mark.parametrize("front", ["generate", "async_generate"])
def test_generate_wakes_its_caller_once_per_request_not_per_iteration(tiny, front,
                                                                      monkeypatch):
    """3 requests x 10 tokens (several decode iterations each): their consumer is handed items
    6 times (``Submitted`` and the end of each), and the outputs are the streamed ones."""
    import specdial.engine.requests as requests

    handed: list[int] = []
    held = requests.held_until_end
    monkeypatch.setattr(requests, "held_until_end",
                        lambda deliver: held(lambda items: (handed.append(len(items)),
                                                            deliver(items))))
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, steps_schedule=[1], **KW)
    try:
        sp = greedy(10)
        streamed = [[t for c in engine.stream(input_ids=p, sampling_params=sp)
                     for t in c.token_ids] for p in PROMPTS]
        handed.clear()
        if front == "generate":
            outs = engine.generate(input_ids=PROMPTS, sampling_params=sp)
        else:
            outs = asyncio.run(engine.async_generate(input_ids=PROMPTS, sampling_params=sp))
        assert [o["output_ids"] for o in outs] == streamed
        n = len(PROMPTS)
        assert len(handed) == 2 * n and sum(handed) >= 4 * n, handed  # several chunks each
    finally:
        engine.shutdown()
