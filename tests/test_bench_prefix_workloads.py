"""Issue 30's bench workloads: multi-turn chat (each turn resends the history with the answer
the engine gave, and is sent only after that answer arrived; TTFT per turn in the report) and
SGLang's generated-shared-prefix dataset; the cached tokens in the report. Run against the
server tests' fake engine, whose prefix cache is emulated."""

from __future__ import annotations

import asyncio
import json

import pytest

from specdial.bench.datasets import BenchRequest, DatasetError
from specdial.bench.driver import EngineDriver, run_benchmark
from specdial.bench.metrics import summarize
from specdial.bench.multiturn import (SEPARATOR, conversation_runner,
                                      multiturn_conversations)
from specdial.bench.prefix_workloads import shared_prefix_requests
from specdial.cli import main
from test_bench import prompts, write_jsonl  # noqa: F401 - the fixture
from test_server_fake_engine import FAKE_PAGE, FakeEngine, LiveServer

MESSAGES = [BenchRequest(i, "text", f"message {i}: do x", None) for i in range(20)]


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_conversations_have_4_to_8_turns_seeded_and_fit_the_context():
    convs = multiturn_conversations(MESSAGES, 12, max_new_tokens=8, seed=1, encode=_encode)
    assert len(convs) == 12 and {len(c.turns) for c in convs} <= set(range(4, 9))
    assert len({len(c.turns) for c in convs}) > 1  # the lengths vary
    assert convs == multiturn_conversations(MESSAGES, 12, max_new_tokens=8, seed=1,
                                            encode=_encode)
    flat = [t for c in convs for t in c.turns]
    assert [t.index for t in flat] == list(range(len(flat)))  # one record per turn
    first, second = convs[0].turns[:2]
    assert first.input_ids == tuple(_encode(MESSAGES[0].prompt))
    assert second.input_ids == tuple(_encode(SEPARATOR + MESSAGES[1].prompt))
    # a context of 60 tokens: turns are cut where the history stops fitting
    cut = multiturn_conversations(MESSAGES, 3, max_new_tokens=4, seed=1, encode=_encode,
                                  min_turns=1, fits=lambda p, o: p + o <= 60)
    assert all(1 <= len(c.turns) < 4 for c in cut)
    with pytest.raises(DatasetError, match="lower --max-new-tokens"):
        multiturn_conversations(MESSAGES, 3, max_new_tokens=40, encode=_encode,
                                fits=lambda p, o: p + o <= 60)
    with pytest.raises(DatasetError, match="min <= max"):
        multiturn_conversations(MESSAGES, 3, max_new_tokens=4, min_turns=5, max_turns=4)


def test_each_turn_resends_the_history_after_the_previous_answer():
    engine = FakeEngine(delay=0.001, tokens_per_chunk=2)
    driver = EngineDriver(engine)
    convs = multiturn_conversations(MESSAGES, 3, max_new_tokens=5, seed=2,
                                    encode=driver.encode)
    turns = [t for c in convs for t in c.turns]
    run = asyncio.run(run_benchmark(driver, turns, sampling_params={"max_new_tokens": 5},
                                    concurrency=2, progress=False, sample_interval=0.01,
                                    runner=conversation_runner(convs)))
    assert len(engine.submitted) == len(turns)
    by_prompt = {tuple(sub["input_ids"]): sub for sub in engine.submitted.values()}
    for conv in convs:
        recs = [run.records[t.index] for t in conv.turns]
        history: tuple[int, ...] = ()
        for t, rec in zip(conv.turns, recs):
            history += t.input_ids
            assert history in by_prompt  # the whole conversation so far, then the message
            history += tuple(rec.output_ids)  # the answer the engine gave
            assert len(rec.output_ids) == 5
        for a, b in zip(recs, recs[1:]):
            assert b.send_time >= a.end_time  # sent once the previous answer arrived
            # the fake caches prompts: the previous turn's prompt is a hit, in whole pages
            assert b.cached_tokens == a.prompt_tokens // FAKE_PAGE * FAKE_PAGE
    s = summarize([run])
    assert s["completed"] == len(turns)
    assert set(s["ttft_per_turn_s"]) == set(range(1, max(len(c.turns) for c in convs) + 1))
    assert s["ttft_per_turn_s"][1]["count"] == 3
    assert s["cached_tokens"] > 0 and 0 < s["prefix_cache_hit_rate"] < 1


def test_shared_prefix_requests_share_their_groups_system_prompt():
    reqs = shared_prefix_requests(num_groups=3, prompts_per_group=4, system_prompt_len=10,
                                  question_len=3, output_len=6, vocab_size=50, seed=0)
    assert len(reqs) == 12 and [r.index for r in reqs] == list(range(12))
    assert {r.max_new_tokens for r in reqs} == {6} and {len(r.input_ids) for r in reqs} == {13}
    groups: dict[str, set] = {}
    for r in reqs:
        groups.setdefault(r.workload, set()).add(r.input_ids[:10])
    assert len(groups) == 3 and all(len(v) == 1 for v in groups.values())
    assert reqs == shared_prefix_requests(num_groups=3, prompts_per_group=4,
                                          system_prompt_len=10, question_len=3, output_len=6,
                                          vocab_size=50, seed=0)
    with pytest.raises(DatasetError, match="--gsp-question-len"):
        shared_prefix_requests(num_groups=1, prompts_per_group=1, system_prompt_len=1,
                               question_len=0, output_len=1, vocab_size=5)


def test_bench_multiturn_and_shared_prefix_over_http(prompts, tmp_path, capsys):  # noqa: F811
    write_jsonl(prompts / "msgs.jsonl", [{"prompt": f"say {i} things"} for i in range(8)])
    engine = FakeEngine(delay=0.001, tokens_per_chunk=3, context_length=2048)
    out = tmp_path / "mt.json"
    common = ["bench", "--backend", "http", "--no-progress", "--sample-interval", "0.01"]
    with LiveServer(engine, name="fake") as server:
        rc = main([*common, "--base-url", server.url, "--dataset", "multiturn",
                   "--multiturn-source", str(prompts / "msgs.jsonl"), "--num-prompts", "2",
                   "--max-new-tokens", "4", "--output-json", str(out)])
        assert rc == 0, capsys.readouterr().err
        text = capsys.readouterr().out
        s = json.loads(out.read_text())["summary"]
        assert "TTFT per turn" in text and "Turn 4" in text and "Prefix cache" in text
        assert s["failed"] == 0 and set(s["ttft_per_turn_s"]) >= {"1", "2", "3", "4"}
        assert s["cached_tokens"] > 0  # from the usage's prompt_tokens_details
        rc = main([*common, "--base-url", server.url, "--dataset", "generated-shared-prefix",
                   "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3",
                   "--gsp-system-prompt-len", "40", "--gsp-question-len", "4",
                   "--gsp-output-len", "3", "--random-vocab-size", "100", "--concurrency", "1",
                   "--output-json", str(out)])
        assert rc == 0, capsys.readouterr().err
    s = json.loads(out.read_text())["summary"]
    assert s["completed"] == 6 and s["output_tokens"] == 18
    assert s["cached_tokens"] >= 4 * 40 // 4 * 4  # every request but each group's first
    assert main(["bench", "--dataset", "multiturn", "--request-rate", "2"]) == 2
    assert "--request-rate does not apply" in capsys.readouterr().err
