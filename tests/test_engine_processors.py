"""Issue 14 end to end: every sampling control stays lossless under speculation.

1. Chi-square (docs/design.md invariant 2) through :class:`specdial.Engine` on an 8-token
   vocabulary with a draft model that disagrees with the target: per processor
   (``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``min_p``, ``top_k``,
   ``min_tokens`` with an EOS token) and for a combination of all of them, at fixed steps 1 and
   3, under the adaptive policy and under a steps schedule that switches every iteration. The
   expected distribution is exact: every continuation of the prompt is enumerated with the
   target's raw logits and the float64 reference of tests/processor_reference.py, one token at
   a time. Observed: the marginal of each of the 5 generated tokens (a stop token ends a
   sequence: an extra "ended" category) and the number of distinct tokens among them, which
   penalties move most. Cells of expected count below 5 are pooled; alpha 1e-3 per test over
   its 6 statistics (Bonferroni).
2. The test has power: the same test with a deliberately wrong rule inside the verify
   (penalties counting the committed history but not the drafts before each position; or
   ``min_tokens`` judged at the verify's first position for every position) fails.
3. Greedy with penalties and ``min_tokens`` equals target-only greedy with the same controls
   (and the float64 reference loop over transformers' logits, and transformers' own
   ``repetition_penalty``), for drafters that accept everything, some or nothing, fixed steps,
   a steps schedule, the adaptive policy and the CUDA-graph runner path; a wrong rule breaks it.
4. A seeded request with every processor keeps issue 12's guarantee: its tokens are plain
   decoding's, alone or in a batch, whatever the drafter and the steps.
5. Stop token text, ``include_stop_str_in_output``, ``skip_special_tokens`` and ``min_tokens``
   with stop strings, through the engine.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from conftest import PROMPTS
from greedy import greedy
from processor_reference import ref_logits, ref_probs
from specdial.engine import Engine
from specdial.worker.processors import StepProcessing, apply_processors, column_counts
from test_engine_sampling import tiny_eagle, tiny_model
from test_sampling import chi2_sf

V = 8
EOS = 4
PROMPT = [1, 2, 3]
M = 5  # generated tokens per request
N = 3000
ALPHA = 1e-3
ENDED = V  # category of a position after EOS

SETUPS: dict[str, dict[str, Any]] = {
    "steps 1": dict(speculative_adaptive=False, speculative_num_steps=1),
    "steps 3": dict(speculative_adaptive=False, speculative_num_steps=3),
    "adaptive": dict(speculative_adaptive=True),
    "schedule": dict(steps_schedule=[3, 0, 2, 1, 3]),
}

PROCESSORS: dict[str, dict[str, Any]] = {
    "repetition": dict(temperature=1.0, repetition_penalty=3.0),
    "presence": dict(temperature=1.0, presence_penalty=2.0),
    "frequency": dict(temperature=1.0, frequency_penalty=-1.5),
    "min_p": dict(temperature=1.0, min_p=0.08),
    "top_k": dict(temperature=0.8, top_k=4),
    "min_tokens": dict(temperature=1.0, min_tokens=3, stop_token_ids=[3]),
    # OpenAI's JSON form (string keys); a strong push, a strong pull, a -100 near-ban
    "logit_bias": dict(temperature=1.0, logit_bias={"2": 2.5, "5": -3.0, "6": -100.0}),
    "combination": dict(temperature=0.9, top_k=6, min_p=0.02, top_p=0.95,
                        repetition_penalty=1.6, presence_penalty=0.7, frequency_penalty=0.6,
                        min_tokens=2, stop_token_ids=[3], logit_bias={"0": 1.5, "7": -2.0}),
}


@pytest.fixture(scope="module")
def models():
    """The target (EOS = 4), a perturbed copy as the draft model (it disagrees with the target:
    about 70 % of first drafts accepted, so both accepts and residual draws happen) and a random
    draft model (about 12 %)."""
    target = tiny_model(0, layers=2)
    target.config = dataclasses.replace(target.config, eos_token_ids=(EOS,))
    noisy = copy.deepcopy(target)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return target, noisy, tiny_model(1, layers=1)


# ---------------------------------------------------------------------------------------------
# exact distribution of the first M tokens

_RAW: dict[tuple[int, ...], list[float]] = {}


def raw_logits(target, generated: tuple[int, ...]) -> list[float]:
    """The target's raw next-token logits after ``PROMPT + generated`` (every continuation of
    that length is computed in one batched forward, then cached)."""
    if generated not in _RAW:
        from specdial.attention import TorchAttentionBackend
        from specdial.models.batch import ForwardBatch

        k = len(generated)
        seqs = [PROMPT + list(g) for g in itertools.product(range(V), repeat=k)]
        n, width = len(seqs), len(PROMPT) + k
        backend = TorchAttentionBackend()
        slots = torch.arange(n * width)
        meta = backend.plan(torch.full((n,), width), torch.full((n,), width), slots)
        batch = ForwardBatch(input_ids=torch.tensor(seqs).view(-1),
                             positions=torch.arange(width).repeat(n), out_loc=slots, attn=meta)
        with torch.inference_mode():
            hidden = target(batch, target.make_kv_pool(n * width), backend)
            last = target.compute_logits(hidden.view(n, width, -1)[:, -1]).double()
        for seq, row in zip(seqs, last.tolist()):
            _RAW[tuple(seq[len(PROMPT):])] = row
    return _RAW[generated]


def stop_ids(sp: dict[str, Any]) -> tuple[int, ...]:
    """The tokens that end a request (and that ``min_tokens`` masks)."""
    return (EOS, *sp.get("stop_token_ids", ()))


def exact_sequences(target, sp: dict[str, Any]) -> dict[tuple[int, ...], float]:
    """Probability of every outcome: M tokens, positions after a stop token set to ENDED."""
    out: dict[tuple[int, ...], float] = {}
    stack: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    stops = stop_ids(sp)
    while stack:
        g, w = stack.pop()
        if len(g) == M or (g and g[-1] in stops):
            out[g + (ENDED,) * (M - len(g))] = w
            continue
        p = ref_probs(raw_logits(target, g), PROMPT, g, sp, stop_ids=stops)
        for t in np.flatnonzero(p):
            stack.append((g + (int(t),), w * float(p[t])))
    return out


def statistics(seq: tuple[int, ...]) -> dict[str, int]:
    """The observed categories of one outcome."""
    stats = {f"token {j + 1}": seq[j] for j in range(M)}
    stats["distinct tokens"] = len({t for t in seq if t != ENDED})
    return stats


def chi_square(counts: Counter, probs: dict[int, float], n: int) -> tuple[float, int, float]:
    """Goodness of fit with cells of expected count < 5 pooled; a category of probability 0
    must never be observed. Returns (statistic, degrees of freedom, p-value)."""
    impossible = [c for c in counts if probs.get(c, 0.0) == 0.0]
    if impossible:
        print(f"\n[chi2] observed categories of probability 0: {impossible}")
        return float("inf"), 0, 0.0
    obs, exp, pooled_o, pooled_e = [], [], 0.0, 0.0
    for c, p in probs.items():
        if p * n < 5:
            pooled_o, pooled_e = pooled_o + counts.get(c, 0), pooled_e + p * n
        else:
            obs.append(counts.get(c, 0))
            exp.append(p * n)
    if pooled_e > 0:
        obs.append(pooled_o)
        exp.append(pooled_e)
    o, e = np.array(obs, float), np.array(exp, float)
    stat = float(((o - e) ** 2 / e).sum())
    df = max(len(o) - 1, 1)
    return stat, df, chi2_sf(stat, df)


def fit(label: str, outcomes: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]
        ) -> float:
    """The p-value of the family of statistics of ``outcomes`` against ``exact``: the smallest
    one times their number (Bonferroni), so ``ALPHA`` bounds a test's false-alarm rate (the
    adaptive runs depend on measured times, so their draws differ from run to run)."""
    expected: dict[str, dict[int, float]] = {}
    for seq, p in exact.items():
        for name, c in statistics(seq).items():
            expected.setdefault(name, {}).setdefault(c, 0.0)
            expected[name][c] += p
    observed: dict[str, Counter] = {name: Counter() for name in expected}
    for seq in outcomes:
        for name, c in statistics(seq).items():
            observed[name][c] += 1
    worst = 1.0
    for name in expected:
        stat, df, pval = chi_square(observed[name], expected[name], len(outcomes))
        print(f"\n[chi2] {label}, {name}: n={len(outcomes)} df={df} stat={stat:.2f} "
              f"p={pval:.3g}")
        worst = min(worst, pval)
    return min(1.0, worst * len(expected))


def sample_engine(target, drafter, setup: dict[str, Any], sp: dict[str, Any], n: int = N,
                  seeded: bool = False, engine_seed: int = 0
                  ) -> tuple[list[tuple[int, ...]], dict[int, int]]:
    """``n`` requests of PROMPT; outcomes padded with ENDED after EOS, and the steps
    histogram summed over the requests."""
    params = [{**sp, "max_new_tokens": M, **({"seed": 1234 + i} if seeded else {})}
              for i in range(n)]
    with Engine.from_modules(target, drafter, max_running_requests=n, kv_cache_tokens=n * 8,
                             page_size=8, seed=engine_seed, log_interval_s=None,
                             **setup) as eng:
        out = eng.generate(input_ids=[PROMPT] * n, sampling_params=params)
    outcomes, hist = [], Counter()
    for o in out:
        ids = o["output_ids"]
        assert len(ids) == M or (ids and ids[-1] in stop_ids(sp) and len(ids) < M), ids
        outcomes.append(tuple(ids) + (ENDED,) * (M - len(ids)))
        hist.update(o["meta_info"]["spec_steps_histogram"])
    return outcomes, dict(hist)


# ---------------------------------------------------------------------------------------------
# 1. lossless per processor and setup

@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("name", list(PROCESSORS))
def test_processor_keeps_the_target_distribution(models, name, setup):
    target, drafter, _ = models
    sp = PROCESSORS[name]
    exact = exact_sequences(target, sp)
    outcomes, hist = sample_engine(target, drafter, SETUPS[setup], sp)
    assert any(k > 0 for k in hist), f"no speculation happened: {hist}"
    if setup == "schedule":
        assert len(hist) >= 3, hist
    if name == "min_tokens":
        assert all(not set(seq[:3]) & {EOS, 3} for seq in outcomes)
        for t in (EOS, 3):
            assert any(seq[3] == t for seq in outcomes), "stop tokens must follow min_tokens"
    pval = fit(f"{name}, {setup}", outcomes, exact)
    assert pval > ALPHA, f"{name}, {setup}: p = {pval:.3g}"


def test_seeded_rows_and_an_eagle_drafter_keep_the_target_distribution(models):
    """The combination with one seed per request (coupled draws), with a random draft model
    (few accepts: mostly residual draws) and with an EAGLE head."""
    target, drafter, random_drafter = models
    sp = PROCESSORS["combination"]
    exact = exact_sequences(target, sp)
    outcomes, hist = sample_engine(target, drafter, SETUPS["steps 3"], sp, seeded=True)
    assert fit("combination, seeded, steps 3", outcomes, exact) > ALPHA
    outcomes, hist = sample_engine(target, random_drafter, SETUPS["steps 3"], sp)
    assert fit("combination, random draft model, steps 3", outcomes, exact) > ALPHA
    outcomes, hist = sample_engine(target, tiny_eagle(target), SETUPS["steps 3"], sp)
    assert fit("combination, EAGLE, steps 3", outcomes, exact) > ALPHA


# ---------------------------------------------------------------------------------------------
# 2. the test detects a wrong rule

def verify_without_drafts(self: StepProcessing, logits: torch.Tensor,
                          input_ids: torch.Tensor) -> torch.Tensor:
    """WRONG: every verify column counts the committed history only (``[0, L]``), not the
    drafts before it."""
    counts = None if self.base is None else column_counts(self.base, input_ids[:, :1])
    return apply_processors(logits, self.proc, self.positions, counts, self.prompt_seen)


def verify_min_tokens_at_first_column(self: StepProcessing, logits: torch.Tensor,
                                      input_ids: torch.Tensor) -> torch.Tensor:
    """WRONG: every verify column is masked as the first one is (the output length at the
    start of the verify, not at each position)."""
    return torch.cat([apply_processors(logits[:, i:i + 1], self.proc, self.positions)
                      for i in range(logits.shape[1])], 1)


def verify_without_bias(self: StepProcessing, logits: torch.Tensor,
                        input_ids: torch.Tensor) -> torch.Tensor:
    """WRONG: the target's verify ignores ``logit_bias`` (only the drafter's proposals are
    biased)."""
    proc = dataclasses.replace(self.proc, any_bias=False)
    return apply_processors(logits, proc, self.positions)


def verify_bias_first_column_only(self: StepProcessing, logits: torch.Tensor,
                                   input_ids: torch.Tensor) -> torch.Tensor:
    """WRONG: the bias reaches the verify's first column only (the bonus-token position of a
    plain decode), not the columns that judge the drafts.

    (A drafter whose proposals miss the bias is not a wrong rule for the distribution:
    rejection sampling corrects any proposal distribution, so only acceptance would suffer;
    the drafter's steps are checked by ``test_logit_bias_reaches_every_draft_step``.)"""
    unbiased = dataclasses.replace(self.proc, any_bias=False)
    first = apply_processors(logits[:, :1], self.proc, self.positions)
    rest = apply_processors(logits[:, 1:], unbiased, self.positions + 1)
    return torch.cat([first, rest], 1)


@pytest.mark.parametrize("name, method, wrong", [
    ("presence", "verify", verify_without_drafts), ("repetition", "verify", verify_without_drafts),
    ("combination", "verify", verify_without_drafts),
    ("min_tokens", "verify", verify_min_tokens_at_first_column),
    ("logit_bias", "verify", verify_without_bias),
    ("logit_bias", "verify", verify_bias_first_column_only)])
def test_a_wrong_rule_fails_the_same_test(models, monkeypatch, name, method, wrong):
    target, drafter, _ = models
    sp = PROCESSORS[name]
    exact = exact_sequences(target, sp)
    monkeypatch.setattr(StepProcessing, method, wrong)
    outcomes, _ = sample_engine(target, drafter, SETUPS["steps 3"], sp)
    pval = fit(f"WRONG rule {wrong.__name__}, {name}, steps 3", outcomes, exact)
    assert pval < ALPHA, f"the wrong rule passed: p = {pval:.3g}"


def test_logit_bias_reaches_every_draft_step(models, monkeypatch):
    """The drafter proposes from biased logits at every step: a -100 bias on every token but
    one leaves that token the only proposal (so acceptance stays high where the target, biased
    the same way, wants it too)."""
    target, drafter, _ = models
    seen: list[torch.Tensor] = []
    original = StepProcessing.draft_step

    def spy(self, logits, i, input_ids):
        out = original(self, logits, i, input_ids)
        seen.append(out.argmax(-1))
        return out

    monkeypatch.setattr(StepProcessing, "draft_step", spy)
    bias = {str(t): -100.0 for t in range(V) if t != 6}
    outcomes, hist = sample_engine(target, drafter, SETUPS["steps 3"],
                                   dict(temperature=1.0, logit_bias=bias), n=8)
    assert seen and all(bool((a == 6).all()) for a in seen)
    assert all(set(o) == {6} for o in outcomes), outcomes


# ---------------------------------------------------------------------------------------------
# 3. greedy with penalties = target-only greedy

GREEDY = [dict(repetition_penalty=1.5), dict(presence_penalty=1.0, frequency_penalty=0.5),
          dict(repetition_penalty=0.7, frequency_penalty=-0.8),  # encourages repeats
          dict(repetition_penalty=1.2, presence_penalty=-0.5, min_tokens=6)]
GREEDY_SETUPS = {
    "fixed 3": dict(speculative_adaptive=False, speculative_num_steps=3),
    "schedule 0..7": dict(steps_schedule=[0, 7, 1, 3, 5, 2, 6, 4, 0, 0, 7]),
    "adaptive": dict(speculative_adaptive=True),
    "graph runners": dict(speculative_adaptive=False, speculative_num_steps=4,
                          cuda_graph_mode="emulate"),
}
KW = dict(max_running_requests=8, kv_cache_tokens=4096, page_size=8, log_interval_s=None)


def _reference_greedy(hf, prompt: list[int], sp: dict[str, Any]) -> list[int]:
    """The float64 reference loop over transformers' logits, one token at a time."""
    out: list[int] = []
    stop = sp.get("stop_token_ids", [])
    for _ in range(sp["max_new_tokens"]):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].double().tolist()
        t = int(np.argmax(ref_logits(logits, prompt, out, sp, stop)))
        out.append(t)
        if t in stop:
            break
    return out


def test_greedy_with_penalties_equals_target_only_greedy(request, tiny):
    prompts = [PROMPTS[i % 3] for i in range(3 * len(GREEDY))]
    stop = 7  # a stop token id for the min_tokens case
    params = [{**g, "max_new_tokens": 30, "temperature": 0.0,
               **({"stop_token_ids": [stop]} if "min_tokens" in g else {})}
              for g in GREEDY for _ in range(3)]
    with Engine.from_modules(tiny.target, seed=0, **KW) as engine:
        reference = [o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                              sampling_params=params)]
    # target-only greedy = the reference loop (and transformers' own repetition_penalty)
    for prompt, sp, ids in zip(prompts, params, reference):
        assert ids == _reference_greedy(tiny.hf, prompt, sp), sp
    with torch.no_grad():
        hf_rep = tiny.hf.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=30,
                                  do_sample=False, repetition_penalty=1.5)
    hf_rep = hf_rep[0, len(PROMPTS[1]):].tolist()
    assert reference[1] == hf_rep
    plain = Engine.from_modules(tiny.target, seed=0, **KW)
    with plain:
        unpenalized = plain.generate(input_ids=prompts[:3], sampling_params={
            "max_new_tokens": 30, "temperature": 0.0})
    assert [o["output_ids"] for o in unpenalized] != reference[:3], "penalties change output"
    for drafter_name in ("draft_same", "draft_noisy", "eagle_random"):
        drafter = getattr(tiny, drafter_name)
        for name, setup in GREEDY_SETUPS.items():
            with Engine.from_modules(tiny.target, drafter, seed=1, **setup, **KW) as engine:
                out = engine.generate(input_ids=prompts, sampling_params=params)
                graph = engine.graph_stats()
            got = [o["output_ids"] for o in out]
            assert got == reference, f"{drafter_name}, {name}"
            if drafter_name == "draft_same" and name == "fixed 3":
                assert all(o["meta_info"]["spec_accept_length"] > 2.5 for o in out)
            if name == "graph runners":
                assert graph["eager"].get("draft:processors", 0) > 0, graph


def test_greedy_wrong_rule_breaks_equality(tiny, monkeypatch):
    """With every draft accepted, a verify that forgets the drafts' counts emits other tokens."""
    prompts = [PROMPTS[i % 3] for i in range(3)]
    params = {"max_new_tokens": 30, "temperature": 0.0, "repetition_penalty": 0.7,
              "frequency_penalty": -0.8}
    with Engine.from_modules(tiny.target, seed=0, **KW) as engine:
        reference = [o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                              sampling_params=params)]
    monkeypatch.setattr(StepProcessing, "verify", verify_without_drafts)
    with Engine.from_modules(tiny.target, tiny.draft_same, speculative_adaptive=False,
                             speculative_num_steps=3, **KW) as engine:
        wrong = [o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                          sampling_params=params)]
    assert wrong != reference


# ---------------------------------------------------------------------------------------------
# 4. seeded requests keep their guarantee with every processor

SEEDED = {
    "penalties": dict(repetition_penalty=1.3, presence_penalty=0.6, frequency_penalty=0.4),
    "filters": dict(top_k=40, min_p=0.02, top_p=0.9),
    "min_tokens": dict(min_tokens=25, stop_token_ids=[11, 12, 13, 14, 15]),
    "all": dict(repetition_penalty=1.2, presence_penalty=-0.3, frequency_penalty=0.5,
                top_k=50, min_p=0.01, top_p=0.95, min_tokens=20, stop_token_ids=[40, 41]),
}
SEEDED_SETUPS = {
    "fixed 3": dict(speculative_adaptive=False, speculative_num_steps=3),
    "schedule 0..7": dict(steps_schedule=[0, 7, 1, 3, 5, 2, 6, 4, 0, 0, 7]),
    "adaptive, graph runners": dict(speculative_adaptive=True, cuda_graph_mode="emulate"),
}


@pytest.mark.parametrize("name", list(SEEDED))
def test_seeded_request_with_processors_is_plain_decoding(tiny, name):
    me = {"temperature": 1.0, "seed": 7, "max_new_tokens": 40, **SEEDED[name]}
    others = [{"temperature": 1.0, "seed": 100 + i, "max_new_tokens": 10 + i % 25,
               "repetition_penalty": 1.1} if i % 3 == 0
              else {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 30,
                    "presence_penalty": 1.0} if i % 3 == 1
              else greedy(20) for i in range(15)]
    prompts = [PROMPTS[i % 3] for i in range(15)]
    kw = dict(max_running_requests=16, kv_cache_tokens=4096, page_size=8, log_interval_s=None)
    with Engine.from_modules(tiny.target, seed=0, **kw) as engine:
        reference = engine.generate(input_ids=[PROMPTS[1]], sampling_params=[me])[0]
    ref = reference["output_ids"]
    assert len(ref) >= me.get("min_tokens", 1)
    for drafter in (tiny.draft_noisy, tiny.eagle_random):
        for setup_name, setup in SEEDED_SETUPS.items():
            with Engine.from_modules(tiny.target, drafter, seed=3, **setup, **kw) as engine:
                alone = engine.generate(input_ids=[PROMPTS[1]], sampling_params=[me])[0]
                batch = engine.generate(input_ids=prompts[:8] + [PROMPTS[1]] + prompts[8:],
                                        sampling_params=others[:8] + [me] + others[8:])
            assert alone["output_ids"] == ref, (name, setup_name, "alone")
            assert batch[8]["output_ids"] == ref, (name, setup_name, "in a batch")


def test_preemption_rebuilds_the_token_counts(tiny):
    """12 pages of 8 tokens for 6 requests of 40 tokens, prompts prefilled in chunks of at most
    7 tokens: preempted requests re-prefill on fresh worker rows, whose counts are rebuilt
    from 0 (prompt and the output so far). Greedy and seeded outputs with penalties and
    min_tokens equal those of an engine with room for everything."""
    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6], [150, 151, 152], list(range(20, 40))]
    controls = {"max_new_tokens": 40, "repetition_penalty": 1.3, "frequency_penalty": 0.4,
                "presence_penalty": -0.2, "min_tokens": 30, "stop_token_ids": [5, 6, 7]}
    params = [{**controls, "temperature": 0.0} if i % 2 else
              {**controls, "temperature": 1.0, "seed": 40 + i} for i in range(len(prompts))]
    with Engine.from_modules(tiny.target, tiny.draft_noisy, speculative_adaptive=False,
                             speculative_num_steps=3, **KW) as engine:
        roomy = [o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                          sampling_params=params)]
    with Engine.from_modules(tiny.target, tiny.draft_noisy, max_running_requests=6,
                             kv_cache_tokens=96, page_size=8, max_prefill_tokens=7,
                             speculative_adaptive=False, speculative_num_steps=3,
                             log_interval_s=None) as engine:
        tight = [o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                          sampling_params=params)]
        assert engine.stats().preemptions > 0
    assert tight == roomy


# ---------------------------------------------------------------------------------------------
# 5. text: stop token text, include_stop_str_in_output, skip_special_tokens, min_tokens

class CharTokenizer:
    """Token i < 26 is a letter, others '<i>' (special: left out unless asked)."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) if i < 26 else ("" if skip_special_tokens else f"<{i}>")
                       for i in ids)


def test_stop_token_text_and_special_tokens(tiny):
    with Engine.from_modules(tiny.target, tokenizer=CharTokenizer(), seed=0, **KW) as engine:
        def run(**sp: Any) -> dict[str, Any]:
            return engine.generate(input_ids=PROMPTS[0], sampling_params={
                "max_new_tokens": 30, "temperature": 0.0, **sp})

        free = run()["output_ids"]
        stop_at = next(i for i, t in enumerate(free) if i >= 3 and t < 26)
        stop = free[stop_at]
        first = free.index(stop)
        out = run(stop_token_ids=[stop])
        assert out["output_ids"] == free[:first + 1]
        assert out["text"] == CharTokenizer().decode(free[:first])  # the stop token's text: out
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        kept = run(stop_token_ids=[stop], include_stop_str_in_output=True)
        assert kept["text"] == CharTokenizer().decode(free[:first + 1])
        raw = run(skip_special_tokens=False)
        assert raw["text"] == CharTokenizer().decode(free, skip_special_tokens=False)
        # min_tokens: the stop token cannot come first (masked), stop strings cannot match in
        # the first min_tokens tokens' text
        later = run(stop_token_ids=[stop], min_tokens=first + 1)
        assert stop not in later["output_ids"][:first + 1]
        letters = CharTokenizer().decode(free)
        if letters:
            s = letters[0]
            assert run(stop=[s])["text"] == ""
            waited = run(stop=[s], min_tokens=len(free) - 1, max_new_tokens=len(free))
            assert waited["meta_info"]["finish_reason"]["type"] in ("stop", "length")
            assert len(waited["output_ids"]) >= len(free) - 1
