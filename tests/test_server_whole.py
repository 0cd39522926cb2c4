"""Non-streaming responses take each engine request's chunks at its end (issue 32's HTTP path):
the server asks ``async_stream(whole=True)`` for them and streams keep ``whole`` off, on every
route; the latencies of such a run are measured at the chunks' ``emitted_s``, not at their
late arrival. The engine side (the same chunks, held until the end) is in
tests/test_engine_serving.py; through replica processes in tests/test_data_parallel.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import httpx
import pytest

from specdial.engine.api import StreamChunk
from specdial.server.metrics import ServerMetrics
from specdial.server.runs import Job, Run
from test_server_fake_engine import FakeEngine, LiveServer
from timeouts import scaled

ROUTES = [("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 6, "n": 2}),
          ("/v1/chat/completions", {"model": "m", "max_tokens": 6,
                                    "messages": [{"role": "user", "content": "hi"}]}),
          ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 6}})]


@pytest.mark.parametrize("stream", [False, True])
def test_non_streaming_requests_ask_for_whole_delivery(stream):
    engine = FakeEngine(delay=0.001)
    with LiveServer(engine, name="m") as server:
        for path, body in ROUTES:
            before = set(engine.submitted)
            r = httpx.post(server.url + path, json={**body, "stream": stream},
                           timeout=scaled(30))
            assert r.status_code == 200, r.text
            new = [engine.submitted[rid] for rid in set(engine.submitted) - before]
            assert new and all(s["whole"] is (not stream) for s in new), (path, new)


class _Stamped:
    """An engine whose chunks come all at once at the end, stamped 0.2 s, 0.5 s and 0.9 s
    after ``t0`` (what ``whole`` delivery hands over)."""

    def __init__(self, t0: float) -> None:
        self.t0, self.kwargs = t0, {}

    async def async_stream(self, prompt: Any = None, **kwargs: Any
                           ) -> AsyncIterator[StreamChunk]:
        self.kwargs = kwargs
        for k, (dt, fin) in enumerate(((0.2, False), (0.5, False), (0.9, True))):
            yield StreamChunk(0, "ab"[k % 2], [k + 1], fin,
                              {"type": "length", "length": 3} if fin else None,
                              {"completion_tokens": k + 1}, emitted_s=self.t0 + dt)


def test_latencies_of_a_whole_run_are_taken_at_emission():
    t0 = time.perf_counter()
    engine = _Stamped(t0)
    metrics = ServerMetrics(engine)
    job = Job(0, "x", None, {"max_new_tokens": 3}, None)

    async def main() -> Run:
        run = Run(engine, metrics, set(), [job], arrival=t0, whole=True)
        run.start()
        await run.wait_started()
        async for _ in run.events():
            pass
        return run

    run = asyncio.run(main())
    assert engine.kwargs["whole"] is True
    c = run.choices[0]
    assert c.first_token_s == pytest.approx(0.2) and c.last_token_s == pytest.approx(0.9)
    assert c.reason == "length" and c.completion_tokens == 3
    samples = {s.name: s.value for m in metrics.registry.collect() for s in m.samples}
    assert samples["specdial:time_to_first_token_seconds_sum"] == pytest.approx(0.2)
    assert samples["specdial:inter_token_latency_seconds_sum"] == pytest.approx(0.7)
    assert samples["specdial:e2e_request_latency_seconds_sum"] == pytest.approx(0.9)
