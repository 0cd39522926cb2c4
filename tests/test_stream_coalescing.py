"""Streams coalesce per wake-up (issue 32): the engine's hand-over to an event loop
(:mod:`specdial.engine.courier`: one wake per burst for all streams, every item since the last
take in one list) and a streaming HTTP response (:meth:`specdial.server.runs.Run.batches`,
:func:`specdial.server.openai_responses.sse_events`: the chunks of a choice that arrived
together make one event, a wake-up's events one write) keep the text, order, finish reasons,
usage and mid-stream errors of per-chunk delivery. Through the real engine and replica
processes: tests/test_dp_processes.py and tests/test_engine_serving.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import types
from typing import Any, AsyncIterator

import pytest

from specdial.engine.api import StreamChunk
from specdial.engine.courier import Box, burst, courier_for
from specdial.server.metrics import ServerMetrics
from specdial.server.openai_responses import sse_events
from specdial.server.runs import DONE, Job, Run
from timeouts import scaled


def _counting(loop: asyncio.AbstractEventLoop) -> list[int]:
    """Count ``loop.call_soon_threadsafe`` calls (the cross-thread wakes)."""
    calls = [0]
    real = loop.call_soon_threadsafe

    def counted(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        return real(*a, **k)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    return calls


def test_courier_wakes_once_per_burst_and_hands_over_everything_since_the_last_take():
    async def main() -> tuple[list[list[Any]], int]:
        loop = asyncio.get_running_loop()
        calls = _counting(loop)
        courier = courier_for(loop)
        assert courier_for(loop) is courier
        boxes = [Box() for _ in range(3)]

        def engine_thread() -> None:  # two iterations' bursts before the loop runs
            for it in range(2):
                for b, box in enumerate(boxes):
                    assert courier.deliver(box, [(it, b)])

        t = threading.Thread(target=engine_thread)
        t.start()
        t.join()
        taken = [await courier.take(box) for box in boxes]
        return taken, calls[0]

    taken, wakes = asyncio.run(main())
    assert taken == [[(0, b), (1, b)] for b in range(3)]  # all of them, in order
    assert wakes == 1  # one wake for six deliveries to three streams


def test_a_burst_holds_the_wake_until_its_end_while_the_loop_runs():
    async def main() -> tuple[list[int], int, list[list[Any]]]:
        loop = asyncio.get_running_loop()
        calls = _counting(loop)
        courier = courier_for(loop)
        boxes = [Box() for _ in range(4)]
        inside: list[int] = []

        def engine_thread() -> None:
            with burst():
                for box in boxes:
                    courier.deliver(box, ["x"])
                    time.sleep(0.01)  # the event loop runs meanwhile: nothing may wake it
                inside.append(calls[0])

        t = threading.Thread(target=engine_thread)
        t.start()
        taken = [await asyncio.wait_for(courier.take(box), scaled(5)) for box in boxes]
        while t.is_alive():
            await asyncio.sleep(0.005)
        return inside, calls[0], taken

    inside, wakes, taken = asyncio.run(main())
    assert inside == [0] and wakes == 1
    assert taken == [["x"]] * 4


def test_courier_take_waits_and_keeps_items_when_cancelled():
    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        courier, box = courier_for(loop), Box()
        waiter = asyncio.ensure_future(courier.take(box))
        await asyncio.sleep(0)
        assert not waiter.done()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        threading.Thread(target=courier.deliver, args=(box, ["a", "b"])).start()
        first = await asyncio.wait_for(courier.take(box), scaled(5))
        courier.deliver(box, ["c"])
        return first + await courier.take(box)

    assert asyncio.run(main()) == ["a", "b", "c"]


def test_courier_reports_a_closed_loop_on_every_delivery():
    loop = asyncio.new_event_loop()
    courier, box = courier_for(loop), Box()
    loop.close()
    assert courier.deliver(box, [1]) is False
    assert courier.deliver(box, [2]) is False  # not a stale "wake already scheduled"


class _Burst:
    """An engine whose chunks for one request all come in one step (what a response that
    fell behind finds): ``parts`` per request, the last one final; ``fail_after``: raise a
    ``RuntimeError`` after that many chunks instead of finishing."""

    def __init__(self, parts: list[str], fail_after: int | None = None) -> None:
        self.parts, self.fail_after = parts, fail_after

    async def async_stream(self, prompt: Any = None, **kwargs: Any
                           ) -> AsyncIterator[StreamChunk]:
        n = len(self.parts)
        for k, text in enumerate(self.parts):
            if k == self.fail_after:
                raise RuntimeError("the engine loop failed: boom")
            fin = k == n - 1
            yield StreamChunk(0, text, [ord(ch) for ch in text], fin,
                              {"type": "length", "length": n} if fin else None,
                              {"prompt_tokens": 1, "completion_tokens": k + 1})


def _pieces(engine: Any, jobs: int, chat: bool = False) -> list[str]:
    """What ``sse_events`` writes for a run of ``jobs`` choices on ``engine``, piece by
    piece (each piece is one write to the client)."""
    state = types.SimpleNamespace(model_name="m", token_bytes=None, decode=None)

    async def main() -> list[str]:
        run = Run(engine, ServerMetrics(engine), set(),
                  [Job(i, "x", None, {"max_new_tokens": 4}, None) for i in range(jobs)], 0.0)
        run.start()
        await run.wait_started()
        return [p async for p in sse_events(state, run, chat, True)]  # type: ignore[arg-type]

    return asyncio.run(main())


def _events(piece: str) -> list[Any]:
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:])
            for e in piece.split("\n\n") if e]


def test_a_burst_of_chunks_is_one_event_per_choice_and_one_write():
    pieces = _pieces(_Burst(["ab", "c", "de", "f"]), jobs=2)
    body, tail = pieces[-2], pieces[-1]
    events = _events(body)
    assert [(e["choices"][0]["index"], e["choices"][0]["text"],
             e["choices"][0]["finish_reason"]) for e in events] == [
        (0, "abcdef", "length"), (1, "abcdef", "length")]
    usage, done = _events(tail)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert done == "[DONE]"
    joined = {}  # the text a client joins from all the events equals the engine's
    for p in pieces:
        for e in _events(p):
            if e != "[DONE]" and e["choices"]:
                c = e["choices"][0]
                joined[c["index"]] = joined.get(c["index"], "") + c["text"]
    assert joined == {0: "abcdef", 1: "abcdef"}


def test_chat_burst_keeps_the_role_first_and_the_finish_reason_last():
    pieces = _pieces(_Burst(["ab", "cd"]), jobs=1, chat=True)
    deltas = [(e["choices"][0]["delta"], e["choices"][0]["finish_reason"])
              for p in pieces for e in _events(p) if e != "[DONE]" and e["choices"]]
    assert deltas == [({"role": "assistant", "content": ""}, None),
                      ({"content": "abcd"}, None), ({}, "length")]


def test_an_error_after_chunks_of_the_same_wake_up_comes_after_their_text():
    pieces = _pieces(_Burst(["ab", "cd", "ef"], fail_after=2), jobs=1)
    events = [e for p in pieces for e in _events(p)]
    assert events[0]["choices"][0]["text"] == "abcd"  # written before the error
    assert "error" in events[1] and "boom" in events[1]["error"]["message"]
    assert events[-1] == "[DONE]"


def test_generate_stream_burst_is_one_cumulative_event_per_output():
    from specdial.engine.output import OutputAccumulator
    from specdial.server.sglang_api import _events as generate_events  # the route's writer

    engine = _Burst(["ab", "c", "de"])

    async def main() -> list[str]:
        run = Run(engine, ServerMetrics(engine), set(),
                  [Job(i, "x", None, {"max_new_tokens": 3}, None) for i in range(2)], 0.0)
        run.start()
        await run.wait_started()
        outs = [OutputAccumulator([]) for _ in range(2)]
        return [p async for p in generate_events(run, outs, lambda i: outs[i].result())]

    pieces = asyncio.run(main())
    events = [_events(p) for p in pieces]
    assert [[(e["text"], e["meta_info"]["finish_reason"]["type"]) for e in ev if e != "[DONE]"]
            for ev in events] == [[("abcde", "length"), ("abcde", "length")], []]
    assert events[-1] == ["[DONE]"]



def test_engine_streams_wake_their_event_loop_once_per_engine_turn_not_per_request():
    """Four concurrent ``Engine.async_stream`` s on one loop: the engine thread wakes the loop
    at most once per engine-loop turn for all of them (a hand-over per request would take four
    per decode iteration), and every stream still gets all its tokens, greedy as alone."""
    from specdial.engine import Engine

    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    with Engine(model_path=None, log_interval_s=None, speculative_adaptive=False,
                speculative_num_steps=1) as engine:
        alone = [engine.generate(p, params)["output_ids"] for p in ("a", "b", "c", "d")]

        async def main() -> tuple[list[list[int]], int, int]:
            calls = _counting(asyncio.get_running_loop())
            turns = engine.loop_turns

            async def one(p: str) -> list[int]:
                return [t async for ch in engine.async_stream(p, sampling_params=params)
                        for t in ch.token_ids]

            outs = await asyncio.gather(*(one(p) for p in ("a", "b", "c", "d")))
            return outs, calls[0], engine.loop_turns - turns

        outs, wakes, turns = asyncio.run(main())
    assert outs == alone
    # at most one wake per turn, plus one per submission answered in a turn of its own; a
    # wake per request per turn read 56 for 14 turns here, this 16
    assert 0 < wakes <= turns + 4, (wakes, turns)
