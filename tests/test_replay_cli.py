"""`specdial policy replay` on the sample trace and on bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdial.cli import main

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "examples" / "sample_trace.jsonl"
CONFIG = ROOT / "examples" / "adaptive_config.json"


def test_replay_sample_trace(capsys):
    assert main(["policy", "replay", "--config", str(CONFIG), "--trace", str(TRACE)]) == 0
    out = capsys.readouterr().out
    assert "steps 3 -> 5" in out  # the high-acceptance opening phase climbs
    assert "950 verifies" in out
    assert "slot  iterations per steps" in out


def test_replay_json_summary_is_consistent(capsys):
    assert main(["policy", "replay", "--trace", str(TRACE), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["verifies"] == 950
    total = sum(sum(c.values()) for c in summary["iterations_per_steps"].values())
    assert total == 950
    # The low-acceptance batch-12 phase drives slot 8 to steps 0 at some point.
    assert summary["iterations_per_steps"]["8"].get("0", 0) > 0
    # Slot 64's only candidate is 0.
    assert set(summary["iterations_per_steps"]["64"]) == {"0"}


def test_replay_is_the_console_script():
    exe = Path(sys.executable).with_name("specdial")
    proc = subprocess.run([str(exe), "policy", "replay", "--trace", str(TRACE), "--quiet"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "step switches" in proc.stdout


@pytest.mark.parametrize(
    "line, match",
    [
        ("{", "not valid JSON"),
        ("[1]", "expected a JSON object"),
        ('{"accepted": [1]}', "batch_size must be an integer >= 1"),
        ('{"batch_size": 2, "accepted": [1]}', "accepted has 1 entries but batch_size is 2"),
        ('{"batch_size": 1, "accepted": [-1]}', "accepted must be a list of integers >= 0"),
        ('{"batch_size": 1, "accepted": [1.5]}', "accepted must be a list of integers >= 0"),
        ('{"batch_size": 1, "accepted": [4], "steps": 3}', "exceeds the recorded steps 3"),
    ],
)
def test_bad_line_names_its_number(tmp_path, capsys, line, match):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"batch_size": 1, "accepted": [0]}\n\n' + line + "\n")
    assert main(["policy", "replay", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert f"t.jsonl:3: " in err and match in err, err


def test_bad_config_and_initial_steps(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text('{"1": {"candidate_steps": [1], "bogus": 1}}')
    assert main(["policy", "replay", "--config", str(cfg), "--trace", str(TRACE)]) == 2
    assert 'unknown key "bogus"' in capsys.readouterr().err
    assert main(["policy", "replay", "--trace", str(TRACE), "--initial-steps", "2"]) == 2
    assert "candidate of no slot" in capsys.readouterr().err
    assert main(["policy", "replay", "--trace", str(tmp_path / "missing.jsonl")]) == 2
