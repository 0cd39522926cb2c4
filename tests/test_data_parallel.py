"""Data parallelism: two real replicas behind :class:`DataParallelEngine`, served over HTTP.

32 concurrent requests through the ``openai`` client all complete with the greedy outputs of
one engine alone (dp 2 replica processes vs dp 1), both replicas take a share, ``/metrics``
sums the replicas, abort reaches the right replica, and ``generate`` with a list keeps prompt
order; the in-process backend does the same. Faults: tests/test_dp_processes.py."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time

import httpx
import openai
import pytest

from specdial.launch.data_parallel import DataParallelEngine, aggregate_stats
from specdial.launch.replica_setup import replica_seed
from specdial.engine import Engine
from specdial.engine.api import EngineStats, RequestError
from specdial.generate_cmd import policy_description
from specdial.server.config import ServeConfig
from test_server_cli import save_tiny_model
from test_server_engine import metric
from test_server_fake_engine import LiveServer
from timeouts import scaled

NAME = "tiny"
PROMPTS = ["def add(a, b):\n    return", "import os\nimport", "class Point:\n    def",
           "for i in range(10):\n", "x = [1, 2, 3]\nprint(", "# a comment\n"]
COMMON = dict(max_running_requests=16, context_length=256, page_size=16)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target = save_tiny_model(tmp_path_factory.mktemp("dp_target"), seed=20)
    noisy = save_tiny_model(tmp_path_factory.mktemp("dp_noisy"), seed=21, perturb_of=target,
                            noise=0.01)
    return target, noisy


def _engine(dirs):
    target, noisy = dirs
    return ServeConfig(model_path=str(target), draft_model_path=str(noisy),
                       **COMMON).build_engine()


@pytest.fixture(scope="module")
def dp(dirs):
    target, noisy = dirs  # what serve --dp-size 2 builds
    engine = ServeConfig(model_path=str(target), draft_model_path=str(noisy), dp_size=2,
                         **COMMON).build_engine()
    assert isinstance(engine, Engine) and engine.data_parallel.dp_size == 2
    with LiveServer(engine, name=NAME) as server:
        yield server


def test_dp2_serves_32_concurrent_requests_none_lost(dp, dirs):
    engine: DataParallelEngine = dp.engine.data_parallel
    single = _engine(dirs)
    try:
        want = {p: single.generate(p, {"max_new_tokens": 16, "temperature": 0})["text"]
                for p in PROMPTS}
    finally:
        single.shutdown()
    before = [s.requests_finished for s in engine.replica_stats()]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]

    async def main():
        async with openai.AsyncOpenAI(base_url=dp.url + "/v1", api_key="unused",
                                      max_retries=0, timeout=scaled(300.0)) as c:
            return await asyncio.gather(*(c.completions.create(
                model=NAME, prompt=p, max_tokens=16, temperature=0) for p in prompts))

    results = asyncio.run(main())
    assert len(results) == 32
    for p, r in zip(prompts, results):
        assert r.choices[0].finish_reason in ("length", "stop")
        assert r.choices[0].text == want[p]
    after = [s.requests_finished for s in engine.replica_stats()]
    shares = [a - b for a, b in zip(after, before)]
    assert sum(shares) == 32 and min(shares) >= 8, shares  # least-loaded routing spreads them
    assert engine.inflight() == [0, 0]
    assert metric(dp, "specdial:num_requests_running") == 0
    total = sum(s.generation_tokens for s in engine.replica_stats())
    assert metric(dp, "specdial:generation_tokens_total") == total
    for i, s in enumerate(engine.replica_stats()):  # per replica, label dp_rank
        rank = f'{{dp_rank="{i}"}}'
        assert metric(dp, "specdial:replica_num_requests_finished_total", rank) == \
            s.requests_finished
        assert metric(dp, "specdial:replica_generation_tokens_total", rank) == \
            s.generation_tokens
        assert metric(dp, "specdial:replica_up", rank) == 1
        assert metric(dp, "specdial:router_requests_in_flight", rank) == 0
        assert metric(dp, "specdial:router_outstanding_tokens", rank) == 0


def test_generate_list_keeps_order_and_abort_routes(dp):
    engine: Engine = dp.engine
    outs = engine.generate(PROMPTS, {"max_new_tokens": 8, "temperature": 0})
    alone = [engine.generate(p, {"max_new_tokens": 8, "temperature": 0}) for p in PROMPTS]
    assert [o["text"] for o in outs] == [o["text"] for o in alone]
    it = engine.stream(PROMPTS[0], sampling_params={"max_new_tokens": 200, "temperature": 0,
                                                    "ignore_eos": True})
    first = next(it)
    engine.abort(first.request_id)
    last = first
    for last in it:
        pass
    assert last.finished and last.finish_reason["type"] == "abort"
    assert engine.data_parallel.inflight() == [0, 0]
    # a replica process's RequestError reaches the caller as itself, field named
    for call in (lambda: engine.generate("x", {"max_new_tokens": -1}),
                 lambda: next(engine.stream("x", sampling_params={"max_new_tokens": -1})),
                 lambda: asyncio.run(engine.async_generate("x", {"max_new_tokens": -1}))):
        with pytest.raises(RequestError) as e:
            call()
        assert e.value.param == "max_new_tokens"
    assert engine.data_parallel.inflight() == [0, 0]


def test_abort_request_of_a_whole_generate_through_replica_processes_keeps_its_output(dp):
    """/abort_request ends a non-streamed /generate on a replica process with what it
    generated: the replica tells the router the request's id when it accepts it."""
    from test_server_abort import after_tokens, check_partial, generated_tokens, in_background
    from test_server_sglang_parity import _idle, post

    before = generated_tokens(dp)
    t, res = in_background(lambda: post(dp, "/generate", {
        "text": PROMPTS[1], "rid": "dp-abort", "sampling_params": {
            "max_new_tokens": 200, "ignore_eos": True, "temperature": 0.0}}))
    after_tokens(dp, before, 8)
    assert post(dp, "/abort_request", {"rid": "dp-abort"}).status_code == 200
    t.join(scaled(120))
    check_partial(res[0].json(), "dp-abort", dp.engine.tokenizer)
    _idle(dp.engine)


def _sse(r) -> tuple[dict, dict, dict, dict | None]:
    """Per choice index of a streamed completion: text, finish reason, tokens; the usage."""
    text: dict = {}
    reason: dict = {}
    tokens: dict = {}
    usage = None
    for line in r.text.splitlines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        usage = event.get("usage") or usage
        for c in event["choices"]:
            i = c["index"]
            text[i] = text.get(i, "") + c["text"]
            reason[i] = c["finish_reason"] or reason.get(i)
            tokens.setdefault(i, []).extend((c.get("logprobs") or {}).get("tokens") or [])
    return text, reason, tokens, usage


def test_whole_responses_through_replica_processes_equal_the_streamed_ones(dp):
    """A non-streaming completion (its replica sends each request's chunks in one message at
    its end) answers what the same request streamed answers (the chunks per iteration): text,
    finish reasons (a stop string matched, and length), logprob tokens, ``n`` 2, usage; the
    replica's late delivery still measures time to first token at emission (below the
    end-to-end latency) and inter-token gaps; a replica's ``whole`` stream hands over its first
    chunk only after its last was emitted."""
    url = dp.url + "/v1/completions"
    base = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
    free = httpx.post(url, json=base, timeout=scaled(120)).json()["choices"][0]["text"]
    stop = free[4:6]
    assert len(free) >= 8 and stop.strip(), free  # a stop string inside the greedy text
    names = ("time_to_first_token", "e2e_request_latency", "inter_token_latency")
    before = [metric(dp, f"specdial:{m}_seconds_sum") for m in names]
    long = {**base, "max_tokens": 24, "ignore_eos": True}
    r = httpx.post(url, json=long, timeout=scaled(120))
    assert r.status_code == 200
    ttft, e2e, itl = (metric(dp, f"specdial:{m}_seconds_sum") - b for m, b in zip(names, before))
    # taken at arrival, all 24 tokens' chunks would read the same instant (gaps of microseconds)
    assert e2e - ttft > 0.003 and itl == pytest.approx(e2e - ttft, rel=1e-6)
    body = {**base, "stop": [stop], "n": 2, "logprobs": 2}
    whole = httpx.post(url, json=body, timeout=scaled(120)).json()
    streamed = httpx.post(url, json={**body, "stream": True,
                                     "stream_options": {"include_usage": True}},
                          timeout=scaled(120))
    text, reason, tokens, usage = _sse(streamed)
    assert [c["text"] for c in whole["choices"]] == [text[0], text[1]] == \
        [free[:free.index(stop)]] * 2
    assert [c["finish_reason"] for c in whole["choices"]] == [reason[0], reason[1]] == ["stop"] * 2
    assert [c["logprobs"]["tokens"] for c in whole["choices"]] == [tokens[0], tokens[1]]
    # a stop string's completion_tokens end at the token that completed it, whatever the
    # adaptive steps of the moment emitted after it in the same verify
    assert whole["usage"] == usage
    text, reason, _, usage = _sse(httpx.post(url, json={
        **long, "stream": True, "stream_options": {"include_usage": True}}, timeout=scaled(120)))
    assert (text[0], reason[0]) == (r.json()["choices"][0]["text"], "length")
    assert r.json()["usage"] == usage and usage["completion_tokens"] == 24
    replica = dp.engine.data_parallel.replicas[0]

    async def received():
        out = []
        async for c in replica.async_stream(PROMPTS[1], sampling_params={
                "max_new_tokens": 24, "temperature": 0, "ignore_eos": True}, whole=True):
            out.append((time.perf_counter(), c))
        return out

    got = asyncio.run(received())
    assert len(got) > 1 and got[-1][1].finished and got[-1][1].finish_reason["type"] == "length"
    assert got[0][0] >= got[-1][1].emitted_s > got[0][1].emitted_s


@pytest.mark.parametrize("backend", ["mp", "inprocess"])
def test_engine_dp_size_2_from_python(dirs, backend, capfd):
    """``specdial.Engine(dp_size=2)``: 24 greedy prompts through generate (a list), the same
    outputs as one engine, none lost, both replicas used, stats summed; async_generate and
    stream work through the same front end. ``mp``: two processes; ``inprocess``: two
    Engines here."""
    target, noisy = dirs
    options = dict(model_path=str(target), draft_model_path=str(noisy), **COMMON)
    params = {"max_new_tokens": 12, "temperature": 0}
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(24)]
    with Engine(**options) as one:
        want = [o["output_ids"] for o in one.generate(prompts, params)]
    logger, level = logging.getLogger("specdial"), logging.getLogger("specdial").level
    logger.setLevel(logging.INFO)  # the replica processes log at this process's level
    try:
        two = Engine(dp_size=2, data_parallel_backend=backend, **options)
    finally:
        logger.setLevel(level)
    if backend == "mp":
        err = capfd.readouterr().err
        assert "[dp 0]" in err and "[dp 1]" in err and "replica 1 ready" in err, err[-2000:]
    with two:
        assert len(two.replicas) == 2 and two.replicas[0] is not two.replicas[1]
        if backend == "mp":
            pids = {r.info["pid"] for r in two.replicas}
            assert len(pids) == 2 and os.getpid() not in pids
            # what this process reads of replica 0: tokenizer, limits, policy config
            assert two.tokenizer is not None and two.context_length == COMMON["context_length"]
            assert two.adaptive_config is not None and two.speculative_algorithm == "DRAFT"
            assert two.target is None and two.vocab_size == one.vocab_size  # bench's random
            assert policy_description(two).startswith("adaptive ")  # `generate --dp-size`
        else:
            assert two.replicas[0].scheduler is not two.replicas[1].scheduler
            assert [r.config.seed for r in two.replicas] == [0, replica_seed(0, 1)]
        outs = two.generate(prompts, params)
        assert [o["output_ids"] for o in outs] == want
        per_replica = [s.requests_finished for s in two.data_parallel.replica_stats()]
        assert sum(per_replica) == 24 and min(per_replica) > 0, per_replica
        assert two.stats().requests_finished == 24
        assert two.stats().generation_tokens == sum(len(w) for w in want)
        _per_engine_readings_are_the_replicas_summed(two)
        assert two.flush_cache() is True and two.stats().cached_pages == 0  # every replica's
        got = asyncio.run(two.async_generate(prompts[:4], params))
        assert [o["output_ids"] for o in got] == want[:4]
        chunks = list(two.stream(prompts[0], sampling_params=params))
        assert chunks[-1].finished and [t for c in chunks for t in c.token_ids] == want[0]
        assert two.data_parallel.inflight() == [0, 0]
    with pytest.raises(ValueError, match="dp_size > 1 with tp_size > 1"):
        Engine(dp_size=2, tp_size=2, data_parallel_backend="inprocess", **options)


def _per_engine_readings_are_the_replicas_summed(two: Engine) -> None:
    """``loop_turns`` and ``graph_stats()`` of a dp 2 Engine (they raised on one: the front
    has no loop and no worker) are the replicas' summed, and both replicas turned. The loops
    rest while idle; a replica process's count comes with its heartbeat (every 1 s here), so
    the readings are polled until both show a turn (before: a fixed 6 s sleep), and the sum
    is taken between two equal readings of the replicas (a beat may land in between)."""
    deadline = time.monotonic() + scaled(10)
    while True:
        turns = [r.loop_turns for r in two.replicas]
        total = two.loop_turns
        if min(turns) > 0 and turns == [r.loop_turns for r in two.replicas]:
            break  # both served a share
        assert time.monotonic() < deadline, turns
        time.sleep(0.05)
    assert total == sum(turns), (total, turns)
    zero = {"replays": {}, "eager": {}, "captured": 0}  # no graph runners on the CPU
    assert [r.graph_stats() for r in two.replicas] == [zero, zero]
    assert two.graph_stats() == zero


class _Reading:
    """A replica stand-in with fixed readings."""

    tokenizer, context_length, failure = None, 64, None

    def __init__(self, turns: int, graphs: dict) -> None:
        self.loop_turns, self._graphs = turns, graphs

    def graph_stats(self) -> dict:
        return self._graphs


def test_front_sums_loop_turns_and_graph_stats():
    a = _Reading(7, {"replays": {"verify": 3, "draft": 2}, "eager": {"too_big": 1},
                     "captured": 4})
    b = _Reading(5, {"replays": {"verify": 1, "extend": 6}, "eager": {}, "captured": 2})
    front = DataParallelEngine([a, b])
    assert front.loop_turns == 12
    assert front.graph_stats() == {"replays": {"verify": 4, "draft": 2, "extend": 6},
                                   "eager": {"too_big": 1}, "captured": 6}
    b.failure, b.loop_turns = "gone", 9  # a failed replica's last count stays in the sum
    assert front.loop_turns == 16


def test_aggregate_stats():
    a = EngineStats(running=1, queued=2, accepted_per_pos=[3, 1], steps_per_slot={1: 3},
                    slot_states=[{"lower_bound": 1, "steps": 3}], generation_tokens=5,
                    verify_length_histogram={0: 2, 3: 1}, tree_node_histogram={8: 3})
    b = EngineStats(running=2, accepted_per_pos=[1, 1, 1], steps_per_slot={1: 0},
                    slot_states=[{"lower_bound": 1, "steps": 0}], generation_tokens=7,
                    verify_length_histogram={1: 4, 3: 2}, tree_node_histogram={3: 1, 8: 2})
    s = aggregate_stats([a, b])
    assert (s.running, s.queued, s.generation_tokens) == (3, 2, 12)
    assert s.verify_length_histogram == {0: 2, 1: 4, 3: 3}
    assert s.tree_node_histogram == {3: 1, 8: 5}
    assert s.accepted_per_pos == [4, 2, 1]
    assert s.steps_per_slot == {1: 3}
    assert [d["replica"] for d in s.slot_states] == [0, 1]
    with pytest.raises(ValueError):
        aggregate_stats([])
    with pytest.raises(ValueError, match="dp_size"):
        DataParallelEngine([])


def test_a_failed_replica_is_named_and_skipped_and_all_failed_is_503():
    """A replica whose ``failure`` is set: ``/health`` answers 200 ``degraded`` naming it,
    requests go to the other; once every replica failed, ``/health`` and generation requests
    answer 503 naming the failures."""
    from test_server_fake_engine import FakeEngine
    well, broken = FakeEngine(), FakeEngine()
    engine = DataParallelEngine([well, broken])
    with LiveServer(engine, name=NAME) as server:
        r = httpx.get(server.url + "/health", timeout=scaled(10))
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        broken.failure = "tensor-parallel rank 1 died"
        r = httpx.get(server.url + "/health", timeout=scaled(10))
        assert r.status_code == 200 and r.json()["status"] == "degraded"
        assert "replica 1: tensor-parallel rank 1 died" in r.json()["message"]
        for _ in range(4):
            r = httpx.post(server.url + "/v1/completions", timeout=scaled(10),
                           json={"model": NAME, "prompt": "x", "max_tokens": 2})
            assert r.status_code == 200
        assert len(broken.submitted) == 0 and len(well.submitted) == 4
        assert metric(server, "specdial:replica_up", '{dp_rank="1"}') == 0
        assert metric(server, "specdial:replica_up", '{dp_rank="0"}') == 1
        assert engine.stats().requests_finished == well.stats().requests_finished
        well.failure = "its loop stopped"
        r = httpx.get(server.url + "/health", timeout=scaled(10))
        assert r.status_code == 503 and "replica 0: its loop stopped" in r.text
        r = httpx.post(server.url + "/v1/completions", timeout=scaled(10),
                       json={"model": NAME, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"


def test_policy_description_of_replica_processes_reads_replica_0():
    """``specdial generate --dp-size N`` with fixed steps: the serving process has no scheduler
    (the replicas do), so the description reads replica 0's ready message."""
    class Replica:
        info = {"fixed_steps": 3}

    class Front:
        speculative_algorithm, adaptive_config, scheduler, replicas = "DRAFT", None, None, [Replica]

    assert policy_description(Front()) == "fixed steps 3"
