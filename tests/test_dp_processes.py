"""Data-parallel replica processes (issue 32): the router's rules, each replica's devices,
seed and options, the wire, and real replicas: a killed replica fails its request in flight
with an error while the other keeps serving and ``/health`` names it; tp 2 x dp 2 gives the
greedy output of tp 1 x dp 1 (gloo on the CPU)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

import specdial
from specdial.config import EngineConfig
from specdial.engine.api import QueueFullError, RequestError
from specdial.launch import replica_wire as w
from specdial.launch.replica_main import ReplicaServer
from specdial.launch.replica_setup import (replica_devices, replica_options, replica_seed,
                                           visible_devices)
from specdial.launch.routing import NoReplicaError, Router, prompt_tokens, request_work
from test_server_engine import metric
from test_server_fake_engine import LiveServer
from timeouts import scaled

BUILTIN = Path(specdial.__file__).parent / "builtin"
TARGET, EAGLE = str(BUILTIN / "target"), str(BUILTIN / "eagle")
PROMPTS = ["def fibonacci(n):", "import os\nimport", "class Stack:\n    def", "x = [1, 2,"]
GREEDY = {"max_new_tokens": 16, "temperature": 0}


# --------------------------------------------------------------------------- pure rules
def test_replica_devices_slice_the_visible_ones():
    assert visible_devices(None, 4) == ["0", "1", "2", "3"]
    assert visible_devices("3, 5,6,7", 8) == ["3", "5", "6", "7"]
    assert [replica_devices(i, 2, visible_devices(None, 4)) for i in range(2)] == ["0,1", "2,3"]
    assert [replica_devices(i, 1, ["3", "5", "6"]) for i in range(3)] == ["3", "5", "6"]
    assert replica_devices(1, 2, ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]) == "GPU-c,GPU-d"
    with pytest.raises(ValueError, match="replica 1 needs devices 2..3 .* sees 3"):
        replica_devices(1, 2, ["0", "1", "2"])


def test_replica_seeds_and_options():
    assert replica_seed(7, 0) == 7  # dp 1 is replica 0 of dp N
    seeds = {replica_seed(7, i) for i in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2 ** 63 for s in seeds)
    assert replica_seed(7, 1) == replica_seed(7, 1) != replica_seed(8, 1)
    cfg = EngineConfig(dp_size=2, tp_size=2, dist_init_addr="10.0.0.1:5000", seed=7)
    opts = [replica_options(cfg, i, on_cpu=True) for i in range(2)]
    assert [o["dp_size"] for o in opts] == [1, 1] and [o["tp_size"] for o in opts] == [2, 2]
    assert [o["cpu_threads"] for o in opts] == [1, 1]
    assert [o["dist_init_addr"] for o in opts] == ["10.0.0.1:5000", "10.0.0.1:5001"]
    assert [o["seed"] for o in opts] == [7, replica_seed(7, 1)]
    assert replica_options(cfg, 0, on_cpu=False)["cpu_threads"] is None
    assert replica_options(cfg.replace(cpu_threads=3), 0, on_cpu=True)["cpu_threads"] == 3
    assert replica_options(EngineConfig(dp_size=2), 1, True)["dist_init_addr"] is None
    with pytest.raises(ValueError, match="steps_schedule: .* cannot be pickled by reference"):
        replica_options(EngineConfig(dp_size=2, steps_schedule=lambda i, b: 0), 0, True)
    v6 = EngineConfig(dp_size=2, tp_size=2, dist_init_addr="[::1]:5000")
    assert [replica_options(v6, i, True)["dist_init_addr"] for i in range(2)] == [
        "[::1]:5000", "[::1]:5001"]


def test_router_strategies():
    r = Router(2)  # minimum_tokens
    assert r.route([100]) == [0]
    assert r.route([10, 10, 10]) == [1, 1, 1]  # the light one takes the short ones
    assert r.route([50]) == [1]  # 30 < 100 outstanding
    assert r.snapshot() == ([1, 4], [100, 80])
    r.done(0, [100])
    assert r.route([5]) == [0] and r.snapshot() == ([1, 4], [5, 80])
    q = Router(2, "shortest_queue")
    assert sorted(q.route([1000, 1, 1, 1])) == [0, 0, 1, 1]  # counts requests, not tokens
    rr = Router(3, "round_robin")
    assert sorted(rr.route([1] * 6)) == [0, 0, 1, 1, 2, 2]
    rr.mark_failed(1, "replica 1: gone")
    assert 1 not in rr.route([1] * 6)
    rr.mark_failed(0, "replica 0: gone")
    rr.mark_failed(2, "replica 2: gone")
    with pytest.raises(NoReplicaError, match="replica 1: gone"):
        rr.route([1])
    with pytest.raises(ValueError, match="load_balance_method must be one of"):
        Router(2, "random")


def test_request_work_counts_prompt_and_budget():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(BUILTIN / "target" / "tokenizer.json"))
    n = len(tok.encode("def fibonacci(n):").ids)
    assert prompt_tokens(tok, "def fibonacci(n):", None) == n > 1
    assert prompt_tokens(tok, None, [1, 2, 3]) == 3
    assert prompt_tokens(None, "abcdefgh", None) == 3
    assert request_work(5, {"max_new_tokens": 20}) == 25
    assert request_work(5, None) == request_work(5, {"max_new_tokens": True}) == 5


def test_wire_errors_round_trip():
    for e in (RequestError("max_new_tokens must be >= 0", "max_new_tokens"),
              QueueFullError("queue full"), ValueError("v"), TypeError("t"), KeyError("k")):
        back = w.decode_error(*w.decode(w.encode([w.encode_error(e)]))[0])
        assert type(back) is (RuntimeError if isinstance(e, KeyError) else type(e))
        assert str(e) in str(back)
    assert w.decode_error(*w.encode_error(RequestError("bad", "stop"))).param == "stop"


def test_replica_batches_one_iterations_items_in_one_message():
    """Items queued by several streams in one pass of the event loop leave as one message."""
    class Conn:
        sent: list[bytes] = []

        def send_bytes(self, data: bytes) -> None:
            self.sent.append(data)

    async def main():
        server = ReplicaServer(engine=None, conn=Conn())
        server.loop = asyncio.get_running_loop()
        for cid in (1, 2, 3):
            server._out(cid, w.CHUNK, f"chunk of {cid}")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        server._out(4, w.RESULT, "later")
        await asyncio.sleep(0)
        return [w.decode(m) for m in Conn.sent]

    assert asyncio.run(main()) == [[(1, "chunk", "chunk of 1"), (2, "chunk", "chunk of 2"),
                                    (3, "chunk", "chunk of 3")], [(4, "result", "later")]]


# --------------------------------------------------------------------------- real replicas
def _disconnect_reaches_the_replica(engine):
    """An async stream left after its first chunk (what a disconnected HTTP client does)
    aborts the request in the replica that holds it: it stops running there, short of its
    400 tokens."""
    long = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}

    async def first_chunk_then_leave():
        chunks = engine.async_stream(PROMPTS[1], sampling_params=long)
        first = await chunks.__anext__()
        await chunks.aclose()
        return first

    first = asyncio.run(first_chunk_then_leave())
    replica = engine.replicas[first.request_id % 2]
    deadline = time.monotonic() + scaled(60)
    while replica.stats().running and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = replica.stats()
    assert stats.running == 0 and stats.generation_tokens < 400


def test_killed_replica_fails_its_request_others_serve_health_names_it():
    """Replica k is SIGKILLed while its 400-token stream runs: the stream ends with finish
    reason ``error`` naming replica k and the signal (before its 400 tokens); requests sent
    afterwards all succeed on the other replica; ``/health`` is 200 ``degraded`` naming
    replica k; ``/metrics`` still answers."""
    engine = specdial.Engine(model_path=TARGET, dp_size=2, log_interval_s=None,
                             max_running_requests=4, context_length=512)
    try:
        with LiveServer(engine, name="m") as server:
            _disconnect_reaches_the_replica(engine)
            it = engine.stream(PROMPTS[0], sampling_params={
                "max_new_tokens": 400, "temperature": 0, "ignore_eos": True})
            first = next(it)
            k = first.request_id % 2
            victim = engine.replicas[k]
            victim.kill()
            chunks = [first, *it]
            last = chunks[-1]
            assert last.finished and last.finish_reason["type"] == "error", last
            assert f"replica {k} (pid {victim.proc.pid}) exited with signal 9" in \
                last.finish_reason["message"]
            assert sum(len(c.token_ids) for c in chunks) < 400
            other = engine.replicas[1 - k]
            before = other.stats().requests_finished
            for p in PROMPTS:
                r = httpx.post(server.url + "/v1/completions", timeout=scaled(120), json={
                    "model": "m", "prompt": p, "max_tokens": 8, "temperature": 0})
                assert r.status_code == 200, r.text
            assert other.stats().requests_finished == before + len(PROMPTS)
            health = httpx.get(server.url + "/health", timeout=scaled(10))
            assert health.status_code == 200 and health.json()["status"] == "degraded"
            assert f"replica {k}: data-parallel replica {k}" in health.json()["message"]
            assert metric(server, "specdial:engine_up") == 1
            assert metric(server, "specdial:replica_up", f'{{dp_rank="{k}"}}') == 0
            assert metric(server, "specdial:replica_up", f'{{dp_rank="{1 - k}"}}') == 1
    finally:
        engine.shutdown(drain=False)


def _ipv6_loopback_addr() -> dict:
    """``dist_init_addr`` ``[::1]:<free port>`` where this host has an IPv6 loopback, else
    nothing (the default IPv4 address)."""
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            return {"dist_init_addr": f"[::1]:{s.getsockname()[1]}"}
    except OSError:
        return {}


def test_tp2_x_dp2_greedy_equals_tp1_x_dp1():
    """Two replica processes, each a tensor-parallel group of 2 gloo ranks on its own port
    (bracketed IPv6 ``--dist-init-addr`` ``[::1]:p`` and ``p+1`` where the host has ::1),
    give the greedy tokens of one unsharded engine, prompts spread over both."""
    common = dict(model_path=TARGET, draft_model_path=EAGLE, speculative_adaptive=False,
                  speculative_num_steps=3, log_interval_s=None)
    with specdial.Engine(**common) as one:
        want = [o["output_ids"] for o in one.generate(PROMPTS, GREEDY)]
    with specdial.Engine(tp_size=2, dp_size=2, **_ipv6_loopback_addr(), **common) as four:
        got = [o["output_ids"] for o in four.generate(PROMPTS, GREEDY)]
        per_replica = [s.requests_finished for s in four.data_parallel.replica_stats()]
        assert four.failure is None and four.degraded is None
    assert got == want
    assert sum(per_replica) == 4 and min(per_replica) >= 1, per_replica
