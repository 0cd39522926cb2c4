"""Issue 31, the grammar backend and the masks (no engine):

- the built-in tokenizer maps onto xgrammar's vocabulary: at several grammar states every
  allowed token decodes to text the grammar allows there, and every token whose text is
  allowed is in the mask (so ids and strings agree, special tokens included);
- the vectorised bitmask unpacking equals xgrammar's own mask application;
- compile errors name the field; the compile cache compiles a grammar once;
- lossless under speculation: a chi-square on a tiny vocabulary, where the grammar allows a
  subset, shows the first emitted token of a masked draft + masked verify distributed as the
  constrained target; the same test catches a wrong mask (verify left unmasked).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

import specdial
from specdial.worker.batch_sampling import BatchSampling
from specdial.worker.grammar import GrammarBackend, GrammarError, new_matcher
from specdial.worker.grammar_masks import BatchGrammar, unpack_bitmask
from specdial.worker.grammar_spec import StructuredSpec
from specdial.worker.sampling import SamplingParams, sample_from_probs, speculative_accept
from specdial.worker.sampling import target_probs
from test_sampling import chi2_sf

TARGET = Path(specdial.__file__).parent / "builtin" / "target"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def backend(tok):
    return GrammarBackend(tok, 4096, [tok.eos_token_id])


def allowed_ids(matcher, vocab):
    bm = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bm, 0)
    return set(np.flatnonzero(unpack_bitmask(bm, vocab)[0].numpy()).tolist())


@pytest.mark.parametrize("pattern, prefix", [(r"[0-9]{2,6}", ""), (r"[0-9]{2,6}", "12"),
                                             (r"(yes|no)!", ""), (r"(yes|no)!", "ye")])
def test_allowed_tokens_decode_to_allowed_text(tok, backend, pattern, prefix):
    m = new_matcher(backend.compile(StructuredSpec("regex", pattern)))
    for t in tok.encode(prefix, add_special_tokens=False):
        assert m.accept_token(t)
    allowed = allowed_ids(m, 4096)
    assert allowed
    full = re.compile(pattern)
    eos = tok.eos_token_id
    for t in range(4096):
        text = tok.decode([t])
        if t == eos:  # allowed exactly when the prefix already matches the whole pattern
            assert (t in allowed) == bool(full.fullmatch(prefix))
            continue
        # a token is allowed iff prefix + its text is a prefix of some match
        ok = any(full.fullmatch(prefix + text + tail) for tail in _tails(pattern))
        assert (t in allowed) == ok, (t, text)


def _tails(pattern):
    """Completions long enough for the patterns above."""
    return ["", "0", "00", "000", "0000", "!", "s!", "es!", "o!"] if "yes" in pattern else [
        "", "0", "00", "000", "0000", "00000"]


def test_unpack_equals_xgrammar_apply(backend):
    m = new_matcher(backend.compile(StructuredSpec("json_object")))
    bm = xgr.allocate_token_bitmask(2, 4096)
    m.fill_next_token_bitmask(bm, 1)
    logits = torch.randn(2, 4096)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bm)
    ours = logits.masked_fill(~unpack_bitmask(bm, 4096), -math.inf)
    assert torch.equal(ours, ref)
    assert unpack_bitmask(bm, 4096)[0].all()


@pytest.mark.parametrize("spec, field", [
    (StructuredSpec("regex", "(ab", field="regex"), "regex"),
    (StructuredSpec("ebnf", "root ::= undefined_rule", field="ebnf"), "ebnf"),
    (StructuredSpec("json_schema", '{"type": "no-such-type"}', field="guided_json"),
     "guided_json")])
def test_compile_errors_name_the_field(backend, spec, field):
    with pytest.raises(GrammarError) as e:
        backend.submit(spec).result()
    assert e.value.field == field and str(e.value).startswith(field + ":")
    assert ".cc:" not in str(e.value)  # xgrammar's log prefix is cut


def test_spec_validation_names_the_field():
    with pytest.raises(ValueError, match="^json_schema: not valid JSON"):
        StructuredSpec("json_schema", "{", field="json_schema")
    with pytest.raises(ValueError, match="choices must be a non-empty list"):
        StructuredSpec("choice", "[]", field="guided_choice")
    with pytest.raises(ValueError, match="SamplingParams.regex: given together with 'ebnf'"):
        SamplingParams.from_dict({"regex": "a", "ebnf": "root ::= \"a\""})
    with pytest.raises(ValueError, match="SamplingParams.json_schema: not valid JSON"):
        SamplingParams.from_dict({"json_schema": "{"})


def test_compile_cache_compiles_once(tok):
    b = GrammarBackend(tok, 4096, [0], cache_size=2)
    specs = [StructuredSpec("regex", f"a{{{i}}}") for i in range(1, 4)]
    first = b.submit(specs[0])
    assert b.submit(StructuredSpec("regex", "a{1}")) is first and b.compiles == 1
    b.submit(specs[1]).result()
    b.submit(specs[2]).result()  # evicts specs[0] (cache_size 2)
    b.submit(specs[0]).result()
    assert b.compiles == 4
    bad = StructuredSpec("regex", "(")
    with pytest.raises(GrammarError):
        b.submit(bad).result()
    with pytest.raises(GrammarError):
        b.submit(bad).result()  # a failure is not cached: compiled again
    assert b.compiles == 6


class SubsetMatcher:
    """A matcher double over a tiny vocabulary: every position allows ``allowed`` only."""

    def __init__(self, allowed, vocab):
        self.allowed, self.vocab, self.n = set(allowed), vocab, 0

    def fill_next_token_bitmask(self, bm, row):
        words = torch.zeros(bm.shape[1], dtype=torch.int64)
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        bm[row] = words.to(torch.int32)

    def accept_token(self, t):
        if t in self.allowed:
            self.n += 1
            return True
        return False

    def is_terminated(self):
        return False

    def rollback(self, n):
        assert 0 <= n <= self.n
        self.n -= n


def _first_emitted(mask_verify: bool, n_rows=40000, seed=0):
    """Emitted token counts per position (0, 1, and the bonus 2) of one speculative step
    (k = 2) under a subset grammar, and the masked target distribution."""
    v, allowed = 8, [1, 3, 4, 6]
    g = torch.Generator().manual_seed(seed)
    p_logits = torch.tensor([0.5, 1.0, -0.3, 0.2, 0.9, 1.4, -1.0, 0.1])
    q_logits = torch.tensor([1.5, -0.2, 0.4, 1.0, -0.5, 0.3, 0.8, 0.0])
    matchers = [SubsetMatcher(allowed, v) for _ in range(n_rows)]
    grammar = BatchGrammar(matchers, v, torch.device("cpu"))
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0)] * n_rows)
    step = grammar.step(None)
    drafts, probs, prev = [], [], torch.zeros(n_rows, dtype=torch.int64)
    for i in range(2):
        logits = step.draft_step(q_logits.expand(n_rows, v).clone(), i, prev)
        q = target_probs(logits[:, None], sampling)[:, 0]
        prev = sample_from_probs(q, g)
        drafts.append(prev)
        probs.append(q)
    tokens = torch.stack(drafts, 1)
    verify_ids = torch.cat([torch.zeros(n_rows, 1, dtype=torch.int64), tokens], 1)
    raw = p_logits.expand(n_rows, 3, v).clone()
    target = step.verify(raw, verify_ids) if mask_verify else raw
    accepted, out = speculative_accept(tokens, torch.stack(probs, 1), target, sampling, g)
    expected = torch.softmax(p_logits.masked_fill(
        ~torch.isin(torch.arange(v), torch.tensor(allowed)), -math.inf), 0).numpy()
    # the target is the same at every position here, so each emitted position is distributed
    # as the masked p: the first token (accept or residual), the second among rows that
    # accepted d_1, and the bonus token among rows that accepted both drafts
    counts = [np.bincount(out[accepted >= j, j].numpy(), minlength=v) for j in range(3)]
    return counts, expected


def _chi2_p(counts, expected):
    """p-value of ``counts`` under ``expected``; 0 when a token outside the support came."""
    keep = expected > 0
    if counts[~keep].any():
        return 0.0
    exp = expected[keep] / expected[keep].sum() * counts.sum()
    stat = float(((counts[keep] - exp) ** 2 / exp).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)


def test_constrained_distribution_is_exact_under_speculation():
    counts, expected = _first_emitted(mask_verify=True)
    assert all(c.sum() > 2000 for c in counts)  # every position, the bonus one included
    assert min(_chi2_p(c, expected) for c in counts) > 1e-3 / 3


def test_chi_square_detects_an_unmasked_verify():
    counts, expected = _first_emitted(mask_verify=False)
    assert _chi2_p(counts[0], expected) < 1e-6


def test_draft_without_an_allowed_token_proposes_among_the_allowed():
    """An EAGLE-3 draft vocabulary may miss every allowed token (-inf logits there): the
    masked drafter then proposes uniformly among the allowed tokens, never a NaN ``q``."""
    v, allowed = 8, [2, 5]
    grammar = BatchGrammar([SubsetMatcher(allowed, v), None], v, torch.device("cpu"))
    step = grammar.step(None)
    logits = torch.tensor([[0.0, 1.0, -math.inf, 0.5, 0.1, -math.inf, 0.2, 0.3]] * 2)
    out = step.draft_step(logits, 0, torch.zeros(2, dtype=torch.int64))
    q = torch.softmax(out, -1)
    assert not q.isnan().any()
    assert torch.allclose(q[0], torch.tensor([0, 0, .5, 0, 0, .5, 0, 0]))
    assert torch.equal(out[1], logits[1])  # the unconstrained row is untouched


def test_min_tokens_with_a_constraint_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"SamplingParams.min_tokens: .*\(regex\)"):
        SamplingParams.from_dict({"regex": "a+", "min_tokens": 2})
