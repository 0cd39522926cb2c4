"""`specdial policy replay` on the sample trace and on bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdial import AdaptiveConfig
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


def test_replay_json_summary_is_consistent(capsys, tmp_path):
    ema = tmp_path / "ema.json"
    ema.write_text(AdaptiveConfig.ema_default().to_json())
    assert main(["policy", "replay", "--config", str(ema), "--trace", str(TRACE), "--json"]) == 0
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
        ('{"batch_size": 1, "accepted": [1], "steps": 3, "tree_topk": 4}',
         "tree_topk and tree_nodes come together"),
        ('{"batch_size": 1, "accepted": [1], "steps": 3, "tree_topk": 1, "tree_nodes": 3}',
         "tree_topk must be an integer in 2..64"),
        ('{"batch_size": 1, "accepted": [1], "tree_topk": 2, "tree_nodes": 3}',
         "a tree line needs its depth as steps >= 1"),
        ('{"batch_size": 1, "accepted": [1], "steps": 2, "tree_topk": 2, "tree_nodes": 7}',
         "tree_nodes must be an integer in 2..6"),
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
    assert main(["policy", "replay", "--trace", str(TRACE), "--initial-steps", "9"]) == 2
    assert "candidate of no slot" in capsys.readouterr().err
    assert main(["policy", "replay", "--trace", str(tmp_path / "missing.jsonl")]) == 2


def test_replay_with_a_cost_table_gives_goodput(tmp_path, capsys):
    """With a cost table every verify costs what the table says; the goodput strategy learns from
    those seconds and ends up preferring the steps the table makes cheap."""
    # Drafting is almost free: deep steps pay on the sample trace's accepting phases.
    entries = [{"batch_size": b, "steps": k, "seconds": 0.01 * (1 + 0.02 * k) * (1 + b / 64)}
               for b in (1, 64) for k in range(8)]
    table = tmp_path / "cheap.json"
    table.write_text(json.dumps({"device": "test", "entries": entries}))
    assert main(["policy", "replay", "--trace", str(TRACE), "--cost-table", str(table), "--json"]) == 0
    cheap = json.loads(capsys.readouterr().out)
    assert cheap["strategy"] == "goodput" and cheap["seconds"] > 0 and cheap["tokens_per_second"] > 0
    # Drafting costs a whole verify per step: plain decoding wins, the same trace runs mostly 0.
    entries = [{**e, "seconds": 0.01 * (1 + e["steps"])} for e in entries]
    table.write_text(json.dumps({"entries": entries}))
    assert main(["policy", "replay", "--trace", str(TRACE), "--cost-table", str(table), "--json"]) == 0
    dear = json.loads(capsys.readouterr().out)
    def share_of_zero(s):
        counts = [c for slot in s["iterations_per_steps"].values() for c in [slot]]
        total = sum(sum(c.values()) for c in counts)
        return sum(c.get("0", 0) for c in counts) / total
    assert share_of_zero(dear) > 0.8 > share_of_zero(cheap), (share_of_zero(dear), share_of_zero(cheap))
    assert dear["probes"] > 0
    bad = tmp_path / "bad.json"
    bad.write_text('{"entries": [{"batch_size": 1, "steps": 0, "seconds": 0}]}')
    assert main(["policy", "replay", "--trace", str(TRACE), "--cost-table", str(bad)]) == 2
    assert "entries[0].seconds" in capsys.readouterr().err


def test_simulate_cli(capsys, tmp_path):
    assert main(["policy", "simulate", "--regime", "load-ramp", "--curve", "cpu-like",
                 "--segments", "3000"]) == 0
    out = capsys.readouterr().out
    assert "load-ramp" in out and "cpu-like" in out and "best fixed" in out
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"entries": [
        {"batch_size": b, "steps": k, "context_per_request": 0, "seconds": 0.01 + 0.001 * b * (k + 1)}
        for b in (1, 8, 64) for k in range(8)]}))
    assert main(["policy", "simulate", "--regime", "steady-code", "--curve", str(table),
                 "--segments", "2000", "--json"]) == 0
    cases = json.loads(capsys.readouterr().out)
    assert cases[0]["curve"] == "t" and cases[0]["ratios"]["goodput"] > 0.9
    assert main(["policy", "simulate", "--regime", "nope"]) == 2
    assert "is not one of" in capsys.readouterr().err
    assert main(["policy", "simulate", "--config", "x"]) == 2
    assert "NAME=FILE" in capsys.readouterr().err


def test_replay_accepts_tree_lines_and_counts_them(tmp_path, capsys):
    """A trace recorded with draft trees (``tree_topk``, ``tree_nodes`` on tree iterations,
    as ``--record-trace`` writes them) replays; the summary counts the tree verifies."""
    lines = ['{"batch_size": 1, "accepted": [2], "steps": 3, "tree_topk": 4, "tree_nodes": 8}',
             '{"batch_size": 1, "accepted": [1], "steps": 3}',
             '{"batch_size": 2, "accepted": [3, 0], "steps": 3, "tree_topk": 2, '
             '"tree_nodes": 5, "context_tokens": 40}']
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines * 4) + "\n")
    assert main(["policy", "replay", "--trace", str(trace), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["verifies"] == 12 and summary["tree_verifies"] == 8
    assert main(["policy", "replay", "--trace", str(trace)]) == 0
    assert "8 verifies recorded as draft trees" in capsys.readouterr().out


def test_engine_trace_of_a_fixed_tree_carries_its_shape_and_replays(tiny, tmp_path, capsys):
    """``record_trace`` through the Engine with a fixed tree (depth 3, topk 4, 8 tokens with
    the root: 7 nodes): every decode line has ``tree_topk`` 4 and ``tree_nodes`` 7, and the
    trace replays with all of them counted as tree verifies."""
    from conftest import PROMPTS
    from greedy import greedy
    from specdial.engine import Engine

    trace = tmp_path / "trace.jsonl"
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, record_trace=str(trace),
                                 speculative_adaptive=False, speculative_num_steps=3,
                                 speculative_eagle_topk=4, speculative_num_draft_tokens=8,
                                 max_running_requests=4, kv_cache_tokens=1024, page_size=8)
    engine.generate(input_ids=PROMPTS, sampling_params=greedy(12))
    engine.shutdown()
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert lines and all((x["tree_topk"], x["tree_nodes"], x["steps"]) == (4, 7, 3)
                         for x in lines)
    assert main(["policy", "replay", "--trace", str(trace), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["verifies"] == summary["tree_verifies"] == len(lines)
