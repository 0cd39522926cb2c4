"""Features meeting in one verify (docs/design.md invariants 1, 2, 4 and 7), through the
offline Engine on the built-in models (real tokenizer, EAGLE drafter), each against target-only
decoding (steps 0) of the same requests:

- the speculations a user can configure with a grammar: a fixed draft tree, trees with
  per-request node budgets (on the CPU a ragged verify of each request's kept nodes) and
  per-request verify budgets of chains (goodput ``"verify": "per_request"``, ``"min_survival":
  "auto"``: packed verify, confidence stop). The node budgets come from a fixed tree whose
  plans the test gives a node threshold, as the goodput policy's per-request decision does:
  what the policy chooses per iteration depends on what it measured, so its trees with node
  budgets would come and go with the machine's load (they are covered over HTTP in
  ``test_combinations_server.py``, whose policy learns a deterministic cost);
- with each: greedy output (ids, finish reasons, logprobs) identical to target-only under a
  JSON schema with stop strings, logprobs, two copies of every prompt in one batch (what
  ``n = 2`` submits) and the prefix cache on with a shared prefix (its second pass hits the
  cache); seeded sampling with a grammar and with processors gives the tokens plain decoding
  samples, alone or batched;
- the ends of a request inside a tree verify: its grammar reaching the accept state (finish
  "stop", the stop token, nothing past it), ``max_new_tokens``, a stop token (EOS) drafted
  and accepted in the middle of a verify; an abort while its tree is in flight leaves the
  other requests' tokens unchanged and every KV page and worker row free.

The tree engines record their tree iterations (``run_tree_iteration`` spied on), and each test
checks that the combination did run in a tree verify (constrained rows, node budgets that cut,
tokens emitted past a request's end, ragged verifies); a request whose end the core caps (its
remaining tokens) is checked to end at the cap inside a tree verify.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time

import numpy as np
import pytest

from specdial.engine import Engine
from test_engine_greedy import assert_no_leak
from timeouts import scaled

KW = dict(max_running_requests=12, kv_cache_tokens=4096, page_size=8, log_interval_s=None,
          policy_cache=False)
SCHEMA = json.dumps({"type": "object", "properties": {
    "id": {"type": "integer"}, "ok": {"type": "boolean"}, "tag": {"enum": ["a", "b", "c"]}},
    "required": ["id", "ok", "tag"], "additionalProperties": False})
LONG_REGEX = r"(a[bc]d[ ,]|x[0-9]{2};){150}"  # no end within the tests' budgets
PROMPTS = ["Record:", "def f(x):", "The answer is", "{", "# data\n"]
SHARED = ('def parse_args(argv):\n    """Parse the command line and return a namespace."""\n'
          "    import argparse\n    parser = argparse.ArgumentParser()\n")
PREFIXED = [SHARED + s for s in ("    parser.add", "    return", "    #", "    p")]
EOS = 0  # the built-in tokenizer's

#: the speculations combined with the features
SPECULATION = {
    "tree_fixed": dict(speculative_adaptive=False, speculative_num_steps=3,
                       speculative_eagle_topk=2, speculative_num_draft_tokens=7),
    # a fixed tree whose plans carry a node threshold (set by the spy below, as the goodput
    # policy's per-request decision sets it): each request verifies its kept nodes, ragged
    "tree_node_budgets": dict(speculative_adaptive=False, speculative_num_steps=3,
                              speculative_eagle_topk=4, speculative_num_draft_tokens=10),
    "chain_budgets": dict(speculative_adaptive_config={
        "strategy": "goodput", "verify": "per_request", "min_survival": "auto",
        "1": {"candidate_steps": [0, 1, 2, 3, 4]}}),
}
TREES = ("tree_fixed", "tree_node_budgets")
MIN_SURVIVAL = 0.1  # the node threshold of the "tree_node_budgets" engine's tree plans
#: goodput with per-request budgets and trees: the policy chooses trees and node thresholds
POLICY_TREES = dict(speculative_eagle_topk=4, speculative_num_draft_tokens=9,
                    speculative_adaptive_config={
                        "strategy": "goodput", "verify": "per_request", "min_survival": "auto",
                        "1": {"candidate_steps": [0, 1, 2, 3]}})


class Trees:
    """The tree iterations of every engine: per iteration ``(N, verified or None, constrained,
    emitted tokens per row)``, of the engine under test only."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.min_survival: dict[int, float] = {}  # id(worker) -> the threshold its plans get
        self.current: int | None = None  # id(worker) of the engine under test: recorded alone
        self.limits: list[tuple] = []  # per iteration: (depth, per-request limits, emitted)
        self.target_tokens: list[tuple[int, int]] = []  # per verify: (ran, B (N + 1))

    def clear(self) -> None:
        self.calls.clear()
        self.limits.clear()
        self.target_tokens.clear()

    def ragged(self) -> int:
        """Tree verifies whose target forward ran fewer tokens than ``B (N + 1)``."""
        return sum(ran < full for ran, full in self.target_tokens)

    def ended_by_limit(self) -> int:
        """Rows of tree iterations whose accepted path was limited below the tree's depth
        (``max_new_tokens`` near) and that emitted their whole limit plus the bonus token."""
        return sum(int(((lim < d) & (np.asarray(n) == lim + 1)).sum())
                   for d, lim, n in self.limits)

    def cut(self) -> int:
        """Tree iterations in which some request verified fewer nodes than drafted."""
        return sum(v is not None and bool((np.asarray(v) < n).any())
                   for n, v, _, _ in self.calls)

    def constrained(self) -> int:
        return sum(c for _, _, c, _ in self.calls)

    def emitted_after(self, token: int) -> int:
        """Rows of tree iterations that emitted ``token`` before their last emitted token."""
        return sum(token in row[:-1] for *_, rows in self.calls for row in rows)


@pytest.fixture(scope="module")
def trees():
    import specdial.worker.tree_step as tree_step
    import specdial.worker.worker as worker_module

    rec = Trees()
    run, run_target = worker_module.run_tree_iteration, tree_step.run_target
    plans: dict[int, object] = {}  # loop thread -> its tree plan in flight (None: not mine)

    def counting(target, drafter, batch, *a, **k):
        plan = plans.get(threading.get_ident())
        if plan is not None:
            rec.target_tokens.append((int(batch.input_ids.numel()),
                                      len(plan.rows) * (plan.num_draft_tokens + 1)))
        return run_target(target, drafter, batch, *a, **k)

    def spy(worker, plan, *a, **k):
        ms = rec.min_survival.get(id(worker))
        if ms is not None and plan.min_survival == 0:
            plan = dataclasses.replace(plan, min_survival=ms)
        mine = id(worker) == rec.current
        plans[threading.get_ident()] = plan if mine else None
        a = (worker, plan, *a)
        out = run(*a, **k)
        if not mine:  # another engine's (one a failed test left running)
            return out
        rows = [out.tokens_of(b).tolist() for b in range(len(out.offsets) - 1)]
        limits = (np.full(len(rows), plan.steps) if plan.steps_per_request is None
                  else np.asarray(plan.steps_per_request))
        rec.calls.append((plan.num_draft_tokens, out.verified, a[2].grammar is not None, rows))
        rec.limits.append((plan.steps, limits, [len(r) for r in rows]))
        return out
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker_module, "run_tree_iteration", spy)
        mp.setattr(tree_step, "run_target", counting)
        yield rec


def _build(name: str, trees: Trees) -> Engine:
    e = Engine(model_path=None, **KW, **SPECULATION[name])
    e.speculation = name
    if name == "tree_node_budgets":
        trees.min_survival[id(e.worker)] = MIN_SURVIVAL
    return e


@pytest.fixture(scope="module")
def engines(trees):
    built = {name: _build(name, trees) for name in SPECULATION}
    yield built
    for e in built.values():
        e.shutdown()


@pytest.fixture(params=list(SPECULATION))
def engine(request, trees, engines):
    trees.clear()
    e = engines[request.param]
    trees.current = id(e.worker)
    return e


@pytest.fixture(scope="module")
def plain():
    e = Engine(model_path=None, speculative_num_steps=0, **KW)
    yield e
    e.shutdown()


def _check_ran_trees(engine, trees: Trees, constrained: bool = True) -> None:
    """The combination reached a tree verify: tree engines ran trees (with constrained rows
    when ``constrained``), and the node-budget engine's budgets cut some trees."""
    if engine.speculation not in TREES:
        assert not trees.calls
        return
    assert trees.calls, "no tree iteration ran"
    if constrained:
        assert trees.constrained() > 0
    if engine.speculation == "tree_node_budgets":  # budgets cut, and the verify was ragged
        assert trees.cut() > 0 and trees.ragged() > 0, [v for _, v, _, _ in trees.calls]


def _ids(outs):
    return [o["output_ids"] for o in outs]


def _ends(outs):
    return [o["meta_info"]["finish_reason"] for o in outs]


COMBOS = ["stop", "logprobs", "n2", "prefix"]


@pytest.mark.parametrize("combo", COMBOS)
def test_greedy_with_a_grammar_equals_target_only(engine, plain, trees, combo):
    """Greedy under a JSON schema with ``combo``: ids, finish reasons (and logprobs) equal
    target-only's; every page and row is free after."""
    sp = {"max_new_tokens": 40, "temperature": 0.0, "json_schema": SCHEMA}
    prompts, kw = PROMPTS, {}
    if combo == "stop":  # the key's closing quote: completed in the middle of a verify
        sp["stop"] = ['"ok', "tag"]
    elif combo == "logprobs":
        kw = dict(return_logprob=True, top_logprobs_num=3)
    elif combo == "n2":
        prompts = [p for p in PROMPTS for _ in range(2)]
    elif combo == "prefix":
        prompts = PREFIXED
    want = plain.generate(prompts, sp, **kw)
    if combo == "prefix":  # only this test's pages in the cache: earlier tests' cannot crowd it
        assert engine.flush_cache()
    for _ in range(2 if combo == "prefix" else 1):
        before = engine.stats().cached_tokens
        got = engine.generate(prompts, sp, **kw)
        assert _ids(got) == _ids(want)
        assert _ends(got) == _ends(want)
        assert_no_leak(engine)
    if combo == "stop":
        assert sum(e["type"] == "stop" and e.get("matched") in sp["stop"]
                   for e in _ends(got)) >= 3, _ends(got)
    if combo == "logprobs":
        for g, w in zip(got, want):
            for key in ("output_token_logprobs", "output_top_logprobs"):
                a, b = g["meta_info"][key], w["meta_info"][key]
                flat = lambda x: [v for row in x for v in (row if key.endswith("top_logprobs")  # noqa: E731
                                                           else [row])]
                assert [t[1] for t in flat(a)] == [t[1] for t in flat(b)]
                np.testing.assert_allclose([t[0] for t in flat(a)], [t[0] for t in flat(b)],
                                           atol=1e-3)
    # the second pass found every prompt's full pages (>= 4 of 8) cached, whatever steps the
    # adaptive chain engine's policy chose: a request's committed pages are cached even when
    # it decoded plainly with its drafter behind (it once found none under a loaded CI run)
    if combo == "prefix":
        hits = engine.stats().cached_tokens - before
        assert hits >= len(PREFIXED) * 32, (hits, engine.stats())
    _check_ran_trees(engine, trees)


def test_seeded_tokens_do_not_depend_on_batch_shape_or_budgets(engine, plain, trees):
    """Seeded requests (a regex; processors: penalties, min_p, logit_bias, top_p) get the
    tokens plain decoding samples with their seeds, in a batch and alone."""
    sp = [{"max_new_tokens": 24, "temperature": 1.0, "seed": 11 + i, "regex": LONG_REGEX}
          for i in range(3)]
    sp += [{"max_new_tokens": 24, "temperature": 0.8, "seed": 5 + i, "top_p": 0.9,
            "min_p": 0.05, "presence_penalty": 1.0, "frequency_penalty": 0.5,
            "logit_bias": {"12": 3.0}} for i in range(3)]
    prompts = PROMPTS[:3] * 2
    want = _ids(plain.generate(prompts, sp))
    assert _ids(engine.generate(prompts, sp)) == want
    assert engine.generate(prompts[1], sp[1])["output_ids"] == want[1]
    assert engine.generate(prompts[4], sp[4])["output_ids"] == want[4]
    assert_no_leak(engine)
    _check_ran_trees(engine, trees)


@pytest.mark.parametrize("regex", [r"[0-9]{1,4} (kg|lb)", r"(yes|no)",
                                   r"\((a|b)(,(a|b)){0,3}\)"])
def test_grammar_completing_inside_a_tree_verify_stops_there(engine, plain, trees, regex):
    """The accept state reached inside a verify: finish "stop" on the stop token, the text a
    full match, nothing after it (the verify emitted stop tokens past it: cut)."""
    sp = {"max_new_tokens": 30, "temperature": 0.0, "regex": regex}
    got, want = engine.generate(PROMPTS, sp), plain.generate(PROMPTS, sp)
    assert _ids(got) == _ids(want) and _ends(got) == _ends(want)
    for o in got:
        assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
        assert o["output_ids"][-1] == EOS and EOS not in o["output_ids"][:-1]
        assert re.fullmatch(regex, o["text"]), o["text"]
    assert_no_leak(engine)
    if engine.speculation in TREES:
        assert trees.emitted_after(EOS) > 0  # the stop token was not a verify's last token
    _check_ran_trees(engine, trees)


def test_max_new_tokens_inside_a_tree_verify(engine, plain, trees):
    """``max_new_tokens`` 1, 2 and 5, with a grammar and without: ids and finish reasons equal
    target-only's. The core caps a request's accepted path at its remaining tokens (its
    ``steps_per_request``), so a tree verify ends it by that cap: some did, accepting all of it,
    and no verify emitted more tokens than the outputs kept."""
    kept = 0
    for m in (1, 2, 5):
        for extra in ({}, {"json_schema": SCHEMA}):
            sp = {"max_new_tokens": m, "temperature": 0.0, **extra}
            got = engine.generate(PROMPTS, sp)
            assert _ids(got) == _ids(plain.generate(PROMPTS, sp))
            assert _ends(got) == [{"type": "length", "length": m}] * len(PROMPTS)
            kept += sum(len(o["output_ids"]) - 1 for o in got)  # the prefill sampled the first
    assert_no_leak(engine)
    if engine.speculation in TREES:
        emitted = sum(len(r) for *_, rows in trees.calls for r in rows)
        assert emitted == kept and trees.ended_by_limit() > 0, (emitted, kept)
    _check_ran_trees(engine, trees)


def test_a_stop_token_accepted_inside_a_tree_verify_ends_there(engine, plain, trees):
    """Each request's stop token (``stop_token_ids``, the core's EOS rule) is the token its
    target-only output has at index 6, which the drafter proposes and the verify accepts
    with tokens after it: output up to the first occurrence, finish "stop" matching it."""
    base = plain.generate(PROMPTS, {"max_new_tokens": 12, "temperature": 0.0})
    stops = [o["output_ids"][6] for o in base]
    sp = [{"max_new_tokens": 40, "temperature": 0.0, "stop_token_ids": [t]} for t in stops]
    got, want = engine.generate(PROMPTS, sp), plain.generate(PROMPTS, sp)
    assert _ids(got) == _ids(want) and _ends(got) == _ends(want)
    for o, t in zip(got, stops):
        ids = o["output_ids"]
        assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": t}
        assert ids[-1] == t and t not in ids[:-1] and len(ids) <= 7
    assert_no_leak(engine)
    if engine.speculation in TREES:
        assert sum(trees.emitted_after(t) for t in set(stops)) > 0
    _check_ran_trees(engine, trees, constrained=False)


@pytest.mark.parametrize("with_grammar", [False, True])
def test_an_abort_mid_tree_leaves_the_others_and_frees_every_page(engine, plain, trees,
                                                                  with_grammar):
    """One request aborted while the batch decodes (its tree in flight): the others' tokens
    equal target-only's, the aborted one ends "abort" short of its budget, and every KV page
    (its tree's scratch slots included) and worker row is free."""
    extra = {"regex": LONG_REGEX} if with_grammar else {}
    sp = {"max_new_tokens": 32, "temperature": 0.0, **extra}
    want = _ids(plain.generate(PROMPTS, sp))
    out: list = []
    worker = threading.Thread(target=lambda: out.extend(engine.generate(PROMPTS, sp)))
    victim = engine.stream("import os\n", sampling_params={**sp, "max_new_tokens": 400})
    first = next(victim)
    worker.start()
    seen = len(first.token_ids)
    chunks = [first]
    for chunk in victim:
        chunks.append(chunk)
        seen += len(chunk.token_ids)
        if seen >= 12:
            engine.abort(first.request_id)
            break
    rest = list(victim)
    worker.join(scaled(120))
    assert not worker.is_alive()
    end = (rest or chunks)[-1]
    assert end.finished and end.finish_reason["type"] == "abort"
    assert seen + sum(len(c.token_ids) for c in rest) < 400
    assert _ids(out) == want
    deadline = time.monotonic() + scaled(30)
    while engine.stats().running or engine.stats().queued:  # the abort is asynchronous
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.01)
    assert_no_leak(engine)
    assert engine.scheduler.stats().requests_aborted >= 1
    _check_ran_trees(engine, trees, constrained=with_grammar)


def test_preemption_between_tree_verifies_keeps_grammar_and_seeds(plain, trees):
    """A KV cache too small for the batch's trees (scratch slots included): requests are
    preempted and re-prefilled between tree verifies; seeded constrained and greedy
    constrained outputs equal target-only's, and every page comes back."""
    small = Engine(model_path=None, max_running_requests=3, kv_cache_tokens=96,
                   context_length=64, page_size=8, log_interval_s=None, policy_cache=False,
                   enable_prefix_caching=False, **SPECULATION["tree_fixed"])
    trees.clear()
    trees.current = id(small.worker)
    try:
        for sp in ({"max_new_tokens": 48, "temperature": 1.0, "seed": 7, "regex": LONG_REGEX},
                   {"max_new_tokens": 48, "temperature": 0.0, "json_schema": SCHEMA}):
            assert _ids(small.generate(PROMPTS[:3], sp)) == _ids(plain.generate(PROMPTS[:3], sp))
            assert_no_leak(small)
        assert small.stats().preemptions > 0
        assert trees.calls and trees.constrained() > 0
    finally:
        small.shutdown()



def test_adaptive_chain_decoding_plainly_still_caches_its_pages(plain):
    """The adaptive chain engine's configuration (goodput, per-request budgets) with its steps
    forced (the ``steps_schedule`` hook in place of the policy, whose choices follow the
    machine's load): plain decodes with the zero-step draft extend skipped, after a plain
    decode, so the drafter prefill of the shared-prefix prompts is deferred and their drafters
    never reach their pages (what a loaded CI run's policy did; its second pass then found 0
    cached tokens). The second pass still finds every prompt's full pages cached (the target's
    KV is what is cached); a third pass drafting at steps 3 hits those pages, whose drafter KV
    its drafter computes first, and a fourth hits them with it. Greedy ids equal target-only's
    in every pass, and every page comes back."""
    steps = {"k": 0}
    e = Engine(model_path=None, **KW, **SPECULATION["chain_budgets"],
               steps_schedule=lambda i, n: steps["k"])
    try:
        sp = {"max_new_tokens": 40, "temperature": 0.0}
        e.generate(PROMPTS[0], {**sp, "max_new_tokens": 4})  # the last decode ran steps 0
        assert e.flush_cache()
        want = _ids(plain.generate(PREFIXED, sp))
        for i, k in enumerate((0, 0, 3, 3)):
            steps["k"] = k
            before = e.stats().cached_tokens
            got = e.generate(PREFIXED, sp)
            assert _ids(got) == want
            assert_no_leak(e)
            hist = [o["meta_info"]["spec_steps_histogram"] for o in got]
            assert all(set(h) == {k} for h in hist), hist
            hits = e.stats().cached_tokens - before
            assert i == 0 or hits >= len(PREFIXED) * 32, (i, hits, e.stats())
    finally:
        e.shutdown()
