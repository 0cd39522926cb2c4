"""Hang detection of data-parallel replica processes (issue 32): the heartbeat's and the
watchdog's rules, a ``steps_schedule`` function sent by reference (and what is refused), an
IPv6 rendezvous address, and real replicas that hang: one whose whole process is stopped
(SIGSTOP: no heartbeat) and one whose engine loop is stuck inside an iteration while the rest of
the process runs (its heartbeat reports the stall). Each time its request in flight ends with an
error naming the replica and the hang, later requests succeed on the other replica, and
``/health`` names it."""

from __future__ import annotations

import os
import signal
import threading
import time
import types
from pathlib import Path

import httpx
import pytest

import specdial
from dp_stall_hook import FLAG, stall_replica_1
from specdial.config import EngineConfig, parse_addr
from specdial.launch import replica_wire as w
from specdial.launch.replica_client import ReplicaClient
from specdial.launch.replica_main import ReplicaServer
from specdial.launch.replica_setup import check_sendable, replica_options
from specdial.launch.replica_watch import Progress, Watchdog, beat_interval
from test_server_engine import metric
from test_server_fake_engine import LiveServer
from timeouts import scaled

BUILTIN = Path(specdial.__file__).parent / "builtin"
TARGET, EAGLE = str(BUILTIN / "target"), str(BUILTIN / "eagle")
LONG = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
PROMPTS = ["def fibonacci(n):", "import os\nimport", "class Stack:\n    def", "x = [1, 2,"]


def _local_stall(i: int, running: int) -> int:
    return 0


# --------------------------------------------------------------------------- rules
def test_loop_turns_move_with_work_and_rest_while_idle():
    """``Engine.loop_turns`` (the heartbeat's progress count) moves at least once per
    iteration while a request runs, and not at all while the loop waits idle."""
    with specdial.Engine(model_path=TARGET, log_interval_s=None) as engine:
        before = engine.loop_turns
        engine.generate(PROMPTS[0], {"max_new_tokens": 4, "temperature": 0})
        after = engine.loop_turns
        assert after >= before + 4  # a prefill and 3 decode iterations, one per turn at most
        time.sleep(0.3)
        # at most the turn that enters the wait: the loop takes it after handing over the last
        # chunk, so a loaded machine may read ``after`` before it (a spinning loop: hundreds)
        assert after <= engine.loop_turns <= after + 1


def test_progress_counts_only_a_busy_loop_that_does_not_turn():
    p = Progress(now=0.0)
    assert p.stalled_s(5, busy=True, now=1.0) == 0.0  # first sight of the count
    assert p.stalled_s(5, busy=True, now=4.0) == 3.0
    assert p.stalled_s(6, busy=True, now=5.0) == 0.0  # it turned
    assert p.stalled_s(6, busy=False, now=50.0) == 0.0  # idle: blocking is fine
    assert p.stalled_s(6, busy=True, now=52.5) == 2.5


def test_heartbeat_carries_the_stall_and_the_turn_count():
    """A beat is ``(stall_s, loop_turns)``; the router's client keeps the count
    (``ReplicaClient.loop_turns``, what a dp > 1 Engine's ``loop_turns`` sums) and gives the
    stall to its watchdog."""
    engine = types.SimpleNamespace(loop_turns=41)
    server = ReplicaServer(engine=engine, conn=None)
    server.calls = {1: None}  # a call in flight
    assert server.beat() == (0.0, 41)
    server.progress.since -= 5.0  # the count has not moved for 5 s
    stall, turns = server.beat()
    assert turns == 41 and 4.9 < stall < 6.0
    engine.loop_turns = 42
    assert server.beat() == (0.0, 42)
    client = ReplicaClient.__new__(ReplicaClient)  # no process: only its delivery
    client._lock, client._calls, client.loop_turns = threading.Lock(), {}, 0
    client.watchdog = Watchdog(2.0, now=0.0)
    client._deliver([(0, w.BEAT, (3.5, 42))])
    assert client.loop_turns == 42 and client.watchdog.stalled == 3.5


def test_watchdog_verdicts():
    assert beat_interval(300) == 1.0 and beat_interval(2) == 0.5
    dog = Watchdog(10.0, now=0.0)
    assert dog.verdict(9.0) is None
    dog.beat(10.5)
    assert "engine loop made no progress for 10.5s" in dog.verdict(9.0)
    dog.beat(0.0)
    dog.heard_from(20.0)
    assert dog.verdict(29.0) is None
    assert "not even its heartbeat, arrived from it for 10.5s" in dog.verdict(30.5)
    for bad in (0, -1, True, "5"):
        with pytest.raises(ValueError, match="watchdog_timeout must be a positive number"):
            Watchdog(bad)
    with pytest.raises(ValueError, match="watchdog_timeout must be a positive number"):
        EngineConfig(watchdog_timeout=0)
    assert EngineConfig().watchdog_timeout == 300.0  # SGLang's --watchdog-timeout default


def test_steps_schedule_functions_go_by_reference_others_are_refused():
    cfg = EngineConfig(dp_size=2, steps_schedule=stall_replica_1)
    assert replica_options(cfg, 1, True)["steps_schedule"] is stall_replica_1
    check_sendable([1, 2, 3])
    check_sendable(None)
    with pytest.raises(ValueError, match="steps_schedule: .* lambda, closure"):
        check_sendable(lambda i, b: 0)

    def local(i, b):
        return 0

    with pytest.raises(ValueError, match="steps_schedule: .* cannot be pickled by reference"):
        check_sendable(local)
    _local_stall.__module__ = "__main__"
    try:
        with pytest.raises(ValueError, match="steps_schedule: .* defined in the __main__ script"):
            check_sendable(_local_stall)
    finally:
        _local_stall.__module__ = __name__


def test_ipv6_rendezvous_address_round_trips_and_binds():
    """``[::1]:port`` parses to the bare host torch's TCPStore takes, and a store serves there
    (skipped only where this host has no IPv6 loopback)."""
    import socket

    import torch.distributed as dist

    assert parse_addr("[::1]:5000") == ("::1", 5000)
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this host")
    from datetime import timedelta

    # port 0: the store binds a free port itself and keeps it (no pick-then-bind race)
    host = parse_addr("[::1]:5000")[0]
    store = dist.TCPStore(host, 0, 1, True, timedelta(seconds=scaled(10)))
    assert store.port > 0
    store.set("k", "v")
    assert store.get("k") == b"v"


# --------------------------------------------------------------------------- real replicas
def _hang_is_handled(engine, server, k: int, chunks: list) -> None:
    """Replica ``k`` hung while ``chunks``' request ran there: that stream ended with an error
    naming it and the hang; requests now succeed on the other; /health names replica k."""
    last = chunks[-1]
    assert last.finished and last.finish_reason["type"] == "error", last
    assert f"data-parallel replica {k}" in last.finish_reason["message"]
    assert "hung" in last.finish_reason["message"], last.finish_reason
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
    assert "hung" in health.json()["message"]
    assert metric(server, "specdial:replica_up", f'{{dp_rank="{k}"}}') == 0
    deadline = time.monotonic() + scaled(30)
    while engine.replicas[k].proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.replicas[k].proc.poll() is not None  # killed


def test_stopped_replica_process_is_declared_hung():
    """SIGSTOP on replica k (alive, silent): within about the watchdog timeout its stream
    ends with an error, the router kills and skips it, /health names it."""
    timeout = scaled(1.0)
    engine = specdial.Engine(model_path=TARGET, dp_size=2, log_interval_s=None,
                             max_running_requests=4, context_length=512,
                             watchdog_timeout=timeout)
    try:
        with LiveServer(engine, name="m") as server:
            it = engine.stream(PROMPTS[0], sampling_params=LONG)
            first = next(it)
            k = first.request_id % 2
            os.kill(engine.replicas[k].proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            chunks = [first, *it]
            assert time.monotonic() - t0 < timeout + scaled(10)
            assert "not even its heartbeat" in chunks[-1].finish_reason["message"]
            _hang_is_handled(engine, server, k, chunks)
    finally:
        engine.shutdown(drain=False)


def test_stuck_engine_loop_is_declared_hung(tmp_path, monkeypatch):
    """Replica 1's engine loop blocks inside a decode iteration (``steps_schedule``, sent by
    reference, sleeps) while its process, asyncio loop and heartbeat carry on: the heartbeat's
    stall count gives it away."""
    flag = tmp_path / "stall"
    monkeypatch.setenv(FLAG, str(flag))
    timeout = scaled(1.0)
    engine = specdial.Engine(model_path=TARGET, draft_model_path=EAGLE, dp_size=2,
                             log_interval_s=None, max_running_requests=4, context_length=512,
                             steps_schedule=stall_replica_1, watchdog_timeout=timeout)
    try:
        with LiveServer(engine, name="m") as server:
            stuck = engine.data_parallel.replicas[1]
            it = stuck.stream(PROMPTS[0], sampling_params=LONG)
            first = next(it)
            flag.touch()
            chunks = [first, *it]
            assert "engine loop made no progress" in chunks[-1].finish_reason["message"]
            _hang_is_handled(engine, server, 1, chunks)
    finally:
        engine.shutdown(drain=False)
