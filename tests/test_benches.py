"""Smoke runs of the benchmark scripts (they run and print their figures; no speed is asserted)."""

import json
import subprocess
import sys
from pathlib import Path
from timeouts import scaled

ROOT = Path(__file__).resolve().parents[1]


def test_policy_py_bench_smoke():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "policy_py.py"), "--iterations", "300", "--rounds", "1", "--json"],
        capture_output=True, text=True, timeout=scaled(120),
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert set(result) >= {"compiled_ns", "reference_ns", "ratio", "batch_size"}
    assert result["batch_size"] == 64
    assert result["clock"] == "wall"


def test_policy_py_bench_thread_clock():
    """``--clock thread`` times with this thread's CPU time (readable on a busy machine); an
    unknown clock is refused naming the choices."""
    cmd = [sys.executable, str(ROOT / "benches" / "policy_py.py"), "--iterations", "300",
           "--rounds", "1", "--json"]
    proc = subprocess.run(cmd + ["--clock", "thread"], capture_output=True, text=True,
                          timeout=scaled(120))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["clock"] == "thread" and result["reference_ns"] > 0
    bad = subprocess.run(cmd + ["--clock", "cpu"], capture_output=True, text=True,
                         timeout=scaled(120))
    assert bad.returncode == 2 and "thread" in bad.stderr and "wall" in bad.stderr


def test_iteration_profile_smoke(tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "iteration_profile.py"), "--concurrency", "2",
         "--configs", "no-spec,fixed-3", "--max-new-tokens", "6", "--threads", "1",
         "--output-json", str(out)],
        capture_output=True, text=True, timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["config"] for r in rows] == ["no-spec", "fixed-3"]
    for r in rows:
        assert r["tokens"] == 6 * r["requests"] and r["iterations"] > 0
        shares = r["forwards_share"] + r["scheduler_share"] + r["other_share"]
        assert 0 < r["forwards_share"] < 1 and abs(shares - 1) < 0.01
        assert (r["drafter_share"] > 0) == (r["config"] != "no-spec")


def run_json_bench(script: str, *args: str):
    """``benches/<script> *args --json`` in a subprocess -> its parsed JSON output."""
    proc = subprocess.run([sys.executable, str(ROOT / "benches" / script), *args, "--json"],
                          capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_seeded_acceptance_smoke():
    [row] = run_json_bench("seeded_acceptance.py", "--num-prompts", "2", "--max-new-tokens", "8",
                           "--drafters", "EAGLE", "--datasets", "code")
    assert row["drafter"] == "EAGLE" and row["prompts"] == 2
    assert row["seeded"] >= 1 and row["unseeded"] >= 1 and row["seeded_verifies"] > 0


def test_processors_cost_smoke():
    result = run_json_bench("processors_cost.py", "--batch", "2", "--num-prompts", "2",
                            "--max-new-tokens", "6", "--repetitions", "1")
    assert set(result["end_to_end"]) == {"none", "min_tokens", "penalties"}
    assert result["end_to_end"]["none"]["ratio"] == 1.0
    assert result["processing"]["verify_processing_ms"] > 0


def test_dp_processes_bench_smoke(tmp_path):
    """benches/dp_processes.py (issue 32) on the Engine path: every configuration runs, the
    figures and the greedy-identity flag are written."""
    out = tmp_path / "dp.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "dp_processes.py"), "--paths", "engine",
         "--repeats", "1", "--tokens", "4", "--requests", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=scaled(900))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())["engine"]
    assert set(result["median_tps"]) == {"dp1_1thread", "dp1_2threads", "dp2_processes",
                                         "dp1_half_batch"}
    assert result["split_cpu_over_half_batch"] > 0
    assert result["identical"] is True and result["dp2_over_best_dp1"] > 0


def test_dp_http_benches_smoke(tmp_path):
    """The HTTP path of benches/dp_processes.py with ``--configs`` (the serving process's own
    CPU share reported; only the ratios of what ran), and benches/dp_thread_cpu.py's split of
    a dp 2 server's CPU by process and thread (thread ids without py-spy)."""
    out = tmp_path / "dp.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "dp_processes.py"), "--paths", "http",
         "--configs", "dp1_1thread,dp2_processes", "--repeats", "1", "--tokens", "4",
         "--requests", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=scaled(900))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())["http"]
    assert set(result["median_tps"]) == {"dp1_1thread", "dp2_processes"}
    server = result["median_server_cpu_ms_per_token"]
    assert 0 <= server["dp2_processes"] <= result["median_cpu_ms_per_token"]["dp2_processes"]
    assert "split_cpu_over_half_batch" not in result and result["identical"] is True
    out = tmp_path / "threads.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "dp_thread_cpu.py"), "--dp", "2", "--repeats",
         "1", "--tokens", "32", "--requests", "2", "--py-spy", "", "--out", str(out)],
        capture_output=True, text=True, timeout=scaled(900))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["new"]["ms_per_token"]
    assert {k.split()[0] for k in rows} <= {"server", "replica0", "replica1"}
    assert any(k.startswith("replica") for k in rows), rows


def test_verify_budgets_benches_smoke(tmp_path):
    """Issue 28's scripts: the cost of a budgeted iteration, and the paired A/B on mixed-batch."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "verify_budgets_cost.py"), "--batch", "4",
         "--rounds", "1", "--iters", "1", "--depth", "3"],
        capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])["4"]
    assert row["verify_tokens"] == {"padded": 16, "budgets": 9}  # budgets 0, 1, 1, 3
    out = tmp_path / "ab.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "verify_budgets_ab.py"), "--a",
         '{"speculative_adaptive": false, "speculative_num_steps": 0}', "--b",
         '{"speculative_adaptive": false, "speculative_num_steps": 2}', "--concurrency", "2",
         "--rounds", "1", "--num-prompts", "2", "--max-new-tokens", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())["by_concurrency"]["2"]
    assert len(res["ratios"]) == 1 and res["median_ratio_b_over_a"] > 0
    # the CPU clocks beside the wall one: the loop thread's CPU is part of the process's
    assert res["median_cpu_ratio_b_over_a"] > 0 and len(res["by_arm"]["b"]["cpu"]["ratios"]) == 1
    proc_ms, loop_ms = res["median_cpu_ms_per_token"], res["median_loop_cpu_ms_per_token"]
    assert all(0 < loop_ms[arm] <= proc_ms[arm] for arm in ("a", "b")), (proc_ms, loop_ms)


def test_verify_budgets_ab_gives_every_arm_every_position():
    """The paired A/B's order: two arms alternate (each first in half the rounds), three run
    all six orders in six rounds."""
    sys.path.insert(0, str(ROOT / "benches"))
    try:
        from verify_budgets_ab import round_order
    finally:
        sys.path.remove(str(ROOT / "benches"))
    two = [round_order(["a", "b"], r)[0] for r in range(8)]
    assert two.count("a") == two.count("b") == 4, two
    three = {tuple(round_order(["a", "b", "c"], r)) for r in range(6)}
    assert len(three) == 6, three


def test_prefix_cache_ab_smoke():
    """Issue 30's on/off script runs both workloads, alternating, and reports both sides (no
    speed is asserted: cached tokens and ratios are figures)."""
    rows = run_json_bench("prefix_cache_ab.py", "--repetitions", "2", "--conversations", "1",
                          "--max-new-tokens", "4", "--groups", "1", "--per-group", "2",
                          "--system-prompt-len", "32", "--question-len", "4")
    assert [r["workload"] for r in rows] == ["multiturn", "shared-prefix"]
    for r in rows:
        assert len(r["runs"]["on"]) == len(r["runs"]["off"]) == 2
        off = r["runs"]["off"]
        assert all(run["cached_tokens"] == 0 for run in off)  # the cache off: no hit
        assert r["ttft_ratio_off_on"] > 0 and r["throughput_ratio_on_off"] > 0
    assert rows[0]["runs"]["on"][0]["ttft_per_turn_ms"]  # multi-turn: TTFT per turn


def test_tree_worker_bench_smoke():
    """benches/tree_worker.py (issue 29): chains and trees decode through the worker and the
    figures come back per configuration (no speed asserted)."""
    out = run_json_bench("tree_worker.py", "--reps", "1", "--num-prompts", "1",
                         "--max-new-tokens", "6", "--datasets", "code",
                         "--configs", "nospec,chain-2,tree-2x2x3,treepath-2", "--cost-tokens",
                         "1,4", "--clock", "thread")
    rows = out["rows"]
    assert [r["config"] for r in rows] == ["nospec", "chain-2", "tree-2x2x3", "treepath-2"]
    assert rows[0]["accept_length"] == 1.0
    assert all(r["tokens_per_s"] > 0 and r["accept_length"] >= 1.0 for r in rows)
    assert set(out["target_forward_ms"]) == {"1", "4"}


def test_tree_ab_bench_smoke():
    """benches/tree_ab.py: every arm runs, outputs identical (greedy is lossless), the paired
    ratios are reported."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "tree_ab.py"), "--repeats", "1", "--n-prompts",
         "1", "--tokens", "12", "--json"],
        capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["identical"] is True
    assert set(result["tokens_per_s"]) == {"chain_adaptive", "tree_adaptive", "chain_fixed",
                                           "tree_fixed"}
    assert {"tree/chain adaptive", "tree/chain fixed"} <= set(result)


def test_hf_assisted_bench_smoke():
    """benches/hf_assisted.py (issue 29): transformers' assisted generation and specdial's arms
    run on the same prompts, emit the same greedy tokens, and the paired ratios come back with
    their bootstrap intervals and the pinned transformers version and schedules."""
    out = run_json_bench("hf_assisted.py", "--repeats", "2", "--n-prompts", "1", "--tokens", "6",
                         "--datasets", "code", "--arms", "chain_adaptive,tree_fixed",
                         "--bootstrap", "50")
    assert out["identical"] is True and out["torch_threads"] == 1
    assert out["transformers"] and set(out["hf_arms"]) == {"hf_default", "hf_heuristic"}
    assert out["hf_arms"]["hf_heuristic"]["num_assistant_tokens_schedule"] == "heuristic"
    row = out["datasets"]["code"]
    assert set(row["tokens_per_s"]) == {"hf_default", "hf_heuristic", "chain_adaptive",
                                        "tree_fixed"}
    for clock in ("datasets", "datasets_cpu"):  # wall time and the process's CPU time
        row = out[clock]["code"]
        for base in ("hf_default", "hf_heuristic"):
            for arm in ("chain_adaptive", "tree_fixed"):
                r = row["ratio_to"][base][arm]
                assert len(r["ratios"]) == 2 and r["ci90"][0] <= r["median"] <= r["ci90"][1]


def test_tree_ab_bench_concurrency_smoke():
    """benches/tree_ab.py --concurrency: the requests go in together (one batch), outputs stay
    identical across arms, the paired ratio is reported; a concurrency below 1 is refused."""
    cmd = [sys.executable, str(ROOT / "benches" / "tree_ab.py"), "--repeats", "1", "--tokens",
           "6", "--arms", "chain_adaptive,tree_adaptive", "--json"]
    proc = subprocess.run(cmd + ["--concurrency", "3"], capture_output=True, text=True,
                          timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["identical"] is True and result["args"]["concurrency"] == 3
    assert result["tree/chain adaptive"] > 0 and result["cpu tree/chain adaptive"] > 0
    bad = subprocess.run(cmd + ["--concurrency", "0"], capture_output=True, text=True,
                         timeout=scaled(120))
    assert bad.returncode == 2 and "--concurrency" in bad.stderr
