"""End to end: the server over the REAL Engine (tiny random models with the built-in tokenizer,
float32, CPU) against a live uvicorn, with the official ``openai`` client.

Skipped until ``specdial.Engine`` provides the serving contract of ``specdial.engine.api``
(``async_stream``, ``stats``, ``shutdown(drain)``: the continuous-batching Engine of issue 5).
What they check, for the lead:

- greedy outputs over HTTP (completions, chat, streaming) equal a speculation-off server's;
- 32 concurrent requests all complete, with the same greedy outputs as one at a time;
- a client disconnecting mid-stream frees its slot and KV pages (``stats()``);
- a full queue answers 503 and the server keeps serving;
- the adaptive policy inside serving (issue 5): with a config whose slot for batch sizes >= 8
  has candidates [0, 3], concurrent requests whose drafter accepts everything (the drafter is a
  copy of the target: the stand-in for code prompts) keep that slot at 3 while a random
  drafter (hard prompts) drives it to 0, read from ``/metrics``; at concurrency 1 the steps of
  slot 1 reach >= 3;
- preemption: a KV pool too small for the load, everything completes with unchanged outputs;
- ``specdial serve`` as a process: health, a completion, SIGTERM -> exit status 0.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import httpx
import openai
import pytest

from specdial.engine import Engine
from specdial.server.config import ServeConfig
from serve_process import serve_argv, start_server
from test_server_cli import save_tiny_model
from test_server_fake_engine import LiveServer
from timeouts import scaled

pytestmark = pytest.mark.skipif(
    not hasattr(Engine, "async_stream"),
    reason="needs the continuous-batching Engine (issue 5): Engine.async_stream/stats")

NAME = "tiny"
PROMPTS = ["def add(a, b):\n    return", "import os\nimport", "class Point:\n    def",
           "for i in range(10):\n", "x = [1, 2, 3]\nprint(", "# a comment\n"]
# One policy decision after 16 verifies of a slot, the next after 32 (at steps 0 the ema policy
# probes the next candidate at each decision, so runs stay below 32 verifies per slot).
ADAPTIVE = {"ema_alpha": 0.5, "update_interval": 16, "warmup_batches": 0,
            "down_hysteresis": 0.0, "up_hysteresis": 0.0, "ceiling_coeff": 0.0,
            "1": {"candidate_steps": [1, 3, 5]}, "8": {"candidate_steps": [0, 3]}}
COMMON = dict(max_running_requests=16, context_length=256, page_size=16)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    mk = tmp_path_factory.mktemp
    target = save_tiny_model(mk("e2e_target"), seed=20)
    config = mk("e2e_config") / "adaptive.json"
    config.write_text(json.dumps(ADAPTIVE))
    return {"target": target,
            "noisy": save_tiny_model(mk("e2e_noisy"), seed=21, perturb_of=target, noise=0.01),
            "same": save_tiny_model(mk("e2e_same"), seed=22, perturb_of=target, noise=0.0),
            "random": save_tiny_model(mk("e2e_random"), seed=23),
            "config": config}


def build(dirs, drafter=None, **kw):
    cfg = ServeConfig(model_path=str(dirs["target"]),
                      draft_model_path=None if drafter is None else str(dirs[drafter]),
                      speculative_adaptive_config=str(dirs["config"]), **{**COMMON, **kw})
    return cfg.build_engine()


@pytest.fixture(scope="module")
def plain(dirs):
    with LiveServer(build(dirs), name=NAME) as server:
        yield server


@pytest.fixture(scope="module")
def spec(dirs):
    with LiveServer(build(dirs, "noisy"), name=NAME) as server:
        yield server


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=scaled(120.0))


def complete(server, prompt, n=24, **kw):
    with client(server) as c:
        return c.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0,
                                    **kw)


def metric(server, name, labels=""):
    """The value of the sample ``name`` whose labels include ``labels`` (``'{k="v"}'``)."""
    from specdial.bench.driver import parse_prometheus

    text = httpx.get(server.url + "/metrics", timeout=scaled(30)).text
    want = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    for lab, value in parse_prometheus(text).get(name, []):
        if all(lab.get(k) == v for k, v in want.items()):
            return value
    return None


def test_greedy_equals_speculation_off(plain, spec):
    for prompt in PROMPTS[:3]:
        want = complete(plain, prompt).choices[0].text
        got = complete(spec, prompt)
        assert got.choices[0].text == want
        assert got.usage.completion_tokens <= 24
    with client(spec) as c:
        chunks = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24,
                                      temperature=0, stream=True)
        streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert streamed == complete(plain, PROMPTS[0]).choices[0].text
    messages = [{"role": "user", "content": "Write a function."}]
    with client(plain) as a, client(spec) as b:
        ra = a.chat.completions.create(model=NAME, messages=messages, max_tokens=16,
                                       temperature=0)
        rb = b.chat.completions.create(model=NAME, messages=messages, max_tokens=16,
                                       temperature=0)
    assert ra.choices[0].message.content == rb.choices[0].message.content
    assert metric(spec, "specdial:spec_decode_num_drafts_total") > 0


def test_32_concurrent_requests_complete_with_unchanged_outputs(spec, plain):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    singles = {p: complete(plain, p, n=16).choices[0].text for p in PROMPTS}

    async def main():
        async with openai.AsyncOpenAI(base_url=spec.url + "/v1", api_key="unused",
                                      max_retries=0, timeout=scaled(300.0)) as c:
            rs = await asyncio.gather(*(c.completions.create(
                model=NAME, prompt=p, max_tokens=16, temperature=0) for p in prompts))
            return [r.choices[0].text for r in rs]

    assert asyncio.run(main()) == [singles[p] for p in prompts]
    stats = spec.engine.stats()
    assert stats.running == 0 and stats.queued == 0 and stats.kv_pages_used == 0


def test_disconnect_frees_the_request(spec):
    with httpx.stream("POST", spec.url + "/v1/completions", timeout=scaled(60),
                      json={"prompt": PROMPTS[1], "max_tokens": 200, "stream": True}) as r:
        assert next(r.iter_lines()).startswith("data: ")
    deadline = time.monotonic() + scaled(30)
    while spec.engine.stats().running or spec.engine.stats().kv_pages_used:
        assert time.monotonic() < deadline, spec.engine.stats()
        time.sleep(0.05)
    assert complete(spec, PROMPTS[0], n=4).choices[0].text


def test_full_queue_is_503(dirs):
    engine = build(dirs, "noisy", max_running_requests=1, max_queued_requests=1)
    with LiveServer(engine, name=NAME) as server:
        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=scaled(120)) as c:
                return await asyncio.gather(*(c.post("/v1/completions", json={
                    "prompt": PROMPTS[0], "max_tokens": 120}) for _ in range(4)))

        codes = sorted(r.status_code for r in asyncio.run(main()))
        assert codes[0] == 200 and codes[-1] == 503
        assert complete(server, PROMPTS[0], n=4).choices[0].text is not None


def _slot_steps_after(dirs, drafter, concurrency, max_tokens):
    """Steps of slots 1 and 8 from /metrics after ``concurrency`` greedy requests, initial
    steps 1 (slot 1 starts at 1, slot 8 at its middle candidate 3). The requests come as one
    completion with a list of prompts, so they reach the engine together: as separate
    connections, how many verifies ran at batch >= 8 depended on how fast a loaded server
    accepted them (the random case has 16..29 of them to spare)."""
    engine = build(dirs, drafter, speculative_initial_steps=1)
    with LiveServer(engine, name=NAME) as server:
        with client(server) as c:
            r = c.completions.create(model=NAME, max_tokens=max_tokens, temperature=0, prompt=[
                PROMPTS[i % len(PROMPTS)] for i in range(concurrency)])
        assert len(r.choices) == concurrency
        return {slot: metric(server, "specdial:spec_decode_num_steps", f'{{slot="{slot}"}}')
                for slot in (1, 8)}


def test_adaptive_policy_acts_inside_serving(dirs):
    # "code prompts": every draft accepted, 4 tokens per verify: ~30 verifies at batch 12
    assert _slot_steps_after(dirs, "same", concurrency=12, max_tokens=120)[8] == 3
    # "hard prompts": nothing accepted, 1 token per verify: 16..29 verifies at batch 12
    assert _slot_steps_after(dirs, "random", concurrency=12, max_tokens=30)[8] == 0
    # concurrency 1: slot 1 climbs from 1 to 3 at its decision after 16 verifies (2 tokens each)
    assert _slot_steps_after(dirs, "same", concurrency=1, max_tokens=60)[1] >= 3


def test_preemption_keeps_outputs(dirs, plain):
    engine = build(dirs, "noisy", kv_cache_tokens=512)
    with LiveServer(engine, name=NAME) as server:
        async def main():
            async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                          max_retries=0, timeout=scaled(300.0)) as c:
                rs = await asyncio.gather(*(c.completions.create(
                    model=NAME, prompt=p, max_tokens=100, temperature=0) for p in PROMPTS * 2))
                return [r.choices[0].text for r in rs]

        got = asyncio.run(main())
        print("preemptions:", metric(server, "specdial:num_preemptions_total"))
    want = [complete(plain, p, n=100).choices[0].text for p in PROMPTS * 2]
    assert got == want


def test_serve_process_health_completion_and_sigterm(dirs, tmp_path):
    log = tmp_path / "serve.log"
    proc, port = start_server(serve_argv(
        "--model-path", str(dirs["target"]), "--draft-model-path", str(dirs["noisy"]),
        "--served-model-name", NAME, "--max-running-requests", "4"), log)
    url = f"http://127.0.0.1:{port}"
    try:
        r = httpx.post(url + "/v1/completions", timeout=scaled(60),
                       json={"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 8
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=scaled(60))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-3000:]
