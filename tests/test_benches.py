"""Smoke runs of the benchmark scripts (they run and print their figures; no speed is asserted)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_policy_py_bench_smoke():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "policy_py.py"), "--iterations", "300", "--rounds", "1", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert set(result) >= {"compiled_ns", "reference_ns", "ratio", "batch_size"}
    assert result["batch_size"] == 64
