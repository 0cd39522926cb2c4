"""The Rust scheduler from Python: a full fake serving loop (plan -> fake model -> report) whose
emitted tokens are a function of (request, position), so preemption must not change outputs;
finish reasons, aborts, queue limits, typed errors, zero-copy arrays and the trace."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specdial._core import (
    AdaptiveConfig,
    ConfigError,
    FinishedRequest,
    Int64Array,
    InvalidRequestError,
    QueueFullError,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
    SchedulePlan,
)
from specdial.replay import parse_line


def tok(rid: int, pos: np.ndarray | int) -> np.ndarray:
    """The fake model's token at ``pos`` of request ``rid`` (never 0)."""
    return 1 + (rid * 31 + np.asarray(pos, np.int64) * 7) % 97


class FakeModel:
    """Answers plans like a worker would: first tokens for sampling prefills, and for decode
    ``accept(rid, steps_r)`` accepted drafts plus the bonus token, all from :func:`tok`."""

    def __init__(self, accept=lambda rid, steps_r: steps_r):
        self.accept = accept
        self.plans: list[SchedulePlan] = []

    def run(self, plan: SchedulePlan) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        self.plans.append(plan)
        rids = np.asarray(plan.request_ids)
        kv_lens = np.asarray(plan.kv_lens)
        pieces = []
        if plan.is_prefill:
            sample = np.asarray(plan.sample_first).astype(bool)
            for rid, kv_len, s in zip(rids.tolist(), kv_lens.tolist(), sample.tolist()):
                pieces.append(tok(rid, [kv_len]) if s else np.zeros(0, np.int64))
            accepted = None
        else:
            positions = np.asarray(plan.positions)
            steps_r = np.asarray(plan.steps_per_request)
            accepted = np.array([min(self.accept(r, s), s) for r, s in zip(rids.tolist(), steps_r.tolist())],
                                np.int64)
            for rid, l, a in zip(rids.tolist(), positions.tolist(), accepted.tolist()):
                pieces.append(tok(rid, np.arange(l + 1, l + a + 2)))
        counts = np.array([len(p) for p in pieces], np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        tokens = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)
        return tokens, offsets, accepted


def serve(sched: Scheduler, model: FakeModel, max_iters: int = 10_000):
    """The engine loop; returns (streamed outputs per request, finished records per request)."""
    streamed: dict[int, list[int]] = {}
    finished: dict[int, FinishedRequest] = {}
    for _ in range(max_iters):
        plan = sched.schedule()
        if plan is None:
            break
        tokens, offsets, accepted = model.run(plan)
        res = sched.report(tokens, offsets, accepted)
        new, off = np.asarray(res.new_tokens), np.asarray(res.new_offsets)
        for b, rid in enumerate(np.asarray(res.request_ids).tolist()):
            streamed.setdefault(rid, []).extend(new[off[b]:off[b + 1]].tolist())
        for f in res.finished:
            assert f.request_id not in finished
            finished[f.request_id] = f
    assert not sched.has_unfinished()
    return streamed, finished


def expected(rid: int, prompt_len: int, max_new: int, context_length: int, stop=()) -> list[int]:
    out, pos = [], prompt_len
    while True:
        t = int(tok(rid, pos))
        out.append(t)
        pos += 1
        if t in stop or len(out) >= max_new or pos >= context_length:
            return out


def config(**kw) -> SchedulerConfig:
    base = dict(max_running_requests=8, max_queued_requests=32, max_prefill_tokens=64, context_length=64,
                num_pages=64, page_size=4)
    base.update(kw)
    return SchedulerConfig(**base)


def test_full_loop_outputs_and_no_leaks():
    sched = Scheduler(config(), speculative_num_steps=3, adaptive=False)
    prompts = {sched.add_request(list(range(10, 10 + n)), m): (n, m) for n, m in [(5, 9), (12, 20), (1, 1), (30, 40)]}
    streamed, finished = serve(sched, FakeModel(lambda rid, s: rid % (s + 1)))
    for rid, (n, m) in prompts.items():
        assert streamed[rid] == expected(rid, n, m, 64)
        assert finished[rid].reason == "length"
        assert finished[rid].output_len == len(streamed[rid])
    st = sched.stats()
    assert (st.kv_pages_used, st.running, st.queued, st.preemptions) == (0, 0, 0, 0)
    assert st.requests_finished == 4 and st.tokens_generated == sum(map(len, streamed.values()))
    # Request 3 stopped at the context end: 30 + 34 = 64 tokens.
    assert len(streamed[3]) == 34


def test_decode_plan_layout_and_zero_copy_arrays():
    sched = Scheduler(config(), speculative_num_steps=2, adaptive=False, plan_kv_layout=True)
    sched.add_request(np.arange(5, dtype=np.int32), 10)
    model = FakeModel()
    plan = sched.schedule()
    assert (plan.kind, plan.batch_size, plan.num_tokens, len(plan)) == ("prefill", 1, 5, 1)
    assert plan.input_ids.tolist() == [0, 1, 2, 3, 4] and plan.positions.tolist() == [0, 1, 2, 3, 4]
    assert plan.logits_indices.tolist() == [4] and plan.prefill_done.tolist() == [1]
    sched.report(*model.run(plan))
    plan = sched.schedule()
    assert plan.kind == "decode" and not plan.is_prefill
    assert plan.input_ids.tolist() == [int(tok(0, 5))] and plan.positions.tolist() == [5]
    assert plan.steps_per_request.tolist() == [2] and plan.qo_lens.tolist() == [3]
    assert plan.kv_lens.tolist() == [8] and plan.out_loc.tolist() == [5, 6, 7]
    assert plan.kv_indices.tolist() == list(range(8))
    assert plan.page_table.tolist() == [0, 1] and plan.page_table_offsets.tolist() == [0, 2]
    assert plan.graph_key == (2, 1) and plan.graph_bs is None
    assert plan.out_loc_padded(-1).tolist() == [5, 6, 7]
    # Zero copy: numpy views the Rust buffer, read-only; the getter returns the same object.
    kv = np.asarray(plan.kv_indices)
    assert kv.dtype == np.int64 and not kv.flags.writeable
    assert isinstance(plan.kv_indices, Int64Array) and plan.kv_indices is plan.kv_indices
    assert np.shares_memory(kv, np.asarray(plan.kv_indices))
    # Reports take int32 arrays and lists as well.
    tokens, offsets, accepted = model.run(plan)
    res = sched.report(tokens.astype(np.int32), offsets.tolist(), accepted.astype(np.int32))
    assert res.new_tokens.tolist() == tok(0, [6, 7, 8]).tolist()
    assert res.new_offsets.tolist() == [0, 3]


def test_preemption_keeps_outputs_and_is_signalled():
    # 10 pages of 4 tokens: four 9-token prompts growing to 40 tokens cannot all fit.
    cfg = dict(context_length=40, num_pages=10, page_size=4)
    prompts = [(9, 30)] * 4
    small = Scheduler(config(**cfg), speculative_num_steps=3, adaptive=False)
    big = Scheduler(config(**{**cfg, "num_pages": 64}), speculative_num_steps=3, adaptive=False)
    for s in (small, big):
        for n, m in prompts:
            s.add_request([7] * n, m)
    accept = lambda rid, s: (rid + 1) % (s + 1)  # noqa: E731
    model = FakeModel(accept)
    out_small, fin_small = serve(small, model)
    out_big, _ = serve(big, FakeModel(accept))
    assert out_small == out_big
    assert all(f.reason == "length" for f in fin_small.values())
    assert small.stats().preemptions > 0 and big.stats().preemptions == 0
    preempted = [p for p in model.plans if len(p.preempted)]
    assert preempted and all(p.kind == "decode" for p in preempted)
    # A preempted request comes back in a prefill from position 0 that samples nothing.
    rid = preempted[0].preempted.tolist()[0]
    later = model.plans[model.plans.index(preempted[0]) + 1:]
    resume = next(p for p in later if p.is_prefill and rid in p.request_ids.tolist())
    b = resume.request_ids.tolist().index(rid)
    assert resume.positions.tolist()[sum(resume.qo_lens.tolist()[:b])] == 0
    assert small.stats().kv_pages_used == 0


def test_stop_tokens_eos_and_ignore_eos():
    eos = int(tok(0, 7))
    sched = Scheduler(config(eos_token_ids=[eos]), speculative_num_steps=4, adaptive=False)
    a = sched.add_request([1] * 5, 30)  # EOS at position 7
    b = sched.add_request([1] * 5, 30, stop_token_ids=[int(tok(1, 6))])
    c = sched.add_request([1] * 5, 6, ignore_eos=True)
    streamed, finished = serve(sched, FakeModel())
    assert streamed[a] == tok(0, [5, 6, 7]).tolist()
    assert (finished[a].reason, finished[a].stop_token_id) == ("stop", eos)
    assert streamed[b] == tok(1, [5, 6]).tolist()
    assert (finished[b].reason, finished[b].stop_token_id) == ("stop", int(tok(1, 6)))
    assert (finished[c].reason, finished[c].stop_token_id, len(streamed[c])) == ("length", None, 6)


def test_abort_and_stop_strings_in_every_state():
    sched = Scheduler(config(max_prefill_tokens=4), speculative_num_steps=1, adaptive=False)
    model = FakeModel()
    running = sched.add_request([1] * 3, 20)
    sched.report(*model.run(sched.schedule()))
    prefilling = sched.add_request([1] * 10, 20)
    waiting = sched.add_request([1] * 3, 20)
    sched.report(*model.run(sched.schedule()))
    assert [sched.request_state(r) for r in (running, prefilling, waiting)] == ["running", "prefilling", "waiting"]
    f = sched.abort(waiting)
    assert (f.request_id, f.reason, f.output_len) == (waiting, "abort", 0)
    assert sched.abort(waiting) is None  # twice: harmless
    assert sched.abort(prefilling).reason == "abort"
    # A stop string matched in Python while a decode plan is in flight: its results are ignored.
    plan = sched.schedule()
    assert plan.kind == "decode" and plan.request_ids.tolist() == [running]
    f = sched.finish_request(running, "stop")
    assert (f.reason, f.stop_token_id, f.output_len) == ("stop", None, 1)
    res = sched.report(*model.run(plan))
    assert res.new_offsets.tolist() == [0, 0] and res.finished == []
    assert sched.request_state(running) is None and sched.output_ids(running) is None
    st = sched.stats()
    assert (st.kv_pages_used, st.requests_aborted, st.requests_finished) == (0, 2, 1)
    assert sched.schedule() is None
    with pytest.raises(ValueError, match="reason must be"):
        sched.finish_request(0, "done")


def test_queue_full_and_bad_inputs_are_typed_errors():
    # 8 running slots free + 2 queued beyond them: the 11th new request is refused
    sched = Scheduler(config(max_queued_requests=2, context_length=16), speculative_num_steps=0, adaptive=False)
    for _ in range(10):
        sched.add_request([1], 4)
    with pytest.raises(QueueFullError, match="max_queued_requests = 2") as e:
        sched.add_request([1], 4)
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, SchedulerError)
    for args, field in [(([], 4), "prompt_ids"), (([1] * 16, 4), "prompt_ids"), (([1, -1], 4), "prompt_ids"),
                        (([1], 0), "max_new_tokens"), (([1], 4, [-3]), "stop_token_ids")]:
        with pytest.raises(InvalidRequestError, match=f"^{field}: ") as e:
            sched.add_request(*args)
        assert isinstance(e.value, ValueError)
    with pytest.raises(TypeError, match="prompt_ids must be a sequence of ints"):
        sched.add_request("hello", 4)
    with pytest.raises(ValueError, match="prompt_ids must be 1-D"):
        sched.add_request(np.ones((2, 2), np.int64), 4)
    assert sched.num_queued == 10
    # The prompt may take context_length - 1 tokens.
    sched.schedule()


def test_protocol_and_report_errors():
    sched = Scheduler(config(), speculative_num_steps=2, adaptive=False)
    with pytest.raises(SchedulerError, match="no plan in flight"):
        sched.report([], [0])
    sched.add_request([1, 2], 9)
    plan = sched.schedule()
    with pytest.raises(SchedulerError, match="a plan is in flight"):
        sched.schedule()
    with pytest.raises(ValueError, match="^offsets: expected 2 entries"):
        sched.report([5], [0, 1, 1])
    with pytest.raises(ValueError, match="^accepted: must be None for a prefill plan"):
        sched.report([5], [0, 1], [0])
    assert sched.plan_in_flight
    sched.report([5], [0, 1])
    plan = sched.schedule()
    with pytest.raises(ValueError, match=r"^offsets: request 0 \(index 0\) has 4 tokens"):
        sched.report([5, 6, 7, 8], [0, 4])
    with pytest.raises(ValueError, match=r"^accepted: accepted\[0\] = 0 but request 0 emitted 2"):
        sched.report([5, 6], [0, 2], np.array([0]))
    with pytest.raises(ValueError, match="^tokens: tokens"):
        sched.report([5, -6], [0, 2])
    res = sched.report([5, 6], [0, 2])
    assert res.new_tokens.tolist() == [5, 6] and plan.batch_size == 1


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="^max_running_requests: must be >= 1"):
        SchedulerConfig(max_running_requests=0)
    with pytest.raises(ConfigError, match="^num_pages: must be in 0..=4294967295"):
        SchedulerConfig(num_pages=-1)
    with pytest.raises(ConfigError, match="cannot hold one request of context_length = 2048"):
        SchedulerConfig(num_pages=10, page_size=16)
    with pytest.raises(ConfigError, match="eos_token_ids"):
        SchedulerConfig(eos_token_ids=[-1])
    with pytest.raises(ConfigError, match="candidate of no slot"):
        Scheduler(SchedulerConfig(), speculative_num_steps=9)
    with pytest.raises(ConfigError, match="^speculative_num_steps: must be in 0..=32"):
        Scheduler(SchedulerConfig(), speculative_num_steps=40, adaptive=False)
    with pytest.raises(ConfigError, match="^adaptive_config: given with adaptive=False"):
        Scheduler(SchedulerConfig(), speculative_num_steps=1, adaptive=False, adaptive_config={"candidate_steps": [1]})
    with pytest.raises(ConfigError, match="cuda_graph_bs"):
        Scheduler(SchedulerConfig(), speculative_num_steps=3, cuda_graph_bs=[0])
    with pytest.raises(ConfigError, match="no adaptive policy"):
        Scheduler(SchedulerConfig(), speculative_num_steps=1, adaptive=False).set_fixed_steps(None)
    c = SchedulerConfig(num_pages=8, page_size=256, eos_token_ids=[2])
    assert (c.num_slots, c.eos_token_ids, c.record_trace) == (2048, [2], False)
    assert c == SchedulerConfig(num_pages=8, page_size=256, eos_token_ids=[2])
    assert "num_pages=8" in repr(c)


def test_adaptive_policy_trace_and_stats():
    adaptive = AdaptiveConfig.from_dict({"warmup_batches": 0, "update_interval": 1, "ema_alpha": 1.0,
                                         "1": {"candidate_steps": [1, 3]}, "4": {"candidate_steps": [0, 1]}})
    sched = Scheduler(config(record_trace=True), speculative_num_steps=3, adaptive_config=adaptive,
                      cuda_graph_bs=[1, 2, 4, 8])
    assert sched.candidate_steps == [0, 1, 3] and sched.fixed_steps is None
    for _ in range(2):
        sched.add_request([1] * 4, 12)
    # Nothing accepted: slot 1 drops from 3 to 1 after the first verify.
    streamed, _ = serve(sched, FakeModel(lambda rid, s: 0))
    st = sched.stats()
    assert st.step_switches >= 1
    assert sched.slot_states()[0][:2] == (1, 1)
    assert set(st.decode_iterations_by_steps) <= {1, 3} and 3 in st.decode_iterations_by_steps
    assert st.spec_num_accepted_tokens == 0 and st.spec_num_drafts > 0
    assert st.as_dict()["decode_iterations"] == st.decode_iterations == sum(st.decode_iterations_by_steps.values())
    lines = sched.drain_trace().splitlines()
    assert len(lines) == st.decode_iterations and sched.drain_trace() == ""
    first = json.loads(lines[0])
    assert first == {"batch_size": 2, "accepted": [0, 0], "steps": 3, "context_tokens": 8}
    for i, line in enumerate(lines):
        v = parse_line(line, f"trace:{i + 1}")  # what `specdial policy replay` reads
        assert v is not None and v.batch_size == json.loads(line)["batch_size"]
    # Graph padding: 2 requests replay the graph of 2.
    decode = Scheduler(config(), speculative_num_steps=1, adaptive=False, cuda_graph_bs=[1, 4])
    for _ in range(2):
        decode.add_request([1], 5)
    model = FakeModel()
    decode.report(*model.run(decode.schedule()))
    plan = decode.schedule()
    assert (plan.graph_bs, plan.graph_key) == (4, (1, 4))


def test_fixed_steps_switching_never_leaks_and_caps_near_the_end():
    sched = Scheduler(config(num_pages=20, page_size=2, context_length=40), speculative_num_steps=0, adaptive=False)
    lens = {sched.add_request([3] * (2 + i), 5 + 3 * i): (2 + i, 5 + 3 * i) for i in range(6)}
    model = FakeModel(lambda rid, s: s // 2)
    steps_cycle = [0, 7, 3, 5, 1]
    streamed: dict[int, list[int]] = {}
    for it in range(1000):
        sched.set_fixed_steps(steps_cycle[it % len(steps_cycle)])
        plan = sched.schedule()
        if plan is None:
            break
        if not plan.is_prefill:
            assert max(plan.steps_per_request.tolist()) <= plan.steps
        res = sched.report(*model.run(plan))
        for b, rid in enumerate(res.request_ids.tolist()):
            o = res.new_offsets.tolist()
            streamed.setdefault(rid, []).extend(res.new_tokens.tolist()[o[b]:o[b + 1]])
        st = sched.stats()
        assert st.kv_pages_used <= st.kv_pages_total and st.running + st.prefilling <= 8
    assert not sched.has_unfinished() and sched.stats().kv_pages_used == 0
    for rid, (n, m) in lens.items():
        assert streamed[rid] == expected(rid, n, m, 40)


def test_rows_come_with_the_plan_and_the_kv_layout_only_on_request():
    """The scheduler assigns worker rows at admission and frees them at finish / abort /
    preemption; per-token context arrays are in the plan only with ``plan_kv_layout``."""
    sched = Scheduler(config(), speculative_num_steps=1, adaptive=False)
    assert not sched.plan_kv_layout
    for n in (3, 4, 5):
        sched.add_request(list(range(1, n + 1)), 8)
    model = FakeModel()
    plan = sched.schedule()
    assert plan.rows.tolist() == [0, 1, 2] and sched.rows_in_use == 3 and sched.row_of(1) == 1
    assert len(plan.kv_indices) == len(plan.page_table) == len(plan.page_table_offsets) == 0
    sched.report(*model.run(plan))
    sched.abort(1)
    assert sched.row_of(1) is None and sched.rows_in_use == 2
    sched.plan_kv_layout = True
    plan = sched.schedule()
    assert plan.rows.tolist() == [0, 2]
    assert len(plan.kv_indices) == int(np.asarray(plan.kv_lens).sum())
    res = sched.report(*model.run(plan))
    # the report carries the state after it: no stats() / slot_states() call needed
    assert res.stats.as_dict() == sched.stats().as_dict() and res.slot_states == sched.slot_states()


def test_abandon_plan_aborts_its_live_requests():
    sched = Scheduler(config(), speculative_num_steps=2, adaptive=False)
    with pytest.raises(SchedulerError, match="no plan in flight"):
        sched.abandon_plan()
    ids = [sched.add_request([1, 2, 3], 9) for _ in range(3)]
    sched.schedule()
    sched.abort(ids[1])
    finished = sched.abandon_plan()
    assert [(f.request_id, f.reason) for f in finished] == [(ids[0], "abort"), (ids[2], "abort")]
    assert not sched.plan_in_flight and not sched.has_unfinished()
    st = sched.stats()
    assert (st.kv_pages_used, st.requests_aborted, sched.rows_in_use) == (0, 3, 0)
    assert sched.schedule() is None
