"""Penalties, min_tokens and min_p (issue 14), unit level.

1. SamplingParams: the new fields' ranges (errors name the field and the allowed values), the
   SGLang aliases of ``from_dict``.
2. The processing functions against the float64 reference of tests/processor_reference.py,
   one request and one token at a time: ``apply_processors`` per rule and combined, with
   neutral rows left bit for bit unchanged; ``target_probs`` with min-p (vLLM's order).
3. Per-position history: column ``i`` of :meth:`StepProcessing.verify` equals plain decoding's
   processing of the history extended by the drafts ``d_1..d_i``, and draft step ``i`` sees the
   same history as verify column ``i``.
4. :class:`TokenCounts`: incremental catch-ups over a token table equal a bincount of the
   whole history; a reset row starts again from 0.
5. Stop strings with ``min_tokens``, ``include_stop`` and ``skip_special_tokens``
   (:class:`IncrementalText`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from processor_reference import ref_logits, ref_probs
from specdial.detokenize import IncrementalText
from specdial.worker.processors import (BatchProcessors, StepProcessing, TokenCounts,
                                        apply_processors, column_counts)
from specdial.worker.sampling import BatchSampling, SamplingParams, target_probs

V = 12


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# 1. SamplingParams

BAD = [
    ("min_p", [-0.1, 1.01, float("nan"), True, "0.1"]),
    ("repetition_penalty", [0, 0.0, -1.0, 1e-5, 1e5, float("inf"), float("nan"), True, "1"]),
    ("presence_penalty", [-2.01, 2.5, float("nan"), float("inf"), False, "0"]),
    ("frequency_penalty", [-3, 2.0001, float("-inf"), True]),
    ("min_tokens", [-1, 1.0, True, "2", 129]),  # > max_new_tokens (128)
    ("include_stop_str_in_output", [1, "true", None]),
    ("skip_special_tokens", [0, "false", None]),
]


@pytest.mark.parametrize("field,value", [(f, v) for f, vs in BAD for v in vs],
                         ids=lambda x: repr(x))
def test_bad_values_name_the_field_and_range(field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict({field: value})
    msg = str(err.value)
    assert f"SamplingParams.{field}" in msg and "allowed" in msg and repr(value) in msg


def test_new_fields_defaults_ranges_and_aliases():
    d = SamplingParams()
    assert (d.min_p, d.repetition_penalty, d.presence_penalty, d.frequency_penalty,
            d.min_tokens, d.include_stop_str_in_output, d.skip_special_tokens) == (
        0.0, 1.0, 0.0, 0.0, 0, False, True)
    assert not d.has_penalty
    p = SamplingParams.from_dict({"min_p": 1, "repetition_penalty": 1e4, "presence_penalty": -2,
                                  "frequency_penalty": 2, "max_new_tokens": 5, "min_tokens": 5})
    assert isinstance(p.min_p, float) and p.has_penalty and p.min_tokens == 5
    assert SamplingParams(repetition_penalty=1e-4).has_penalty
    a = SamplingParams.from_dict({"min_new_tokens": 3, "no_stop_trim": True})
    assert a.min_tokens == 3 and a.include_stop_str_in_output
    with pytest.raises(ValueError, match="min_tokens.*given twice"):
        SamplingParams.from_dict({"min_new_tokens": 3, "min_tokens": 3})
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict({"repetiton_penalty": 1.1})
    assert "repetition_penalty" in str(err.value) and "min_new_tokens" in str(err.value)


# ---------------------------------------------------------------------------------------------
# 2. processing against the reference

PARAMS = [
    dict(temperature=1.0, repetition_penalty=1.7),
    dict(temperature=1.0, repetition_penalty=0.6),
    dict(temperature=0.0, presence_penalty=1.5),
    dict(temperature=0.7, frequency_penalty=-1.2),
    dict(temperature=1.0, frequency_penalty=0.9, presence_penalty=-0.4, repetition_penalty=1.3),
    dict(temperature=1.0, min_tokens=3, max_new_tokens=8),
    dict(temperature=1.0),  # neutral: unchanged bit for bit
    dict(temperature=0.5, min_tokens=2, max_new_tokens=4, repetition_penalty=2.0,
         presence_penalty=2.0, frequency_penalty=2.0),
]
STOP_IDS = (3, 7)


def _history(b: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    g = np.random.default_rng(seed)
    prompts = [g.integers(0, V, g.integers(1, 5)).tolist() for _ in range(b)]
    outs = [g.integers(0, V, g.integers(0, 5)).tolist() for _ in range(b)]
    return prompts, outs


def _proc(params, prompts):
    return BatchProcessors.build(params, [len(p) for p in prompts], [STOP_IDS] * len(params),
                                 "cpu")


def _counts(prompts, outs):
    counts = torch.zeros(len(prompts), V, dtype=torch.int32)
    seen = torch.zeros(len(prompts), V, dtype=torch.bool)
    for b, (p, o) in enumerate(zip(prompts, outs)):
        seen[b, p] = True
        for t in o:
            counts[b, t] += 1
    return counts, seen


def test_apply_processors_matches_the_reference_row_by_row():
    params = [SamplingParams(**kw) for kw in PARAMS]
    prompts, outs = _history(len(params), 0)
    logits = torch.randn(len(params), 1, V, generator=gen(1)) * 3
    logits[0, 0, 0] = 0.0  # a zero logit: multiplied (x <= 0), stays 0
    proc = _proc(params, prompts)
    counts, seen = _counts(prompts, outs)
    positions = torch.tensor([len(p) + len(o) for p, o in zip(prompts, outs)])
    got = apply_processors(logits, proc, positions, counts[:, None].float(), seen)
    for b, kw in enumerate(PARAMS):
        exp = ref_logits(logits[b, 0].tolist(), prompts[b], outs[b], kw, STOP_IDS)
        np.testing.assert_allclose(got[b, 0].double().numpy(), exp, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[6], logits[6]), "a row without processors is unchanged"
    # min_tokens: masked iff fewer than min_tokens generated tokens precede the position
    row = 5
    assert (got[row, 0, list(STOP_IDS)] == -math.inf).all() == (len(outs[row]) < 3)


def test_processed_distribution_matches_the_reference():
    """target_probs over processed logits (with top-k, min-p, top-p on top) = reference."""
    kws = [dict(temperature=0.9, top_k=6, min_p=0.05, repetition_penalty=1.4,
                presence_penalty=0.5, frequency_penalty=0.3, min_tokens=4, max_new_tokens=9),
           dict(temperature=1.3, top_p=0.8, min_p=0.1, frequency_penalty=1.0),
           dict(temperature=0.0, repetition_penalty=3.0, min_tokens=2, max_new_tokens=3),
           dict(temperature=0.6, min_p=0.3)]
    params = [SamplingParams(**kw) for kw in kws]
    prompts, outs = _history(len(kws), 2)
    logits = torch.randn(len(kws), 1, V, generator=gen(3)) * 2
    sampling = BatchSampling.from_params(params, prompt_lens=[len(p) for p in prompts],
                                         min_tokens_ids=[STOP_IDS] * len(kws))
    assert sampling.processors is not None and sampling.any_min_p
    counts, seen = _counts(prompts, outs)
    positions = torch.tensor([len(p) + len(o) for p, o in zip(prompts, outs)])
    x = apply_processors(logits, sampling.processors, positions, counts[:, None].float(), seen)
    got = target_probs(x, sampling)
    for b, kw in enumerate(kws):
        exp = ref_probs(logits[b, 0].tolist(), prompts[b], outs[b], kw, STOP_IDS)
        np.testing.assert_allclose(got[b, 0].double().numpy(), exp, atol=1e-6)


def test_min_p_keeps_the_most_likely_token_and_follows_vllms_order():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = p.log().view(1, 1, 4)

    def probs(**kw):
        return target_probs(logits, BatchSampling.from_params([SamplingParams(**kw)]))[0, 0]

    torch.testing.assert_close(probs(temperature=1.0, min_p=0.35), torch.tensor([0.625, 0.375,
                                                                                  0, 0]))
    torch.testing.assert_close(probs(temperature=1.0, min_p=1.0), torch.tensor([1.0, 0, 0, 0]))
    # min-p before top-p: min_p 0.2 keeps {0, 1, 2} -> renormalized [0.526, 0.316, 0.158];
    # top_p 0.84 then keeps {0, 1} (the mass before token 2 is 0.842); top-p first would keep
    # {0, 1, 2} (mass before token 2: 0.8) and min-p would keep them all
    torch.testing.assert_close(probs(temperature=1.0, min_p=0.2, top_p=0.84),
                               torch.tensor([0.625, 0.375, 0, 0]))
    assert probs(temperature=0.0, min_p=0.9).tolist() == [1.0, 0, 0, 0]


def test_column_counts_is_a_cumulative_history():
    base = torch.randint(0, 3, (3, V), generator=gen(4), dtype=torch.int32)
    tokens = torch.randint(0, V, (3, 5), generator=gen(5))
    got = column_counts(base, tokens)
    for b in range(3):
        for i in range(5):
            exp = base[b].clone().float()
            for t in tokens[b, :i + 1].tolist():
                exp[t] += 1
            assert torch.equal(got[b, i], exp)


# ---------------------------------------------------------------------------------------------
# 3. per-position history: verify column i = plain decoding at that position

def test_verify_columns_and_draft_steps_equal_plain_decoding_histories():
    params = [SamplingParams(**kw) for kw in PARAMS]
    b, k = len(params), 4
    prompts, outs = _history(b, 6)
    # plain decoding's history at the verify: prompt + outs; x_L = last emitted token (the
    # first verify input); drafts d_1..d_k
    inputs = torch.randint(0, V, (b, k + 1), generator=gen(7))
    logits = torch.randn(b, k + 1, V, generator=gen(8)) * 2
    proc = _proc(params, prompts)
    base, seen = _counts(prompts, outs)  # positions [0, L): prompt + outs
    first = torch.tensor([len(p) + len(o) + 1 for p, o in zip(prompts, outs)])  # L + 1
    step = StepProcessing(proc, first, base, seen)
    got = step.verify(logits, inputs)
    for row in range(b):
        for i in range(k + 1):
            generated = outs[row] + inputs[row, :i + 1].tolist()
            exp = ref_logits(logits[row, i].tolist(), prompts[row], generated, PARAMS[row],
                             STOP_IDS)
            np.testing.assert_allclose(got[row, i].double().numpy(), exp, rtol=1e-6,
                                       atol=1e-6, err_msg=f"row {row} column {i}")
    # the drafter's step i (input x_L, then d_i) sees verify column i's history
    drafting = StepProcessing(proc, first, base, seen)
    for i in range(k):
        d = drafting.draft_step(logits[:, i], i, inputs[:, i])
        assert torch.equal(d, got[:, i]), f"draft step {i}"
    # a prefill's first token: the history as it is (no input token added)
    prefill = StepProcessing(proc, first - 1, base, seen)
    one = prefill.first(logits[:, 0])
    for row in range(b):
        exp = ref_logits(logits[row, 0].tolist(), prompts[row], outs[row], PARAMS[row],
                         STOP_IDS)
        np.testing.assert_allclose(one[row].double().numpy(), exp, rtol=1e-6, atol=1e-6)


def test_min_tokens_unmasks_at_the_right_column():
    """min_tokens 4, a 5-token prompt, one token generated before x_L (x_L is output token 1):
    column i decides output token 2 + i, masked while 2 + i < 4."""
    sp = SamplingParams(temperature=1.0, min_tokens=4, max_new_tokens=8)
    proc = BatchProcessors.build([sp], [5], [(2,)], "cpu")
    assert proc is not None
    logits = torch.zeros(1, 4, V)
    # prompt 5 tokens, 1 generated at position 5, x_L at 6: L = 6, column 0 decides 7
    got = StepProcessing(proc, torch.tensor([7]), None, None).verify(logits, torch.zeros(
        1, 4, dtype=torch.int64))
    # output index decided by column i = 7 + i - 5 = 2 + i: masked while < 4
    assert got[0, :, 2].tolist() == [-math.inf, -math.inf, 0.0, 0.0]
    assert (got[0, :, [0, 1, 3]] == 0).all()


def test_batch_processors_build_and_select():
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.2),
              SamplingParams(min_tokens=2, max_new_tokens=4), SamplingParams()]
    assert BatchProcessors.build([SamplingParams()] * 3, None, None, "cpu") is None
    with pytest.raises(ValueError, match="prompt length"):
        BatchProcessors.build(params, None, None, "cpu")
    with pytest.raises(ValueError, match="masked token ids"):
        BatchProcessors.build(params, [1, 2, 3, 4], None, "cpu")
    proc = BatchProcessors.build(params, [1, 2, 3, 4], [(), (), (5, 5, 1), ()], "cpu")
    assert proc.penalized.tolist() == [False, True, False, False] and proc.any_min_tokens
    assert proc.stop_rows.tolist() == [2, 2] and proc.stop_ids.tolist() == [1, 5]
    sub = proc.select(torch.tensor([3, 2]))
    assert sub.stop_rows.tolist() == [1, 1] and not sub.any_penalty
    assert sub.prompt_lens.tolist() == [4, 3] and sub.prompt_lens_host.tolist() == [4, 3]
    assert proc.select(torch.tensor([0, 3])) is None
    bs = BatchSampling.from_params(params, prompt_lens=[1, 2, 3, 4],
                                   min_tokens_ids=[(), (), (5,), ()])
    assert bs.select(torch.tensor([1])).processors.penalized.tolist() == [True]


# ---------------------------------------------------------------------------------------------
# 4. TokenCounts

def test_token_counts_catch_up_equals_a_bincount_and_resets():
    rows, width = 4, 40
    g = np.random.default_rng(9)
    table = torch.from_numpy(g.integers(0, V, (rows, width)))
    prompt = np.array([3, 6, 1, 10])
    counts = TokenCounts(rows, V, torch.device("cpu"))
    which = np.array([0, 1, 3])
    for end in (5, 11, 12, 20):
        ends = np.full(3, end)
        counts.catch_up(which, ends, prompt[which], table)
        out, seen = counts.gather(torch.from_numpy(which))
        for j, r in enumerate(which):
            hist = table[r, :end].tolist()
            p = min(prompt[r], end)
            exp = torch.bincount(torch.tensor(hist[p:], dtype=torch.int64), minlength=V)
            assert torch.equal(out[j].long(), exp)
            assert seen[j].tolist() == [t in hist[:p] for t in range(V)]
    with pytest.raises(RuntimeError, match="valid up to"):
        counts.catch_up(np.array([0]), np.array([3]), prompt[:1], table)
    counts.reset([0])  # a new request on row 0: counted again from position 0
    table[0] = 2
    counts.catch_up(np.array([0]), np.array([8]), np.array([2]), table)
    out, seen = counts.gather(torch.tensor([0]))
    assert out[0].tolist() == [0, 0, 6] + [0] * (V - 3) and seen[0].nonzero().tolist() == [[2]]


# ---------------------------------------------------------------------------------------------
# 5. stop strings and special tokens in the text

class CharTokenizer:
    """Token i is chr(ord('a') + i); ids >= 20 are special tokens '<si>'."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(("" if skip_special_tokens else f"<s{i}>") if i >= 20
                       else chr(ord("a") + i) for i in ids)


def _run(text: IncrementalText, ids: list[int]) -> str:
    out = ""
    for n in range(1, len(ids) + 1):
        out += text.update(ids[:n], final=n == len(ids))
        if text.matched is not None:
            break
    return out


def test_stop_strings_with_min_tokens_include_and_special_tokens():
    tok = CharTokenizer()
    ids = [1, 2, 3, 1, 2, 3, 4]  # "bcdbcde"
    assert _run(IncrementalText(tok, ["cd"]), ids) == "b"
    assert _run(IncrementalText(tok, ["cd"], include_stop=True), ids) == "bcd"
    # min_tokens 3: the text of the first 3 tokens ("bcd") cannot hold a match's end
    t = IncrementalText(tok, ["cd"], min_tokens=3)
    assert _run(t, ids) == "bcdb" and t.matched == "cd"
    # a match may start inside the first min_tokens tokens' text if it ends after it
    t = IncrementalText(tok, ["db"], min_tokens=3)
    assert _run(t, ids) == "bc" and t.matched == "db"
    assert _run(IncrementalText(tok, ["zz"], min_tokens=3), ids) == "bcdbcde"
    special = [1, 21, 2]
    assert _run(IncrementalText(tok), special) == "bc"
    assert _run(IncrementalText(tok, skip_special_tokens=False), special) == "b<s21>c"
