"""The serving Engine (issue 5): continuous batching over the Rust scheduler, streaming, asyncio,
abort, queue limit, preemption, shutdown, the per-verify trace, errors inside the loop, and the
adaptive policy acting inside serving. Tiny float32 CPU models (tests/conftest.py); greedy
outputs are always compared with a target-only engine, itself checked against transformers in
tests/test_engine_greedy.py."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import pytest
import torch

from conftest import PROMPTS, VOCAB
from greedy import greedy
from specdial.builtin import BUILTIN_DIR
from specdial.cli import main as cli_main
from specdial.detokenize import IncrementalText, decode
from specdial.engine import Engine
from specdial.engine.api import QueueFullError, RequestError
from specdial.engine.ends import end_kind
from specdial.models import LlamaForCausalLM, load_tokenizer
from specdial.models.config import ModelConfig
from timeouts import scaled

KW = dict(max_running_requests=4, kv_cache_tokens=1024, page_size=8)
# every prompt of the three, extended so that the tests have more than three distinct requests
MORE = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6], [150, 151, 152], list(range(20, 40))]


def wait_idle(engine: Engine, timeout: float = 30.0) -> None:
    """Until nothing runs, nothing waits and every KV page is free (aborts are asynchronous);
    ``timeout``: idle-machine seconds, :func:`scaled`."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        s = engine.stats()
        if s.running == 0 and s.queued == 0 and s.kv_pages_used == 0:
            return
        assert time.monotonic() < deadline, s
        time.sleep(0.01)


@pytest.fixture(scope="module")
def ref(tiny):
    """Greedy target-only outputs of MORE (40 tokens each)."""
    with Engine.from_modules(tiny.target, **KW) as engine:
        out = engine.generate(input_ids=MORE, sampling_params=greedy(40))
    return [o["output_ids"] for o in out]


@pytest.fixture(scope="module")
def text_models():
    return build_text_models(noise=0.02)


def build_text_models(noise: float):
    """A random 2-layer target over the built-in tokenizer (4096 tokens), its copy plus
    ``noise * N(0, 1)`` as a draft model, and the tokenizer."""
    cfg = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 4096, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False})
    torch.manual_seed(7)
    target, draft = LlamaForCausalLM(cfg).eval(), LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in target.parameters():
            p.normal_(0, 0.3)
        for p, q in zip(draft.parameters(), target.parameters()):
            p.copy_(q + noise * torch.randn_like(q))
    return target, draft, load_tokenizer(BUILTIN_DIR / "target")


def test_requests_join_the_running_batch_from_many_threads(tiny, ref):
    sizes: list[int] = []
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, drafter_max_steps=3,
                                 steps_schedule=lambda i, bs: sizes.append(bs) or 2, **KW)
    results: dict[int, list[int]] = {}

    def one(i: int) -> None:
        n = 40 if i == 0 else 12
        results[i] = engine.generate(input_ids=MORE[i],
                                     sampling_params=greedy(n))["output_ids"]

    long = engine.stream(input_ids=MORE[0], sampling_params=greedy(40))
    first = next(long)  # MORE[0] is decoding now
    threads = [threading.Thread(target=one, args=(i,)) for i in range(1, len(MORE))]
    for t in threads:
        t.start()
    streamed = first.token_ids + [t for c in long for t in c.token_ids]
    for t in threads:
        t.join()
    assert streamed == ref[0]
    assert all(results[i] == ref[i][:12] for i in range(1, len(MORE)))
    assert max(sizes) >= 2  # later requests joined while MORE[0] decoded
    wait_idle(engine)
    engine.shutdown()


def test_stream_text_deltas_concatenate_to_generate_text(text_models):
    target, draft, tok = text_models
    engine = Engine.from_modules(target, draft, tok, speculative_adaptive=False,
                                 speculative_num_steps=3, **KW)
    sp = {"temperature": 0.0, "max_new_tokens": 60, "ignore_eos": True}
    for prompt in ("def add(a, b):\n    return", "naïve café € 😀"):
        whole = engine.generate(prompt, sp)
        assert whole["text"] == decode(tok, whole["output_ids"])
        chunks = list(engine.stream(prompt, sampling_params=sp))
        assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert "".join(c.text for c in chunks) == whole["text"]
        assert [t for c in chunks for t in c.token_ids] == whole["output_ids"]
        # an incomplete character is held back, never sent as U+FFFD to be "fixed" later (the
        # joined text equal to the whole one says nothing was sent twice); a U+FFFD inside a
        # delta is an invalid byte sequence the model chose (the whole text has it too)
        sent = ""
        for c in chunks[:-1]:
            sent += c.text
            assert not sent.endswith("\ufffd") and whole["text"].startswith(sent)
        assert chunks[-1].finish_reason == {"type": "length", "length": 60}
        assert chunks[-1].meta_info["completion_tokens"] == 60
        # a stop string from the middle of the text: cut there, never sent, pages freed
        text = whole["text"]
        stop = text[len(text) // 2:len(text) // 2 + 3]
        got = list(engine.stream(prompt, sampling_params=sp, stop=["\x00never", stop]))
        assert "".join(c.text for c in got) == text[:text.index(stop)]
        assert got[-1].finish_reason == {"type": "stop", "matched": stop}
        assert got[-1].meta_info["completion_tokens"] < 60
    wait_idle(engine)
    engine.shutdown()


def test_incremental_text_holds_back_partial_characters():
    tok = load_tokenizer(BUILTIN_DIR / "target")
    ids = tok.encode("naïve café € 😀 done", add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # characters split across tokens
    inc = IncrementalText(tok)
    deltas = [inc.update(ids[:k], final=k == len(ids)) for k in range(1, len(ids) + 1)]
    assert "".join(deltas) == "naïve café € 😀 done"
    assert all("\ufffd" not in d for d in deltas)
    inc = IncrementalText(tok, stop=["😀 d"])
    deltas = [inc.update(ids[:k], final=False) for k in range(1, len(ids) + 1)]
    assert "".join(deltas) == "naïve café € " and inc.matched == "😀 d"
    inc = IncrementalText(tok, stop=["a long stop string"])  # held back: never sent early
    assert [inc.update(ids[:k], final=False) for k in (1, 2)] == ["", ""]
    assert inc.update(ids, final=True) == "naïve café € 😀 done" and inc.matched is None


def test_async_stream_cancel_and_aclose_abort(tiny, ref):
    engine = Engine.from_modules(tiny.target, tiny.eagle_random, **KW)

    async def main():
        got = []

        async def consume():
            async for chunk in engine.async_stream(input_ids=MORE[1],
                                                   sampling_params=greedy(200)):
                got.append(chunk)

        task = asyncio.create_task(consume())
        while len(got) < 2:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stream = engine.async_stream(input_ids=MORE[2], sampling_params=greedy(200))
        first = await stream.__anext__()
        await stream.aclose()
        # a complete one meanwhile, and the submission errors before any chunk
        done = [c async for c in engine.async_stream(input_ids=MORE[0],
                                                     sampling_params=greedy(40))]
        with pytest.raises(RequestError) as e:
            await engine.async_stream(input_ids=[1, 2], sampling_params={
                "temperature": -1}).__anext__()
        return got, first, done, e.value

    got, first, done, err = asyncio.run(main())
    assert got[0].token_ids == ref[1][:1] and not got[-1].finished
    assert first.token_ids == ref[2][:1]
    assert [t for c in done for t in c.token_ids] == ref[0] and done[-1].finished
    assert err.param == "temperature"
    wait_idle(engine)
    s = engine.stats()
    assert s.requests_finished == 1 and s.prompt_tokens == len(MORE[0] + MORE[1] + MORE[2])
    engine.shutdown()


def test_async_stream_whole_holds_the_chunks_until_the_end(tiny, ref):
    """``async_stream(whole=True)`` (the server's non-streaming responses): the same chunks as
    a stream, none handed over before the request's last one was emitted, each stamped with a
    non-decreasing ``emitted_s``; a stream's chunks carry none (their arrival is their time).
    Submission errors still come before any chunk; leaving early still aborts. Fixed steps:
    the two runs' chunk boundaries must not depend on an adaptive policy's timings."""
    engine = Engine.from_modules(tiny.target, tiny.eagle_random, speculative_adaptive=False,
                                 speculative_num_steps=3, **KW)

    async def main():
        streamed = [c async for c in engine.async_stream(input_ids=MORE[3],
                                                         sampling_params=greedy(40))]
        received = []
        async for chunk in engine.async_stream(input_ids=MORE[3], sampling_params=greedy(40),
                                               whole=True):
            received.append((time.perf_counter(), chunk))
        with pytest.raises(RequestError) as e:
            await engine.async_stream(input_ids=[1, 2], sampling_params={"temperature": -1},
                                      whole=True).__anext__()
        long = engine.async_stream(input_ids=MORE[4], sampling_params=greedy(200), whole=True)
        task = asyncio.ensure_future(long.__anext__())
        deadline = time.monotonic() + scaled(30)
        while engine.stats().running == 0:
            assert time.monotonic() < deadline and not task.done(), engine.stats()
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return streamed, received, e.value

    streamed, received, err = asyncio.run(main())
    whole = [c for _, c in received]
    assert len(whole) == len(streamed) > 2  # several iterations' chunks
    for a, b in zip(whole, streamed):
        assert (a.text, a.token_ids, a.finished, a.finish_reason, a.meta_info["completion_tokens"]) \
            == (b.text, b.token_ids, b.finished, b.finish_reason, b.meta_info["completion_tokens"])
    assert [t for c in whole for t in c.token_ids] == ref[3]
    stamps = [c.emitted_s for c in whole]
    assert all(s is not None for s in stamps) and stamps == sorted(stamps)
    assert stamps[-1] > stamps[0]  # emitted over several iterations ...
    assert received[0][0] >= stamps[-1]  # ... and the first handed over after the last
    assert all(c.emitted_s is None for c in streamed)
    assert err.param == "temperature"
    wait_idle(engine)  # the cancelled one was aborted
    assert engine.stats().requests_finished == 2
    engine.shutdown()


def test_abort_queued_and_running_and_queue_limit(tiny, ref):
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, max_running_requests=1,
                                 max_queued_requests=1, kv_cache_tokens=1024, page_size=8)
    running = engine.stream(input_ids=MORE[0], sampling_params=greedy(200))
    first = next(running)
    assert first.request_id == 0
    queued: list = []
    waiter = threading.Thread(target=lambda: queued.extend(engine.stream(input_ids=MORE[1])))
    waiter.start()
    deadline = time.monotonic() + scaled(30)
    while engine.stats().queued != 1:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    with pytest.raises(QueueFullError):
        next(engine.stream(input_ids=MORE[2]))
    engine.abort(1)  # the queued one (ids count up from 0)
    waiter.join(scaled(30))
    assert [c.finished for c in queued] == [True]
    assert queued[0].finish_reason["type"] == "abort" and queued[0].token_ids == []
    engine.abort(0)  # the running one
    rest = list(running)
    assert rest[-1].finished and rest[-1].finish_reason["type"] == "abort"
    assert len(first.token_ids + [t for c in rest for t in c.token_ids]) < 200
    wait_idle(engine)
    engine.abort(0)  # finished: ignored
    # generate waits for room instead of failing when its prompts exceed the queue bound
    out = engine.generate(input_ids=MORE[:4], sampling_params=greedy(12))
    assert [o["output_ids"] for o in out] == [r[:12] for r in ref[:4]]
    wait_idle(engine)
    engine.shutdown()


@pytest.mark.parametrize("drafter", ["draft_noisy", "eagle_random"])
def test_preemption_keeps_greedy_outputs(tiny, ref, drafter):
    """12 pages of 8 tokens for 6 requests of up to 60 tokens, submitted from threads,
    prompts prefilled in chunks of at most 7 tokens: preemption and re-prefill (target and
    drafter, EAGLE with the target's hidden states) leave the greedy outputs unchanged."""
    engine = Engine.from_modules(tiny.target, getattr(tiny, drafter), max_running_requests=6,
                                 kv_cache_tokens=96, page_size=8, max_prefill_tokens=7,
                                 speculative_adaptive=False, speculative_num_steps=3)
    out: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, engine.generate(
        input_ids=MORE[i], sampling_params=greedy(40))["output_ids"]))
        for i in range(len(MORE))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i] for i in range(len(MORE))] == ref
    assert engine.stats().preemptions > 0
    wait_idle(engine)
    engine.shutdown()


def test_dropped_engine_stops_its_loop_thread(tiny):
    engine = Engine.from_modules(tiny.target, **KW)
    engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(2))
    thread = engine._loop.thread
    del engine
    import gc
    gc.collect()
    thread.join(scaled(10))
    assert not thread.is_alive()


EXIT_SCRIPT = """
import threading, time
from specdial.engine import Engine
engines = [Engine(model_path=None, log_interval_s=None, speculative_adaptive=False)
           for _ in range(3)]
for e in engines:
    e.generate("def f(x):", sampling_params={"max_new_tokens": 4, "temperature": 0})
threading.Thread(target=engines[0].generate, args=(["class A:"] * 4,),
                 kwargs={"sampling_params": {"max_new_tokens": 500}}, daemon=True).start()
time.sleep(0.5)
print("exiting with a request running", flush=True)
"""


@pytest.mark.skipif(not (BUILTIN_DIR / "eagle" / "model.safetensors").exists(),
                    reason="built-in weights not present")
def test_interpreter_exit_without_shutdown_is_clean():
    # engines never shut down, one mid-request, at interpreter exit: the finalizer must join
    # the loop threads (before the fix the process aborted with "terminate called ...")
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True,
                       timeout=scaled(300))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "exiting" in r.stdout and "terminate" not in r.stderr


@pytest.mark.parametrize("drain", [True, False])
def test_shutdown_drains_or_aborts(tiny, ref, drain):
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, **KW)
    streams = [engine.stream(input_ids=MORE[i], sampling_params=greedy(40))
               for i in range(3)]
    firsts = [next(s) for s in streams]
    engine.shutdown(drain=drain)
    assert not engine._loop.thread.is_alive()
    for i, (first, s) in enumerate(zip(firsts, streams)):
        chunks = [first] + list(s)
        ids = [t for c in chunks for t in c.token_ids]
        if drain:
            assert ids == ref[i] and chunks[-1].finish_reason["type"] == "length"
        else:
            assert ids == ref[i][:len(ids)] and len(ids) < 40
            assert chunks[-1].finish_reason["type"] == "abort"
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(input_ids=[1, 2])
    with pytest.raises(RuntimeError, match="shut down"):
        next(engine.stream(input_ids=[1, 2]))
    engine.shutdown()  # idempotent


def test_record_trace_replays_and_log_line(tiny, tmp_path, caplog, capsys):
    trace = tmp_path / "trace.jsonl"
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, record_trace=str(trace),
                                 log_interval_s=1e-9, **KW)
    with caplog.at_level(logging.INFO, logger="specdial.engine"):
        engine.generate(input_ids=PROMPTS, sampling_params=greedy(20))
        engine.shutdown()
    lines = trace.read_text().splitlines()
    assert lines and all({"accepted", "batch_size"} <= set(json.loads(x)) for x in lines)
    assert sum(json.loads(x)["batch_size"] for x in lines) == sum(
        len(json.loads(x)["accepted"]) for x in lines)
    assert cli_main(["policy", "replay", "--trace", str(trace), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verifies"] == len(lines)
    assert any("running" in r.message and "tokens/s" in r.message and "accept length" in
               r.message and "steps per slot" in r.message for r in caplog.records)


def test_a_failing_iteration_aborts_its_requests_and_serving_goes_on(tiny, ref, caplog):
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, **KW)
    real = engine.worker.decode
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    engine.worker.decode = flaky  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="specdial.engine"):
        out = engine.generate(input_ids=PROMPTS, sampling_params=greedy(20))
    # a typed failure (not a client abort), naming the cause
    assert all(o["meta_info"]["finish_reason"]["type"] == "error" for o in out)
    assert all(end_kind(o["meta_info"]["finish_reason"]) == "failed" for o in out)
    assert "injected failure" in out[0]["meta_info"]["finish_reason"]["message"]
    assert any("injected failure" in r.getMessage() or r.exc_info for r in caplog.records)
    wait_idle(engine)
    again = engine.generate(input_ids=PROMPTS, sampling_params=greedy(20))
    assert [o["output_ids"] for o in again] == [r[:20] for r in ref[:3]]
    wait_idle(engine)
    engine.shutdown()


ADAPTIVE = {"ema_alpha": 0.5, "update_interval": 16, "warmup_batches": 0,
            "down_hysteresis": 0.0, "up_hysteresis": 0.0, "ceiling_coeff": 0.0,
            "1": {"candidate_steps": [1, 3, 5]}, "8": {"candidate_steps": [0, 3]}}


@pytest.mark.parametrize("drafter, steps", [("draft_same", 3), ("draft_random", 0)])
def test_adaptive_policy_acts_inside_serving(tiny, drafter, steps):
    """12 concurrent requests (batch >= 8): a drafter identical to the target keeps slot 8 at
    3; a random one (nothing accepted) drives it to 0. One submission of the 12 (before: 12
    threads, whose start order under load decided how many verifies ran at batch >= 8)."""
    engine = Engine.from_modules(tiny.target, getattr(tiny, drafter),
                                 speculative_adaptive_config=ADAPTIVE, speculative_initial_steps=1,
                                 max_running_requests=16, kv_cache_tokens=4096, page_size=8)
    assert engine.stats().steps_per_slot == {1: 1, 8: 3}
    n = 120 if steps else 30
    prompts = [MORE[i % len(MORE)] + [i] for i in range(12)]
    engine.generate(input_ids=prompts, sampling_params=greedy(n))
    s = engine.stats()
    assert s.steps_per_slot[8] == steps, s
    assert s.num_drafts > 0 and s.requests_finished == 12
    wait_idle(engine)
    engine.shutdown()


def test_request_errors_name_the_field(tiny):
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, **KW)
    cases = [(dict(input_ids=[]), "input_ids"), (dict(input_ids=[1, VOCAB]), "input_ids"),
             (dict(input_ids=[1], sampling_params=greedy(0)), "max_new_tokens"),
             (dict(input_ids=[1], sampling_params=greedy(500)), "max_new_tokens"),
             (dict(input_ids=[1] * 256), "input_ids"),
             (dict(input_ids=[1], sampling_params={"top_p": 2.0}), "top_p"),
             (dict(input_ids=[1], sampling_params={"bogus": 1}), "bogus"),
             (dict(prompt="text"), "prompt"), (dict(input_ids=[1], stop=[""]), "stop")]
    for kwargs, param in cases:
        with pytest.raises(RequestError) as e:
            next(engine.stream(**kwargs))
        assert e.value.param == param, (kwargs, e.value)
        assert param in str(e.value)
    with pytest.raises(RequestError, match="prompt 1: .*max_new_tokens"):
        engine.generate(input_ids=[[1], [2]], sampling_params=[{}, greedy(-1)])
    assert engine.stats().running == 0
    engine.shutdown()


def test_model_path_none_uses_builtin_target_and_eagle(tiny, tmp_path, monkeypatch, ref):
    """``Engine()`` loads the built-in target + EAGLE head with adaptive steps (the locations
    are patched here: the real built-in models may not be trained in this checkout)."""
    import specdial.builtin as builtin
    from specdial.models import save_eagle_head

    save_eagle_head(tiny.eagle_random, tmp_path / "eagle")
    dirs = {"target": tiny.path, "eagle": tmp_path / "eagle"}
    monkeypatch.setattr(builtin, "builtin_model_path", lambda name: dirs[name])
    with Engine(**KW) as engine:
        assert engine.speculative_algorithm == "EAGLE" and engine.adaptive_config is not None
        out = engine.generate(input_ids=PROMPTS, sampling_params=greedy(40))
        assert [o["output_ids"] for o in out] == ref[:3]
    monkeypatch.setattr(builtin, "builtin_model_path", lambda name: (_ for _ in ()).throw(
        FileNotFoundError(f"built-in model {name!r} is missing")))
    with pytest.raises(NotImplementedError, match="built-in models.*missing"):
        Engine()


def test_offline_api_rejects_bad_prompts_and_request_ids(text_models):
    target, _, tokenizer = text_models
    with Engine.from_modules(target, tokenizer=tokenizer, **KW) as engine:
        with pytest.raises(RequestError, match="prompt must be a string or a list of strings"):
            engine.generate(5)
        for prompt, match in (("\ud800", "^prompt is not valid Unicode"),
                              ("ab\udfffc", "^prompt is not valid Unicode"),
                              (["ok", "\udfff"], "^prompt 1: prompt is not valid Unicode")):
            with pytest.raises(RequestError, match=match) as e:
                engine.generate(prompt, greedy(2))
            assert e.value.param == "prompt"
        with pytest.raises(RequestError, match="not valid Unicode"):
            next(engine.stream("\ud800abc"))
        for bad in ("nope", None, 1.5, True):
            with pytest.raises(TypeError, match="request_id must be an int"):
                engine.abort(bad)
        engine.abort(12345)  # an unknown id is ignored
        assert engine.generate("ok", greedy(2))["meta_info"]["completion_tokens"] == 2


def test_engine_options_are_validated(tiny, tmp_path, caplog, monkeypatch):
    from specdial._core import ConfigError

    with pytest.raises(ConfigError, match="context_length"):
        Engine.from_modules(tiny.target, **{**KW, "context_length": 0})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    # the config file is loaded (and rejected) even when adaptive steps are off
    with pytest.raises(ConfigError):
        Engine.from_modules(tiny.target, tiny.draft_noisy, speculative_adaptive=False,
                            speculative_adaptive_config=str(bad), **KW)
    with pytest.raises((ConfigError, OSError)):
        Engine.from_modules(tiny.target, speculative_adaptive_config=str(tmp_path / "none"),
                            **KW)
    with caplog.at_level(logging.WARNING, logger="specdial.engine"):
        engine = Engine.from_modules(tiny.target, **{**KW, "kv_cache_tokens": 1})
    assert engine.context_length == 8  # one page of 8 tokens
    assert any("kv_cache_tokens=1" in r.getMessage() and "cut to 8" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING), caplog.text
    engine.shutdown()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="device 'cuda.*CUDA is not available"):
            Engine(tiny.path, device=device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="device 'cuda:3'.*no such CUDA device"):
        Engine(tiny.path, device="cuda:3")
