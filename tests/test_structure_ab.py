"""benches/structure_ab.py: parsing criterion's output and the profile's rows, the medians, and
its argument checks (the full run needs cargo and two checkouts; the integrator runs it)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("structure_ab", ROOT / "benches" / "structure_ab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CRITERION = """\
Benchmarking scheduler/plan_report/256/steps=0: Analyzing
scheduler/plan_report/256/steps=0
                        time:   [41.517 µs 41.802 µs 42.151 µs]
                        thrpt:  [6.0735 Melem/s 6.1241 Melem/s 6.1661 Melem/s]
scheduler/plan_report/256/steps=7 time:   [980.10 ns 1.0123 µs 1.0410 µs]
scheduler/plan_only/256/steps=3
                        time:   [10.000 µs 11.000 µs 12.000 µs]
scheduler/plan_report_kv_layout/256/steps=3
                        time:   [1.5000 ms 1.6000 ms 1.7000 ms]
"""


def test_parse_criterion_point_estimates_in_microseconds(ab):
    got = ab.parse_criterion(CRITERION)
    assert got == pytest.approx({"scheduler/plan_report/256/steps=0": 41.802,
                                 "scheduler/plan_report/256/steps=7": 1.0123,
                                 "scheduler/plan_report_kv_layout/256/steps=3": 1600.0})


def test_parse_criterion_unknown_unit_names_it(ab):
    with pytest.raises(ValueError, match="'min'"):
        ab.parse_criterion("scheduler/plan_report/1 time: [1.0 min 2.0 min 3.0 min]")


def test_profile_figures_and_medians(ab):
    rows = [{"config": "no-spec", "forwards_share": 0.75, "other_share": 0.2,
             "ms_per_iteration": 4.0},
            {"config": "fixed-3", "forwards_share": 0.9, "other_share": 0.08,
             "ms_per_iteration": 9.0}]
    fig = ab.profile_figures(rows)
    assert fig["no-spec outside_forwards"] == pytest.approx(0.25)
    assert fig["fixed-3 other_share"] == 0.08 and fig["fixed-3 ms_per_iteration"] == 9.0
    rounds = {"before": [{"x": 1.0, "only_before": 5.0}, {"x": 3.0}, {"x": 10.0}],
              "after": [{"x": 2.0}, {"x": 4.0}, {"x": 0.0}]}
    assert ab.summarize(rounds) == [("only_before", 5.0, None), ("x", 3.0, 2.0)]


def test_main_rejects_a_checkout_without_venv(ab, tmp_path, capsys):
    with pytest.raises(SystemExit):
        ab.main([str(tmp_path), str(tmp_path), "--rounds", "1"])
    assert "has no .venv/bin/python" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main([str(tmp_path), str(tmp_path), "--rounds", "0"])
    assert "--rounds must be >= 1" in capsys.readouterr().err
