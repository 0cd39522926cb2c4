"""``specdial bench`` and ``specdial bench compare``: the metrics math on hand-built timings,
reproducible Poisson arrivals, the datasets, the /metrics parser, and smoke runs of each command
at a tiny configuration (tiny random models from conftest, a fake streaming engine, a live
server over a fake engine). No speed is asserted."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
from typing import Any, AsyncIterator

import pytest

from specdial.bench.compare import (Configuration, compute_ratios, parse_configurations,
                                    run_comparison, write_outputs)
from specdial.bench.datasets import DatasetError, build_requests, load_jsonl
from specdial.bench.driver import (EngineDriver, poisson_arrivals, prometheus_snapshot,
                                   run_benchmark)
from specdial.bench.metrics import (RequestRecord, RunData, active_steps, percentile,
                                    snapshot, summarize, timeline_series)
from specdial.cli import main
from specdial.engine.api import EngineStats, StreamChunk

PNG = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------- helpers
def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture()
def prompts(tmp_path):
    """code.jsonl / hard.jsonl with token ids (the tiny models have no tokenizer) and
    text.jsonl with text prompts (for the HTTP fake, whose tokenizer is characters)."""
    d = tmp_path / "prompts"
    d.mkdir()
    write_jsonl(d / "code.jsonl", [{"input_ids": [5 + i, 17, 3, 40 + i]} for i in range(6)])
    write_jsonl(d / "hard.jsonl", [{"input_ids": [100 + i, 7, 7, 30, 2]} for i in range(6)])
    write_jsonl(d / "text.jsonl", [{"prompt": f"def f{i}(x):"} for i in range(6)])
    return d


class FakeStreamEngine:
    """A streaming engine double: each request gets 1 token from "prefill", then chunks of
    ``accept`` tokens (a verify accepting ``accept - 1`` of ``steps`` drafts) every ``delay``
    seconds; ``stats()`` reports the counters and ``steps_per_slot``."""

    tokenizer = None
    context_length = 256

    def __init__(self, steps: int = 3, accept: int = 2, delay: float = 0.002) -> None:
        self.steps, self.accept, self.delay = steps, max(1, min(accept, steps + 1)), delay
        self.running = 0
        self.counts: dict[str, Any] = dict(num_drafts=0, draft_tokens_proposed=0,
                                           num_accepted_tokens=0, generation_tokens=0,
                                           requests_finished=0)
        self.shut = False
        self._rid = 0

    async def async_stream(self, prompt: str | None = None, *, input_ids: Any = None,
                           sampling_params: Any = None,
                           stop: Any = None) -> AsyncIterator[StreamChunk]:
        n = sampling_params["max_new_tokens"]
        rid, self._rid = self._rid, self._rid + 1
        self.running += 1
        try:
            await asyncio.sleep(self.delay)
            out, verifies = 1, 0
            self.counts["generation_tokens"] += 1
            yield StreamChunk(rid, "", [1], n == 1, None, {"completion_tokens": 1})
            while out < n:
                await asyncio.sleep(self.delay)
                k = min(self.accept, n - out)
                out, verifies = out + k, verifies + 1
                if self.steps:
                    self.counts["num_drafts"] += 1
                    self.counts["draft_tokens_proposed"] += self.steps
                    self.counts["num_accepted_tokens"] += k - 1
                self.counts["generation_tokens"] += k
                done = out >= n
                self.counts["requests_finished"] += done
                yield StreamChunk(rid, "", [1] * k, done,
                                  {"type": "length", "length": n} if done else None,
                                  {"prompt_tokens": len(input_ids), "completion_tokens": out,
                                   "spec_verify_ct": verifies,
                                   "spec_accept_length": (out - 1) / verifies,
                                   "spec_steps_histogram": {self.steps: verifies}})
        finally:
            self.running -= 1

    def stats(self) -> EngineStats:
        return EngineStats(running=self.running, steps_per_slot={1: self.steps, 8: 0},
                           **self.counts)

    def shutdown(self, drain: bool = True) -> None:
        self.shut = True


# ---------------------------------------------------------------------------- metrics math
def test_percentile_interpolates_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 99) == pytest.approx(1 + 3 * 0.99)
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_request_timings_and_summary_on_hand_built_records():
    # request 0: sent at 0.0, chunks at 0.1 (1 token), 0.3 (3 tokens), 0.4 (2 tokens)
    a = RequestRecord(0, "code", send_time=0.0, prompt_tokens=10)
    for t, k in ((0.1, 1), (0.3, 3), (0.4, 2)):
        a.add_chunk(t, k)
    a.end_time, a.success = 0.4, True
    a.set_meta({"completion_tokens": 6, "spec_verify_ct": 2, "spec_accept_length": 2.5,
                "spec_steps_histogram": {"3": 2}})
    # request 1: sent at 0.2, chunks at 0.5 (1 token), 0.6 (1 token)
    b = RequestRecord(1, "hard", send_time=0.2, prompt_tokens=4)
    b.add_chunk(0.5, 1)
    b.add_chunk(0.6, 1)
    b.end_time, b.success = 0.6, True
    b.set_meta({"spec_verify_ct": 1, "spec_steps_histogram": {0: 1}})
    failed = RequestRecord(2, "code", send_time=0.0, end_time=0.1, error="boom")
    assert a.ttft == pytest.approx(0.1) and b.ttft == pytest.approx(0.3)
    assert a.tpot == pytest.approx(0.3 / 5) and b.tpot == pytest.approx(0.1)
    assert a.itls == pytest.approx([0.2, 0.1]) and b.itls == pytest.approx([0.1])
    timeline = [snapshot(EngineStats(num_drafts=10, draft_tokens_proposed=30,
                                     num_accepted_tokens=5, steps_per_slot={1: 3}), 0.0),
                snapshot({"running": 2, "num_drafts": 14, "draft_tokens_proposed": 42,
                          "num_accepted_tokens": 11, "steps_per_slot": {1: 3},
                          "generation_tokens": 8}, 0.8)]
    s = summarize([RunData([a, b, failed], 0.8, timeline)])
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["boom"]
    assert s["output_tokens"] == 8 and s["input_tokens"] == 14
    assert s["output_throughput"] == pytest.approx(10.0)  # tokens/s
    assert s["request_throughput"] == pytest.approx(2.5)  # requests/s
    assert s["total_token_throughput"] == pytest.approx(22 / 0.8)
    assert s["ttft_s"]["mean"] == pytest.approx(0.2) and s["ttft_s"]["p50"] == pytest.approx(0.2)
    assert s["ttft_s"]["p99"] == pytest.approx(0.1 + 0.2 * 0.99)
    assert s["tpot_s"]["mean"] == pytest.approx((0.06 + 0.1) / 2)
    assert s["itl_s"]["count"] == 3 and s["itl_s"]["p50"] == pytest.approx(0.1)
    assert s["itl_s"]["mean"] == pytest.approx(0.4 / 3)
    assert s["e2e_latency_s"]["mean"] == pytest.approx(0.4)
    assert s["mean_accept_length"] == pytest.approx(1 + 6 / 4)  # 1 + accepted / drafts
    assert s["draft_acceptance_rate"] == pytest.approx(6 / 12)
    assert s["tokens_per_verify"] == pytest.approx((5 + 1) / 3)
    assert s["steps_histogram"] == {0: 1, 3: 2}
    assert s["steps_time_share"] == {3: 1.0}
    assert s["streaming"] is True


def test_no_streaming_has_no_token_latencies():
    r = RequestRecord(0, "code", send_time=1.0, end_time=3.0, streamed=False,
                      completion_tokens=8, success=True)
    assert r.ttft is None and r.tpot is None and r.itls == [] and r.e2e == 2.0
    s = summarize([RunData([r], 2.0, streaming=False)])
    assert s["ttft_s"]["mean"] is None and s["itl_s"]["count"] == 0
    assert s["output_throughput"] == 4.0 and s["mean_accept_length"] is None
    assert s["streaming"] is False


def test_timeline_series_and_active_slot():
    assert active_steps({"running": 0, "steps_per_slot": {1: 5, 8: 0}}) == 5
    assert active_steps({"running": 9, "steps_per_slot": {1: 5, 8: 0}}) == 0
    assert active_steps({"running": 3, "steps_per_slot": {}}) is None
    snaps = [snapshot({"running": 1, "steps_per_slot": {1: 3}}, 0.0),
             snapshot({"running": 1, "steps_per_slot": {1: 5}, "num_drafts": 4,
                       "num_accepted_tokens": 8, "generation_tokens": 12}, 0.5),
             snapshot({"running": 0, "steps_per_slot": {1: 5}, "num_drafts": 4,
                       "num_accepted_tokens": 8, "generation_tokens": 12}, 1.0)]
    s = timeline_series(snaps)
    assert s["steps"] == [3, 5, 5]
    assert s["accept_length"] == [None, 3.0, None]
    assert s["output_tokens_per_s"] == [None, 24.0, 0.0]


def test_poisson_arrivals_are_seeded():
    a = poisson_arrivals(2000, 4.0, seed=7)
    assert a == poisson_arrivals(2000, 4.0, seed=7)
    assert a != poisson_arrivals(2000, 4.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)  # 1 / rate seconds
    assert poisson_arrivals(3, None) == [0.0] * 3 == poisson_arrivals(3, math.inf)
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0)


# ---------------------------------------------------------------------------- datasets
def test_datasets_mixed_phases_cycle_and_errors(prompts, tmp_path):
    reqs = build_requests("mixed", 10, mix_every=3, directory=prompts)
    assert [r.workload for r in reqs] == ["code"] * 3 + ["hard"] * 3 + ["code"] * 3 + ["hard"]
    assert [r.index for r in reqs] == list(range(10))
    again = build_requests("mixed", 10, mix_every=3, directory=prompts)
    assert [r.input_ids for r in reqs] == [r.input_ids for r in again]  # seeded shuffle
    code = build_requests("code", 14, directory=prompts)  # 6 prompts, wrapped around
    assert code[:6] == [type(code[0])(i, "code", None, code[i].input_ids) for i in range(6)]
    assert [r.input_ids for r in code[6:12]] == [r.input_ids for r in code[:6]]
    path = build_requests(str(prompts / "text.jsonl"), 2, directory=prompts)
    assert path[0].workload == "text" and path[0].prompt.startswith("def f")
    only_short = build_requests("code", 3, directory=prompts,
                                keep=lambda r: r if r.input_ids[0] < 8 else None)
    assert {r.input_ids[0] for r in only_short} <= {5, 6, 7}
    with pytest.raises(DatasetError, match="not found"):
        build_requests("prose", 2, directory=prompts)
    with pytest.raises(DatasetError, match="no prompt is usable"):
        build_requests("code", 2, directory=prompts, keep=lambda r: None)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"other": 1}])
    with pytest.raises(DatasetError, match="no line"):
        load_jsonl(bad)


def test_prometheus_snapshot():
    text = "\n".join([
        "# HELP specdial:spec_decode_num_drafts_total x", "# TYPE x counter",
        "specdial:spec_decode_num_drafts_total 12.0",
        "specdial:spec_decode_num_draft_tokens_total 36.0",
        "specdial:spec_decode_num_accepted_tokens_total 20.0",
        'specdial:spec_decode_num_steps{slot="1"} 5.0',
        'specdial:spec_decode_num_steps{slot="8"} 0.0',
        "specdial:num_requests_running 3.0",
        'vllm:generation_tokens_total{model_name="m"} 7.0',
        'vllm:generation_tokens_total{model_name="n"} 2.0'])
    snap = prometheus_snapshot(text)
    assert snap["num_drafts"] == 12 and snap["num_accepted_tokens"] == 20
    assert snap["steps_per_slot"] == {1: 5, 8: 0} and snap["running"] == 3
    assert snap["generation_tokens"] == 9
    assert snapshot(snap, 1.0)["draft_tokens_proposed"] == 36


def test_draft_tokens_proposed_one_meaning():
    """Issue 27: the stats counter of proposed drafts is ``draft_tokens_proposed``;
    ``num_draft_tokens`` (tokens verified per request, steps + 1) is no stats field, only a
    read-only alias of the counter for old readers; the Prometheus name stays vLLM's."""
    import dataclasses

    from specdial.server.metrics import EngineCollector

    names = {f.name for f in dataclasses.fields(EngineStats)}
    assert "draft_tokens_proposed" in names and "num_draft_tokens" not in names
    stats = EngineStats(num_drafts=2, draft_tokens_proposed=6)
    assert stats.num_draft_tokens == 6
    with pytest.raises(TypeError):
        EngineStats(num_draft_tokens=6)
    assert snapshot(stats, 0.0)["draft_tokens_proposed"] == 6

    class _Engine:
        def stats(self):
            return stats

    exported = {m.name: m.samples[0].value for m in EngineCollector(_Engine()).collect()
                if m.samples}
    assert exported["specdial:spec_decode_num_draft_tokens"] == 6


# ---------------------------------------------------------------------------- run loop
def test_run_benchmark_streaming_fake_engine(prompts):
    engine = FakeStreamEngine(steps=3, accept=3)
    driver = EngineDriver(engine)
    assert driver.streaming
    reqs = [driver.prepare(r, 7) for r in build_requests("code", 6, directory=prompts)]
    # 7 tokens per request: 1 from prefill, then 2 verifies accepting 2 drafts each
    run = asyncio.run(run_benchmark(driver, reqs, sampling_params={"max_new_tokens": 7},
                                    concurrency=2, sample_interval=0.005, progress=False))
    s = summarize([run])
    assert s["completed"] == 6 and s["output_tokens"] == 42 and s["streaming"]
    assert s["ttft_s"]["count"] == 6 and s["itl_s"]["count"] == 6 * 2
    assert s["mean_accept_length"] == pytest.approx(3.0) and s["steps_histogram"] == {3: 12}
    assert len(run.timeline) >= 2 and run.timeline[-1]["requests_finished"] == 6
    # Poisson arrivals: the sends follow the seeded arrival times
    run = asyncio.run(run_benchmark(driver, reqs, sampling_params={"max_new_tokens": 4},
                                    request_rate=200.0, seed=3, progress=False))
    arrivals = poisson_arrivals(6, 200.0, seed=3)
    assert [r.arrival_time for r in run.records] == arrivals
    assert all(r.send_time >= a for r, a in zip(run.records, arrivals))


class GenerateOnly:
    """An engine exposing only ``generate`` (no ``async_stream``, no ``stats``)."""

    tokenizer = None

    def __init__(self, engine: Any) -> None:
        self.engine, self.context_length = engine, engine.context_length
        self.batches: list[int] = []

    def generate(self, prompt: Any = None, sampling_params: Any = None,
                 input_ids: Any = None) -> Any:
        self.batches.append(len(input_ids))
        return self.engine.generate(input_ids=input_ids, sampling_params=sampling_params)


def test_generate_only_engine_runs_in_batches(tiny, prompts):
    from specdial.engine import Engine

    engine = Engine.from_modules(tiny.target, tiny.draft_random, max_running_requests=4,
                                 kv_cache_tokens=1024, page_size=8)
    try:
        wrapped = GenerateOnly(engine)
        driver = EngineDriver(wrapped)
        assert not driver.streaming
        reqs = [driver.prepare(r, 8) for r in build_requests("code", 5, directory=prompts)]
        run = asyncio.run(run_benchmark(driver, reqs, sampling_params={"max_new_tokens": 8},
                                        concurrency=2, progress=False))
    finally:
        engine.shutdown()
    assert wrapped.batches == [2, 2, 1] and run.timeline == []
    assert len({r.send_time for r in run.records}) == 3
    s = summarize([run])
    assert s["completed"] == 5 and s["output_tokens"] == 40 and not s["streaming"]
    assert s["ttft_s"]["mean"] is None and s["e2e_latency_s"]["count"] == 5
    assert s["tokens_per_verify"] is not None and sum(s["steps_histogram"].values()) > 0


# ---------------------------------------------------------------------------- smoke runs
def _tiny_args(tiny):
    return ["--model-path", str(tiny.path), "--draft-model-path", str(tiny.draft_path),
            "--log-level", "error", "--no-progress"]


@pytest.mark.parametrize("mode", [["--concurrency", "1"], ["--concurrency", "2"],
                                  ["--request-rate", "100", "--concurrency", "2"]])
def test_bench_engine_smoke(tiny, prompts, tmp_path, capsys, mode):
    out = tmp_path / "bench.json"
    rc = main(["bench", *_tiny_args(tiny), "--dataset", str(prompts / "code.jsonl"),
               "--num-prompts", "5", "--max-new-tokens", "8", "--output-json", str(out),
               *mode])
    assert rc == 0
    assert "Output token throughput" in capsys.readouterr().out
    result = json.loads(out.read_text())
    s = result["summary"]
    assert s["completed"] == 5 and s["failed"] == 0 and s["output_tokens"] == 40
    assert s["output_throughput"] > 0 and s["e2e_latency_s"]["count"] == 5
    assert sum(s["steps_histogram"].values()) > 0
    assert result["run"]["speculative_algorithm"] == "DRAFT"
    if s["streaming"]:  # the engine has async_stream
        assert s["ttft_s"]["count"] == 5


def test_bench_engine_errors(tiny, prompts, capsys):
    assert main(["bench", *_tiny_args(tiny), "--dataset", str(prompts / "nope.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
    # text prompts, but the tiny engine has no tokenizer
    assert main(["bench", *_tiny_args(tiny), "--dataset", str(prompts / "text.jsonl")]) == 2
    assert "no prompt is usable" in capsys.readouterr().err
    assert main(["bench", "--concurrency", "0"]) == 2


def test_bench_http_smoke(prompts, tmp_path, capsys):
    from test_server_fake_engine import FakeEngine, LiveServer

    engine = FakeEngine(delay=0.001, tokens_per_chunk=3)
    out = tmp_path / "http.json"
    with LiveServer(engine, name="fake") as server:
        rc = main(["bench", "--backend", "http", "--base-url", server.url, "--dataset",
                   str(prompts / "text.jsonl"), "--num-prompts", "6", "--max-new-tokens", "8",
                   "--concurrency", "2", "--no-progress", "--output-json", str(out),
                   "--sample-interval", "0.01"])
    assert rc == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    s = result["summary"]
    assert s["completed"] == 6 and s["output_tokens"] == 48 and s["streaming"]
    assert s["ttft_s"]["count"] == 6 and s["itl_s"]["count"] > 0
    # from /metrics: chunks of 3, 3 and 2 tokens = verifies accepting 2, 2 and 1 drafts
    assert s["mean_accept_length"] == pytest.approx(1 + 5 / 3)
    # specdial serve accepts the vLLM/SGLang extension field: fixed output lengths over HTTP
    assert not any("ignore_eos" in w for w in result["run"]["warnings"])
    assert all(sub["input_ids"] and sub["sampling_params"]["ignore_eos"]
               for sub in engine.submitted.values())


def test_parse_configurations():
    names = [c.name for c in parse_configurations(None)]
    assert names == ["no-spec", "fixed-1", "fixed-3", "fixed-5", "fixed-7", "adaptive"]
    assert parse_configurations(None, "cfg.json")[-1] == Configuration(
        "adaptive-user", "adaptive", adaptive_config="cfg.json")
    assert parse_configurations("fixed-2,adaptive")[0].engine_overrides() == {
        "speculative_adaptive": False, "speculative_num_steps": 2}
    skip = parse_configurations("fixed-0,fixed-0+skip,adaptive+skip")
    assert [c.engine_overrides().get("skip_zero_step_draft_extend") for c in skip] == [
        None, True, True]
    assert skip[1].kind == "fixed" and skip[1].steps == 0
    for bad in ("fixed-x", "adaptive-user", "adaptive,adaptive", "no-spec+skip"):
        with pytest.raises(ValueError):
            parse_configurations(bad)


def test_compare_fake_engines_outputs(prompts, tmp_path):
    """Comparison mode over fake streaming engines (with stats, so the timelines and their
    plots exist): files, fields and ratios."""
    configs = parse_configurations("no-spec,fixed-1,fixed-3,adaptive")
    built: list[FakeStreamEngine] = []

    def build(c: Configuration) -> FakeStreamEngine:
        steps = {"none": 0, "fixed": c.steps, "adaptive": 3}[c.kind]
        built.append(FakeStreamEngine(steps=steps or 0, accept=(steps or 0) + 1, delay=0.002))
        return built[-1]

    result = run_comparison(build, configs, ["code", "mixed"], [1, 2], num_prompts=4,
                            max_new_tokens=6, mix_every=2, repetitions=2, warmup_prompts=1,
                            prompts_dir=str(prompts), sample_interval=0.005, progress=False)
    assert len(built) == 4 and all(e.shut for e in built)  # one engine per configuration
    assert len(result["results"]) == 2 * 2 * 4
    for e in result["results"]:
        assert e["summary"]["completed"] == 8 and len(e["repetitions"]) == 2
    adaptive = [e for e in result["results"] if e["config"] == "adaptive"]
    assert all(e["timeline"]["steps"] for e in adaptive)
    mixed = [e for e in adaptive if e["workload"] == "mixed"]
    assert any(x for e in mixed for x in e["timeline"]["other_workload_share"] if x)
    ratios = result["ratios"]
    assert len(ratios) == 4
    for r in ratios:
        assert r["best_fixed"] in ("no-spec", "fixed-1", "fixed-3")
        assert set(r["vs_fixed"]) == {"no-spec", "fixed-1", "fixed-3"}
        assert r["vs_best_fixed"] == pytest.approx(
            r["output_throughput"] / r["best_fixed_throughput"])
        assert len(r["vs_best_fixed_per_rep"]) == 2
    files = write_outputs(result, tmp_path / "out")
    assert set(files) >= {"json", "markdown", "throughput", "timeline_adaptive_code",
                          "timeline_adaptive_mixed"}
    for key in ("throughput", "timeline_adaptive_code", "timeline_adaptive_mixed"):
        assert (tmp_path / "out" / f"{key}.png").read_bytes()[:8] == PNG
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "adaptive / best fixed" in md and "| mixed | 2 | adaptive |" in md
    saved = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert saved["ratios"] == json.loads(json.dumps(compute_ratios(saved)))


def test_compare_cli_tiny_models(tiny, prompts, tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = main(["bench", "compare", *_tiny_args(tiny), "--configs",
               "no-spec,fixed-0+skip,adaptive",
               "--workloads", "code,mixed", "--concurrency", "1,2", "--num-prompts", "4",
               "--max-new-tokens", "8", "--repetitions", "1", "--warmup-prompts", "1",
               "--mix-every", "2", "--prompts-dir", str(prompts), "--output-dir", str(out),
               "--sample-interval", "0.01"])
    assert rc == 0, capsys.readouterr().err
    assert "adaptive / best fixed" in capsys.readouterr().out
    result = json.loads((out / "compare.json").read_text())
    assert [c["name"] for c in result["configs"]] == ["no-spec", "fixed-0+skip", "adaptive"]
    assert result["meta"]["command"].startswith("specdial bench compare")
    assert len(result["results"]) == 2 * 2 * 3
    for e in result["results"]:
        s = e["summary"]
        assert s["completed"] == 4 and s["output_tokens"] == 32 and s["failed"] == 0
        if e["config"] in ("no-spec", "fixed-0+skip"):
            assert set(s["steps_histogram"]) <= {"0"}  # JSON keys
    assert {(r["workload"], r["concurrency"]) for r in result["ratios"]} == {
        ("code", 1), ("code", 2), ("mixed", 1), ("mixed", 2)}
    assert (out / "compare.md").is_file()
    assert (out / "throughput.png").read_bytes()[:8] == PNG


def test_compare_cli_errors(capsys):
    assert main(["bench", "compare", "--configs", "fixed-x"]) == 2
    assert main(["bench", "compare", "--concurrency", "1,zero"]) == 2
    assert main(["bench", "compare", "--configs", "adaptive-user"]) == 2
    assert "adaptive-config" in capsys.readouterr().err


def test_ramp_schedule_and_gate(prompts):
    """A ramp's caps rise from 1 to the peak and fall back; the driver never has more requests
    in flight than the cap of the latest one started, and starts them in order."""
    from specdial.bench.compare import parse_concurrency, peak_of
    from specdial.bench.driver import ramp_concurrency

    caps = ramp_concurrency(41, 8)
    assert caps[0] == caps[-1] == 1 and max(caps) == 8 and caps[20] == 8
    assert caps == sorted(caps[:21]) + sorted(caps[21:], reverse=True)
    assert parse_concurrency("ramp-64") == "ramp-64" and peak_of("ramp-64") == 64
    assert parse_concurrency(" 16") == 16
    for bad in ("ramp-0", "ramp-x", "0", "x"):
        with pytest.raises(ValueError, match="ramp-N"):
            parse_concurrency(bad)
    engine = FakeStreamEngine(steps=1, accept=2, delay=0.002)
    seen: list[tuple[int, int]] = []
    live = [0]
    real = engine.async_stream

    async def watched(*a: Any, **k: Any) -> AsyncIterator[StreamChunk]:
        live[0] += 1
        seen.append((live[0], len(seen)))
        try:
            async for c in real(*a, **k):
                yield c
                if c.finished:
                    break
        finally:
            live[0] -= 1

    engine.async_stream = watched  # type: ignore[method-assign]
    driver = EngineDriver(engine)
    reqs = [driver.prepare(r, 5) for r in build_requests("code", 41, directory=prompts)]
    run = asyncio.run(run_benchmark(driver, reqs, sampling_params={"max_new_tokens": 5},
                                    concurrency_schedule=caps, progress=False))
    assert summarize([run])["completed"] == 41
    assert all(in_flight <= caps[i] for in_flight, i in seen), [(f, caps[i]) for f, i in seen]
    assert max(f for f, _ in seen) >= 4  # it did ramp up
    sends = [r.send_time for r in run.records]
    assert sends == sorted(sends)
    with pytest.raises(ValueError, match="one cap"):
        asyncio.run(run_benchmark(driver, reqs, sampling_params={"max_new_tokens": 5},
                                  concurrency_schedule=caps[:3], progress=False))


def test_json_reports_the_output_lengths_that_ruled():
    """--random-output-len 16 rules over --max-new-tokens 128 (issue 26: the JSON said 128)."""
    from specdial.bench.cli import _output_lengths
    from specdial.bench.datasets import BenchRequest

    own = [BenchRequest(i, "random", "x", max_new_tokens=16) for i in range(3)]
    assert _output_lengths(own, 128) == {"max_new_tokens": 16, "max_new_tokens_range": [16, 16]}
    mixed = [BenchRequest(0, "r", "x", max_new_tokens=8), BenchRequest(1, "r", "x")]
    assert _output_lengths(mixed, 128) == {"max_new_tokens": None,
                                           "max_new_tokens_range": [8, 128]}
    assert _output_lengths([BenchRequest(0, "code", "x")], 128)["max_new_tokens"] == 128
