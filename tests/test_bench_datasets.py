"""Issue 13's benchmark tooling: prompt sets as package data, the ShareGPT and random datasets
of ``specdial bench``, extras checked before a run starts, results written before plotting."""

from __future__ import annotations

import json

import pytest

from specdial.bench.datasets import PACKAGE_PROMPTS, build_requests, prompts_dir
from specdial.bench.serving_datasets import random_requests, sharegpt_requests
from specdial.cli import main
from test_bench import prompts  # noqa: F401 - the fixture


def test_prompt_sets_are_package_data():
    assert prompts_dir() == PACKAGE_PROMPTS
    assert PACKAGE_PROMPTS.parent.name == "bench" and PACKAGE_PROMPTS.parent.parent.name == \
        "specdial"
    for name in ("code", "prose", "hard"):
        assert (PACKAGE_PROMPTS / f"{name}.jsonl").is_file()
    assert len(build_requests("mixed", 20)) == 20


def sharegpt_file(tmp_path):
    convs = [
        {"id": "a", "conversations": [{"from": "human", "value": "one two three four five"},
                                      {"from": "gpt", "value": "six seven eight nine ten x"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "hi"}]},  # no reply
        {"id": "c", "conversations": [{"from": "human", "value": "a b"},  # prompt too short
                                      {"from": "gpt", "value": "c d e f g"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "p q r s t u"},
                                      {"from": "gpt", "value": "v w x y"},
                                      {"from": "human", "value": "later turns ignored"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    return path


def test_sharegpt_requests(tmp_path):
    def encode(text):
        return list(range(len(text.split())))

    reqs = sharegpt_requests(sharegpt_file(tmp_path), 5, encode=encode, seed=1)
    assert len(reqs) == 5 and {r.workload for r in reqs} == {"sharegpt"}
    lengths = {(len(r.input_ids), r.max_new_tokens) for r in reqs}
    assert lengths == {(5, 6), (6, 4)}  # the reply's length is the output length
    fixed = sharegpt_requests(sharegpt_file(tmp_path), 2, encode=encode, output_len=3)
    assert {r.max_new_tokens for r in fixed} == {3}
    only_short = sharegpt_requests(sharegpt_file(tmp_path), 2, encode=encode,
                                   fits=lambda p, o: p + o <= 10)
    assert {len(r.input_ids) for r in only_short} == {6}
    with pytest.raises(ValueError, match="not found"):
        sharegpt_requests(tmp_path / "none.json", 1, encode=encode)


def test_random_requests_lengths_and_seed():
    a = random_requests(50, vocab_size=100, input_len=20, output_len=10, range_ratio=0.5,
                        seed=3)
    assert a == random_requests(50, vocab_size=100, input_len=20, output_len=10,
                                range_ratio=0.5, seed=3)
    assert all(10 <= len(r.input_ids) <= 30 and 5 <= r.max_new_tokens <= 15 for r in a)
    assert len({len(r.input_ids) for r in a}) > 3
    assert all(0 <= t < 100 for r in a for t in r.input_ids)
    exact = random_requests(3, vocab_size=10, input_len=7, output_len=4)
    assert {(len(r.input_ids), r.max_new_tokens) for r in exact} == {(7, 4)}
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(1, vocab_size=10, input_len=1, output_len=1, range_ratio=1.0)


def _tiny_args(tiny):
    return ["--model-path", str(tiny.path), "--draft-model-path", str(tiny.draft_path),
            "--log-level", "error", "--no-progress"]


def test_bench_random_dataset_per_request_lengths(tiny, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["bench", *_tiny_args(tiny), "--dataset", "random", "--random-input-len", "6",
               "--random-output-len", "5", "--random-range-ratio", "0.4", "--num-prompts",
               "6", "--concurrency", "3", "--output-json", str(out)])
    assert rc == 0, capsys.readouterr().err
    s = json.loads(out.read_text())["summary"]
    want = sum(r.max_new_tokens for r in random_requests(
        6, vocab_size=tiny.target.config.vocab_size, input_len=6, output_len=5,
        range_ratio=0.4, seed=0))
    assert s["completed"] == 6 and s["output_tokens"] == want


def test_bench_sharegpt_over_http(tmp_path, capsys):
    from test_server_fake_engine import FakeEngine, LiveServer

    engine = FakeEngine(delay=0.001)
    out = tmp_path / "s.json"
    with LiveServer(engine, name="fake") as server:
        rc = main(["bench", "--backend", "http", "--base-url", server.url, "--dataset",
                   "sharegpt", "--dataset-path", str(sharegpt_file(tmp_path)),
                   "--num-prompts", "4", "--no-progress", "--output-json", str(out)])
    assert rc == 0, capsys.readouterr().err
    s = json.loads(out.read_text())["summary"]
    # the fake's tokenizer is characters: output lengths are the replies' character counts
    assert s["completed"] == 4 and s["output_tokens"] in (2 * 26 + 2 * 7, 26 * 3 + 7,
                                                          26 + 3 * 7)
    assert {len(sub["sampling_params"]) > 0 for sub in engine.submitted.values()} == {True}
    assert {sub["sampling_params"]["max_new_tokens"] for sub in engine.submitted.values()} <= \
        {26, 7}


def test_missing_extras_fail_before_running(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("httpx", "matplotlib") else real(name, *a))

    def never(*a, **k):
        raise AssertionError("nothing may run")

    monkeypatch.setattr("specdial.bench.compare.run_comparison", never)
    assert main(["bench", "--backend", "http"]) == 2
    assert "pip install 'specdial[bench]'" in capsys.readouterr().err
    assert main(["bench", "compare"]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "--no-plots" in err


def test_results_are_written_before_plotting(prompts, tmp_path, monkeypatch):
    from specdial.bench import compare
    from test_bench import FakeStreamEngine

    def broken(result, out):
        raise RuntimeError("plotting failed")

    result = compare.run_comparison(
        lambda c: FakeStreamEngine(steps=1, accept=2, delay=0.001),
        compare.parse_configurations("no-spec,fixed-1"), ["code"], [1], num_prompts=2,
        max_new_tokens=4, repetitions=1, warmup_prompts=0, prompts_dir=str(prompts),
        sample_interval=0.005, progress=False)
    monkeypatch.setattr("specdial.bench.plots.plot_comparison", broken)
    with pytest.raises(RuntimeError, match="plotting failed"):
        compare.write_outputs(result, tmp_path / "o")
    saved = json.loads((tmp_path / "o" / "compare.json").read_text())
    assert len(saved["results"]) == 2 and (tmp_path / "o" / "compare.md").is_file()


def test_an_unknown_dataset_name_lists_the_names(capsys):
    # before: "prompt file not found: nope", naming neither --dataset nor its names
    assert main(["bench", "--dataset", "nope", "--no-progress", "--log-level", "error"]) == 2
    err = capsys.readouterr().err
    assert "--dataset 'nope'" in err and "not found" in err
    for name in ("code", "mixed-batch", "sharegpt", "random", "generated-shared-prefix"):
        assert name in err
    from specdial.bench.datasets import DATASET_NAMES
    from specdial.bench.prefix_workloads import PREFIX_DATASETS
    from specdial.bench.serving_datasets import SERVING_DATASETS

    assert {*SERVING_DATASETS, *PREFIX_DATASETS} <= set(DATASET_NAMES)  # the message's list


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_bench_temperature_is_checked_before_the_run(value, capsys):
    # before: --temperature nan loaded the engine and failed every request of the run
    assert main(["bench", "--temperature", value, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--temperature must be a finite number >= 0" in err and "loading" not in err
