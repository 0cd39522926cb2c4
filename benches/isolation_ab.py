"""A/B of what one big non-streaming logprobs request does to its neighbours (issue: no request
can hurt another), on the built-in models behind an in-process uvicorn (tests' LiveServer).

The big request: ``/v1/completions`` with ``n`` choices (default 16) of a 600-token prompt,
``echo``, ``logprobs`` 20, ``max_tokens`` 1 (a 10 MB body). Beside it: a ``/health`` probe every
50 ms, and 8-token greedy "innocent" completions one after another. Per round and arm: the big
request's seconds, the innocents' largest latency, the largest ``/health`` latency.

Arms (``--what``):

- ``encode``: A = the body built and JSON-encoded in a thread, in parts
  (:mod:`specdial.server.big_json`); B = ``JSONResponse`` on the event loop (before).
- ``share``: A = the prompt logprobs computed once for the ``n`` choices
  (:func:`specdial.server.jobs.choices` with ``whole``); B = once per choice (before).

Rounds alternate A, B; medians printed. Usage::

    .venv/bin/python benches/isolation_ab.py --what share --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


async def _round(url: str, n: int, reps: int) -> tuple[float, float, float]:
    async with httpx.AsyncClient(timeout=900) as c:
        stop, health = asyncio.Event(), [0.0]

        async def tick() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                await c.get(url + "/health")
                health[0] = max(health[0], time.perf_counter() - t0)
                await asyncio.sleep(0.05)

        ticker = asyncio.create_task(tick())
        t0 = time.perf_counter()
        big = asyncio.create_task(c.post(url + "/v1/completions", json={
            "prompt": "x = 1\n" * reps, "max_tokens": 1, "n": n, "echo": True, "logprobs": 20,
            "temperature": 1}))
        await asyncio.sleep(1)
        innocent = 0.0
        while not big.done():
            t1 = time.perf_counter()
            r = await c.post(url + "/v1/completions", json={
                "prompt": "def f(x):", "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            innocent = max(innocent, time.perf_counter() - t1)
        r = await big
        assert r.status_code == 200, r.text[:300]
        seconds = time.perf_counter() - t0
        stop.set()
        await ticker
        return seconds, innocent, health[0]


def _arms(what: str) -> dict[str, Any]:
    from fastapi.responses import JSONResponse

    import specdial.server.openai_api as oa

    if what == "encode":
        real = oa.json_response

        async def old(build: Any, status_code: int = 200) -> Any:
            return JSONResponse(build(), status_code=status_code)
        return {"A": lambda: setattr(oa, "json_response", real),
                "B": lambda: setattr(oa, "json_response", old)}
    choices = oa.choices
    return {"A": lambda: setattr(oa, "choices", choices),
            "B": lambda: setattr(oa, "choices", lambda jobs, n, whole=False: choices(jobs, n))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--what", choices=["encode", "share"], default="share")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--prompt-lines", type=int, default=300)
    args = ap.parse_args()
    from specdial.server.config import ServeConfig
    from test_server_fake_engine import LiveServer

    arms = _arms(args.what)
    got: dict[str, list[tuple[float, float, float]]] = {"A": [], "B": []}
    engine = ServeConfig(cpu_threads=1, log_interval_s=0).build_engine()
    try:
        with LiveServer(engine) as s:
            for rnd in range(args.rounds):
                for arm in ("A", "B"):
                    arms[arm]()
                    got[arm].append(asyncio.run(_round(s.url, args.n, args.prompt_lines)))
                    print(rnd, arm, "big %.1f s, innocent max %.2f s, /health max %.2f s"
                          % got[arm][-1], flush=True)
    finally:
        engine.shutdown()
    for arm, rows in got.items():
        med = [statistics.median(r[i] for r in rows) for i in range(3)]
        print(f"{arm}: medians big {med[0]:.1f} s, innocent max {med[1]:.2f} s, "
              f"/health max {med[2]:.2f} s")


if __name__ == "__main__":
    main()
