"""benches/gpu_check.py, the issue-7 GPU script, in its CPU smoke mode: the same sections with
tiny shapes, graphs emulated (captured once, replays re-run into fixed output tensors)."""

import json
import subprocess
import sys
from pathlib import Path
from timeouts import scaled

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "gpu_check.py"), "--cpu-smoke", "--out",
         str(tmp_path)], capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["status"] == "OK" and res["elapsed_s"] < scaled(60)  # a stall bound
    assert res["env"]["cpu_smoke"] is True

    parity = res["parity"]
    assert parity["status"] == "PASS"
    runs = {k: v for k, v in parity.items() if isinstance(v, dict)}
    assert {"random steps=0", "random steps=7", "random adaptive", "random switching",
            "accepting steps=3", "accepting switching-skip0"} <= set(runs)
    for name, run in runs.items():
        assert run["graphs_equal_eager"] and run["equal_target_only"], name
    # graphs really served: every pass kind replayed somewhere, padded sizes included
    replays = {kind: 0 for kind in ("draft", "verify", "extend")}
    for run in runs.values():
        for per_steps in run["replays"].values():
            for kind, count in per_steps.items():
                replays[kind] += count
    assert min(replays.values()) > 0, replays
    assert runs["accepting steps=3"]["accept_length"] > 1.0  # extends of real length ran
    assert runs["random adaptive"]["decode"]["graphs"]["switches"] >= 1
    assert len(runs["random switching"]["decode"]["graphs"]["steps_histogram"]) >= 4

    engine = res["engine_parity"]
    assert engine["status"] == "PASS", engine
    for name in ("steps=0", "steps=7", "adaptive"):
        assert engine[name]["graphs_equal_eager"] and engine[name]["replays"]["verify"] > 0
        assert engine[name]["logprobs_equal"]
    timing = res["timing"]
    assert set(timing["rows"]) == {"plain", "steps=0", "steps=1", "steps=3", "steps=0 skip"}
    cell = timing["rows"]["steps=3"]["4"]
    assert cell["graphs"]["median_ms"] > 0 and cell["eager"]["median_ms"] > 0
    assert set(res["step0"]) == {"1", "4"}
    cap = res["capture"]
    assert 0 < cap["pruned"]["graphs"] < cap["unpruned"]["graphs"]
    assert cap["default_config_graphs"] > 0
    assert cap["pruned"]["sizes"]["7"] == [4, 2, 1]
    # the measured surface as a cost table the simulator reads, and the simulator over it
    from specdial import CostTable

    ct = json.loads((tmp_path / "cost_table.json").read_text())
    assert ct["graph_bs"] == [1, 4] and len(ct["entries"]) == 3 * 2  # steps 0, 1, 3 x bs 1, 4
    CostTable.from_json((tmp_path / "cost_table.json").read_text())
    sim = res["cost_table"]["mean_goodput_over_oracle"]
    assert {"goodput", "ema", "throughput_aware", "fixed-0", "fixed-7"} <= set(sim)
    assert "mean" in (tmp_path / "simulate.txt").read_text()
    table = (tmp_path / "table.md").read_text()
    assert "| parity random steps=0 | PASS |" in table and "per-iteration ms" in table
    assert proc.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])
