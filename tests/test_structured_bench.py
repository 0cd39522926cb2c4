"""Smoke run of benches/structured_ab.py (issue 31): every mode runs and reports its figures
(no speed is asserted)."""

from test_benches import run_json_bench


def test_structured_ab_smoke():
    result = run_json_bench("structured_ab.py", "--concurrency", "2", "--repetitions", "1",
                            "--max-new-tokens", "6")
    rows = result["2"]
    assert set(rows) == {"none", "schema", "mixed"}
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["accept_length"] >= 1
    assert rows["none"]["ratio"] == 1.0 and rows["none"]["cpu_ratio"] == 1.0
    assert result["attach_cost_ns"] > 0
