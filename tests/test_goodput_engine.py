"""The adaptive strategies inside the engine (issue 11): seconds reach the policy, the startup
profiling run of throughput_aware (and goodput's optional sweep), the cost-table writer, and the
goodput gauges on /metrics. Policy quality itself is tested in the Rust simulator
(rust/core/tests/simulator.rs)."""

from __future__ import annotations

import json

import pytest

from conftest import PROMPTS
from greedy import greedy
from test_engine_greedy import assert_no_leak
from specdial import AdaptiveConfig, CostTable
from specdial.cli import main
from specdial.policy_sim import build_spec, run_simulation
from specdial.engine import Engine
from specdial.server.metrics import ServerMetrics as Metrics

KW = dict(max_running_requests=4, kv_cache_tokens=2048, page_size=8)
TA = {"strategy": "throughput_aware", "profile_run_batch_sizes": [1, 2], "profile_run_n_warmup": 0,
      "profile_run_n_measure": 1, "profile_run_seq_len": 8, "window_size": 2, "update_interval": 2,
      "1": {"candidate_steps": [1, 3]}}


def test_throughput_aware_profiles_at_start_and_then_serves_losslessly(tiny):
    ref = Engine.from_modules(tiny.target, None, **KW)
    want = [o["output_ids"] for o in ref.generate(input_ids=PROMPTS, sampling_params=greedy(24))]
    ref.shutdown()
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, speculative_adaptive_config=TA, **KW)
    points = {(p.batch_size, p.steps) for p in engine.profile_points}
    assert points == {(1, 1), (2, 1), (1, 3), (2, 3)}
    assert all(p.seconds > 0 and p.context_per_request >= 8 for p in engine.profile_points)
    assert_no_leak(engine)  # the synthetic requests gave every page back
    assert engine.scheduler.policy_strategy == "throughput_aware"
    out = engine.generate(input_ids=PROMPTS, sampling_params=greedy(24))
    assert [o["output_ids"] for o in out] == want
    assert_no_leak(engine)
    engine.shutdown()


def test_goodput_sweep_only_when_asked(tiny):
    plain = Engine.from_modules(tiny.target, tiny.draft_noisy, **KW)
    assert plain.profile_points == [] and plain.adaptive_config.profile is None
    plain.shutdown()
    cfg = {"strategy": "goodput", "profile_run_batch_sizes": [2], "profile_run_n_measure": 1,
           "profile_run_n_warmup": 0, "profile_run_seq_len": 8, "1": {"candidate_steps": [0, 2]}}
    swept = Engine.from_modules(tiny.target, tiny.draft_noisy, speculative_adaptive_config=cfg, **KW)
    assert {(p.batch_size, p.steps) for p in swept.profile_points} == {(2, 0), (2, 2)}
    # The sweep seeded the cost model: it predicts from measurements before any request.
    pred = swept.scheduler.predicted_seconds(2)
    assert set(pred) == {0, 2} and all(t > 0 for t in pred.values())
    swept.generate(input_ids=[1, 2], sampling_params=greedy(2))
    with pytest.raises(RuntimeError, match="before the engine serves"):
        swept.profile_costs([1], [0])
    swept.shutdown()


def test_goodput_state_and_metrics_after_serving(tiny):
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, log_interval_s=None, **KW)
    engine.generate(input_ids=PROMPTS, sampling_params=greedy(40))
    state = engine.scheduler.goodput_state()
    assert state is not None and len(state["acceptance"]) == 7  # positions 1..7
    last = state["last_decision"]
    assert set(last["predicted_seconds"]) == set(range(8))
    assert all(t > 0 for t in last["predicted_seconds"].values())
    # Seconds reached the cost model: predictions are in the range of a real iteration here.
    assert 1e-5 < last["predicted_seconds"][last["steps"]] < 5.0
    stats = engine.stats()
    assert stats.policy == "goodput" and stats.goodput is not None
    text = Metrics(engine, "m").render().decode()
    for name in ("specdial:spec_decode_predicted_iteration_seconds{model_name=\"m\",steps=\"3\"}",
                 "specdial:spec_decode_acceptance_estimate{model_name=\"m\",position=\"0\"}",
                 "specdial:spec_decode_policy_probes_total", "specdial:spec_decode_policy_off_pace_total",
                 "specdial:spec_decode_policy_batch_size"):
        assert name in text, name
    engine.shutdown()
    ema = Engine.from_modules(tiny.target, tiny.draft_noisy,
                              speculative_adaptive_config=AdaptiveConfig.ema_default(), **KW)
    assert ema.stats().goodput is None and "predicted_iteration_seconds" not in Metrics(ema, "m").render().decode()
    ema.shutdown()


def test_cost_table_cli_writes_what_simulate_reads(tiny, tmp_path, capsys):
    out = tmp_path / "table.json"
    assert main(["bench", "cost-table", "--model-path", str(tiny.path), "--draft-model-path",
                 str(tiny.draft_path), "--out", str(out), "--batch-sizes", "1,2", "--steps", "0,2",
                 "--contexts", "8,16", "--n-warmup", "0", "--n-measure", "1",
                 "--kv-cache-tokens", "2048"]) == 0
    table = json.loads(out.read_text())
    assert len(table["entries"]) == 2 * 2 * 2 and table["graph_bs"] is None
    # a progress bar with the points measured, of how many, and the time left (issue 26)
    err = capsys.readouterr().err
    assert "cost table" in err and "8/8" in err and "point" in err, err
    t = CostTable.from_json(out.read_text())
    assert t.steps == [0, 2] and t.seconds(2, 1, 24.0) > 0
    assert main(["policy", "simulate", "--regime", "steady-code", "--curve", str(out),
                 "--segments", "1000"]) == 0
    assert "table" in capsys.readouterr().out
    assert main(["bench", "cost-table", "--model-path", str(tiny.path), "--steps", "x"]) == 2


def test_simulate_interference_is_validated_and_slows_only_the_measurements(capsys):
    """``--interference`` (other work slowing the machine in stretches) must be in [0, 1]; it
    changes what the policies measure, not the noise-free cost the contenders are scored on."""
    assert main(["policy", "simulate", "--interference", "1.5", "--segments", "100"]) == 2
    assert "interference must be in [0, 1]" in capsys.readouterr().err
    spec = dict(regimes=["steady-code"], curves=["cpu-like"], policies=None, segments=1500,
                seed=0, noise=0.1, spikes=0.0)
    quiet = {c["curve"]: c for c in run_simulation(build_spec(**spec))}["cpu-like"]
    busy = {c["curve"]: c for c in run_simulation(build_spec(**spec, interference=0.5))}["cpu-like"]
    fixed = lambda case: {r["name"]: r["goodput"] for r in case["results"]}["fixed-3"]
    assert fixed(quiet) == fixed(busy)  # fixed steps see no measurement
    assert quiet["ratios"]["goodput"] != busy["ratios"]["goodput"]


def test_on_the_cpu_with_one_thread_the_policy_learns_cpu_seconds(tiny, tmp_path):
    """On the CPU with one torch thread the iteration's seconds reported to the policy are the
    loop thread's CPU time: a wait inside the iteration (here a 100 ms sleep in the worker's
    decode, as a wait for a core on a loaded machine) is not in them; with two threads
    (intra-op work on other threads) they are wall seconds and include it."""
    import time

    import torch

    # well above a tiny-model iteration's CPU time even on a slow, loaded machine (a few ms)
    WAIT = 0.1

    def run(threads: int) -> list[float]:
        trace = tmp_path / f"trace{threads}.jsonl"
        torch.set_num_threads(threads)
        try:
            engine = Engine.from_modules(tiny.target, tiny.draft_noisy, record_trace=str(trace),
                                         **KW)
        finally:
            torch.set_num_threads(1)
        real = engine.worker.decode

        def waiting(*args, **kwargs):
            time.sleep(WAIT)
            return real(*args, **kwargs)

        engine.worker.decode = waiting
        engine.generate(input_ids=PROMPTS[:1], sampling_params=greedy(8))
        engine.shutdown()
        return [json.loads(x)["seconds"] for x in trace.read_text().splitlines()]

    cpu = run(1)
    assert cpu and all(0 < s < WAIT for s in cpu), cpu
    wall = run(2)
    assert wall and all(s >= WAIT for s in wall), wall
