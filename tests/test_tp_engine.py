"""The engine with its models sharded over 2 gloo ranks (``Engine(tp_size=2)``, no launcher).

Greedy outputs equal tp 1 for both drafters (EAGLE head, draft model) at fixed steps 0 and 3
and adaptive; a stop string's output ids and ``completion_tokens`` equal plain decoding's; sampling runs to the end with the ranks' tokens checked equal after every pass;
``serve``'s options (``--tp-size``) through the ``openai`` client; a killed worker rank fails
the running request with a message and ``/health`` answers 503 within ``dist_timeout``; two
"nodes" on loopback (``serve --node-rank 1`` as a second process)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from greedy import greedy
import specdial
from specdial.distributed.group import free_port
from specdial.server.config import ServeConfig
from test_server_fake_engine import LiveServer
from timeouts import scaled

BUILTIN = Path(specdial.__file__).parent / "builtin"
TARGET = str(BUILTIN / "target")
PROMPTS = ["def fibonacci(n):", "import os\nimport", "class Stack:\n    def"]
GREEDY = {"max_new_tokens": 24, "temperature": 0}
DRAFTERS = {"EAGLE": BUILTIN / "eagle", "DRAFT": BUILTIN / "draft"}
MODES = {"steps0": dict(speculative_adaptive=False, speculative_num_steps=0),
         "steps3": dict(speculative_adaptive=False, speculative_num_steps=3),
         "adaptive": {}}


def _texts(engine, params=GREEDY):
    return [o["text"] for o in engine.generate(PROMPTS, params)]


def _tp1(**kw):
    ref = specdial.Engine(log_interval_s=None, **kw)
    try:
        return _texts(ref)
    finally:
        ref.shutdown()


@pytest.mark.parametrize("algo", list(DRAFTERS))
def test_greedy_tp2_equals_tp1(algo):
    for mode, kw in MODES.items():
        common = dict(model_path=TARGET, draft_model_path=str(DRAFTERS[algo]),
                      speculative_algorithm=algo, **kw)
        want = _tp1(**common)
        engine = specdial.Engine(tp_size=2, log_interval_s=None, **common)
        try:
            assert _texts(engine) == want, (algo, mode)
            if mode != "steps0":
                assert engine.stats().num_accepted_tokens > 0
            sampled = _texts(engine, {"max_new_tokens": 16, "temperature": 0.8})
            assert len(sampled) == 3 and engine.failure is None  # ranks agreed throughout
        finally:
            engine.shutdown()


def test_stop_string_usage_tp2_equals_plain_decoding():
    """A stop string under tp 2 at steps 3 ends the output ids and ``completion_tokens`` where
    plain decoding at tp 1 ends them (the tokens a verify emitted past it are dropped)."""
    common = dict(model_path=TARGET, draft_model_path=str(DRAFTERS["DRAFT"]),
                  speculative_algorithm="DRAFT", speculative_adaptive=False,
                  log_interval_s=None)
    sp = {**GREEDY, "max_new_tokens": 32}
    plain = specdial.Engine(speculative_num_steps=0, **common)
    try:
        free = plain.generate(PROMPTS, sp)
        stops = [o["text"][len(o["text"]) // 2:len(o["text"]) // 2 + 2] for o in free]
        want = [plain.generate(p, {**sp, "stop": [s]}) for p, s in zip(PROMPTS, stops)]
    finally:
        plain.shutdown()
    engine = specdial.Engine(tp_size=2, speculative_num_steps=3, **common)
    try:
        got = [engine.generate(p, {**sp, "stop": [s]}) for p, s in zip(PROMPTS, stops)]
        assert engine.stats().num_accepted_tokens > 0
    finally:
        engine.shutdown()
    for g, w, s in zip(got, want, stops):
        assert g["meta_info"]["finish_reason"] == {"type": "stop", "matched": s}
        assert (g["output_ids"], g["meta_info"]["completion_tokens"]) == (
            w["output_ids"], w["meta_info"]["completion_tokens"])


def test_constrained_tp2_equals_tp1():
    """Structured outputs under tp 2 (issue 31): the matchers stay on rank 0, which
    broadcasts each packed mask; greedy outputs under a regex and a JSON schema equal tp 1's
    (drafting at steps 3, and adaptive), and a sampled batch mixing constrained and
    unconstrained requests runs with the ranks' tokens equal after every pass."""
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                         "required": ["n"], "additionalProperties": False})
    params = [{**GREEDY, "regex": r"[0-9]{1,3}(\.[0-9])? (kg|lb)"},
              {**GREEDY, "json_schema": schema}, GREEDY]
    for mode in ("steps3", "adaptive"):
        common = dict(model_path=TARGET, draft_model_path=str(DRAFTERS["EAGLE"]),
                      speculative_algorithm="EAGLE", **MODES[mode])
        ref = specdial.Engine(log_interval_s=None, **common)
        try:
            want = [o["text"] for o in ref.generate(PROMPTS, params)]
        finally:
            ref.shutdown()
        engine = specdial.Engine(tp_size=2, log_interval_s=None, **common)
        try:
            assert [o["text"] for o in engine.generate(PROMPTS, params)] == want, mode
            sampled = engine.generate(PROMPTS, [{**p, "temperature": 1.0, "seed": 5}
                                                for p in params])
            assert re.fullmatch(r"[0-9]{1,3}(\.[0-9])? (kg|lb)", sampled[0]["text"]) or \
                sampled[0]["meta_info"]["finish_reason"]["type"] == "length"
            assert engine.failure is None  # the ranks agreed after every pass
        finally:
            engine.shutdown()

def test_serve_tp2_openai_and_killed_worker_rank():
    """The first completion after start is served (rank 0 waits for every rank to load before
    it takes requests, however slow the start-up), then rank 1 is killed during a 400-token
    completion: that request is a 500 naming the cause within ``dist_timeout`` plus a few
    seconds, and ``/health`` turns 503 naming the rank."""
    timeout = 5.0
    want = _tp1()[0]
    cfg = ServeConfig(tp_size=2, dist_timeout=timeout, log_interval_s=0)
    engine = cfg.build_engine()
    with LiveServer(engine, name="m") as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
            r = c.completions.create(model="m", prompt=PROMPTS[0], max_tokens=24,
                                     temperature=0)
        assert r.choices[0].text == want
        assert httpx.get(server.url + "/health").status_code == 200
        with ThreadPoolExecutor(1) as pool:
            before = engine.stats().generation_tokens
            long = pool.submit(httpx.post, server.url + "/v1/completions",
                               timeout=scaled(120), json={
                "prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "ignore_eos": True})
            deadline = time.monotonic() + scaled(60)
            while engine.stats().generation_tokens < before + 8:  # decoding, not done
                assert time.monotonic() < deadline and not long.done()
                time.sleep(0.02)
            os.kill(engine._tp.procs.procs[1].pid, signal.SIGKILL)
            t0 = time.monotonic()
            r = long.result()
            waited = time.monotonic() - t0
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == "engine_error" and "rank" in err["message"], err
        assert waited < timeout + scaled(10), waited
        r = httpx.get(server.url + "/health")
        assert r.status_code == 503 and "worker rank 1" in r.text, r.text
        out = engine.generate(PROMPTS[1], greedy(4))  # fails at once, typed
        assert out["meta_info"]["finish_reason"]["type"] == "error"


def test_two_nodes_on_loopback(tmp_path):
    """tp 2 over two "nodes": node 1 is ``specdial serve --nnodes 2 --node-rank 1`` in another
    process (it serves nothing and exits when node 0 shuts down), node 0 this Engine."""
    addr = f"127.0.0.1:{free_port()}"
    want = _tp1()
    node1 = subprocess.Popen([sys.executable, "-m", "specdial.cli", "serve", "--tp-size", "2",
                              "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr,
                              "--dist-timeout", "120"])
    try:
        engine = specdial.Engine(tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr,
                                 dist_timeout=scaled(120), log_interval_s=None)
        try:
            assert _texts(engine) == want
        finally:
            engine.shutdown()
        assert node1.wait(scaled(60)) == 0
    finally:
        node1.kill()


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def test_rank0_learns_that_a_rank_on_another_node_hangs():
    """No process handle or pipe reaches a rank on another node: when it hangs (SIGSTOP) its
    stopped heartbeat makes rank 0's ``failure`` name it within ``dist_timeout`` plus a few
    seconds. The start-up itself runs under the long start-up timeout (a 5 s ``dist_timeout``
    does not fail a slow start)."""
    timeout = 5.0
    addr = f"127.0.0.1:{free_port()}"
    node1 = subprocess.Popen([sys.executable, "-m", "specdial.cli", "serve", "--tp-size", "2",
                              "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr,
                              "--dist-timeout", str(timeout)], stderr=subprocess.DEVNULL)
    rank1 = None
    try:
        engine = specdial.Engine(tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr,
                                 dist_timeout=timeout, log_interval_s=None)
        try:
            assert engine.failure is None
            (rank1,) = _children(node1.pid)
            os.kill(rank1, signal.SIGSTOP)
            t0 = time.monotonic()
            while "worker rank 1 stopped its heartbeat" not in (engine.failure or ""):
                assert time.monotonic() - t0 < timeout + scaled(10), engine.failure
                time.sleep(0.05)
        finally:
            engine.shutdown(drain=False)
    finally:
        if rank1 is not None:
            os.kill(rank1, signal.SIGKILL)
        node1.kill()
        node1.wait()


def test_parallel_option_errors():
    with pytest.raises(ValueError, match="node_rank=1: an Engine runs on node 0"):
        specdial.Engine(tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1")
    with pytest.raises(ValueError, match="tp_size must be an integer >= 1"):
        specdial.Engine(tp_size=0)
    with pytest.raises(ValueError, match="num_attention_heads \\(4\\) must be divisible by "
                                         "tp_size \\(3\\)"):
        specdial.Engine(tp_size=3, log_interval_s=None)
    with pytest.raises(ValueError, match="dp_size > 1 with tp_size > 1"):
        ServeConfig(tp_size=2, dp_size=2, data_parallel_backend="inprocess").build_engine()
