"""Issue 31: the log-probabilities of a constrained request are those of the constrained
(grammar-masked) target distribution, as vLLM's ``raw_logprobs`` under structured outputs.

- :func:`token_logprobs` with ``allowed``: probabilities sum to 1 over the allowed tokens, a
  disallowed token gets the floor, no disallowed alternative is listed (id -1), and without
  ``allowed`` (or with every token allowed) the numbers are the raw ones;
- end to end (built-in models, speculation on): every alternative listed for a constrained
  request is a token its grammar allows at that position; where the grammar allows at most
  ``top_logprobs_num`` tokens the list is all of them and its probabilities sum to 1; the
  emitted token's logprob is its entry among them; an unconstrained request in the same
  batches gets exactly the numbers it gets alone.
"""

from __future__ import annotations

import math

import pytest
import torch

from specdial.engine import Engine
from specdial.worker.grammar import backend_for, new_matcher
from specdial.worker.grammar_spec import StructuredSpec
from specdial.worker.logprobs import (DISALLOWED_LOGPROB, NOT_ALLOWED_ID, LogprobRows,
                                      token_logprobs)

KW = dict(max_running_requests=8, kv_cache_tokens=4096, page_size=8, log_interval_s=None,
          speculative_num_steps=3)
REGEX = r"[ab]{2,6}(x|yz)"


def test_token_logprobs_under_a_mask_are_the_constrained_distribution():
    g = torch.Generator().manual_seed(0)
    b, n, v = 3, 4, 50
    logits = torch.randn(b, n, v, generator=g) * 3
    allowed = torch.rand(b, n, v, generator=g) < 0.1
    allowed[..., 7] = True  # at least one per position
    allowed[1] = True  # an unconstrained row in a constrained batch
    tokens = torch.randint(0, v, (b, n), generator=g)
    tokens[0] = 7
    spec = LogprobRows.build([v, v, v], "cpu")  # every alternative
    got = token_logprobs(logits, tokens, spec, allowed)
    want = torch.log_softmax(logits.masked_fill(~allowed, -math.inf), -1)
    probs = got.top_logprob.exp() * (got.top_ids != NOT_ALLOWED_ID)
    torch.testing.assert_close(probs.sum(-1), torch.ones(b, n))
    listed = got.top_ids != NOT_ALLOWED_ID
    assert torch.equal(listed.sum(-1), allowed.sum(-1))  # every allowed token, nothing else
    ids = got.top_ids.clamp_min(0)
    assert bool(allowed.gather(-1, ids)[listed].all())
    assert bool((got.top_logprob[~listed] == DISALLOWED_LOGPROB).all())
    torch.testing.assert_close(got.top_logprob[listed], want.gather(-1, ids)[listed])
    chosen = want.gather(-1, tokens[..., None])[..., 0]
    ok = allowed.gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(got.logprob[ok], chosen[ok])
    assert bool((got.logprob[~ok] == DISALLOWED_LOGPROB).all())
    # the unconstrained row, and the whole batch without a mask: the raw numbers
    raw = token_logprobs(logits, tokens, spec)
    torch.testing.assert_close(raw.logprob, torch.log_softmax(logits, -1).gather(
        -1, tokens[..., None])[..., 0])
    torch.testing.assert_close(got.logprob[1], raw.logprob[1])
    torch.testing.assert_close(got.top_logprob[1], raw.top_logprob[1])
    with pytest.raises(ValueError, match="allowed must be bool"):
        token_logprobs(logits, tokens, spec, allowed[:, :2])


@pytest.fixture(scope="module")
def engine():
    e = Engine(model_path=None, **KW)
    yield e
    e.shutdown()


def _allowed_after(engine, prefix):
    """The token ids the regex allows after ``prefix`` (a fresh matcher)."""
    b = backend_for(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    m = new_matcher(b.compile(StructuredSpec("regex", REGEX)))
    for t in prefix:
        assert m.accept_token(t)
    if m.is_terminated():
        return set(engine.eos_token_ids)
    mask = torch.zeros(1, (engine.vocab_size + 31) // 32, dtype=torch.int32)
    m.fill_next_token_bitmask(mask)
    bits = (mask[0, :, None] >> torch.arange(32)) & 1
    return set(torch.nonzero(bits.flatten()[:engine.vocab_size])[:, 0].tolist())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_constrained_request_reports_the_masked_distribution(engine, temperature):
    top = 20
    outs = engine.generate(["x", "ab", "Record:", "# "] * 2,
                           {"max_new_tokens": 12, "regex": REGEX, "temperature": temperature,
                            "seed": 3},
                           return_logprob=True, top_logprobs_num=top)
    complete = 0
    for o in outs:
        ids, m = o["output_ids"], o["meta_info"]
        for pos, ((lp, tok, _), alts) in enumerate(zip(m["output_token_logprobs"],
                                                      m["output_top_logprobs"])):
            allowed = _allowed_after(engine, ids[:pos])
            listed = {t: v for v, t, _ in alts}
            assert set(listed) <= allowed, (pos, set(listed) - allowed)
            assert tok in allowed and lp > DISALLOWED_LOGPROB
            if tok in listed:
                assert lp == pytest.approx(listed[tok], abs=1e-5)
            if len(allowed) <= top:  # the list is the whole allowed set
                complete += 1
                assert set(listed) == allowed
                assert sum(math.exp(v) for v in listed.values()) == pytest.approx(1, abs=1e-4)
            else:
                assert len(listed) == top
    assert complete  # the sum-to-one check ran


def test_an_unconstrained_request_beside_constrained_ones_is_unchanged(engine):
    sp = {"max_new_tokens": 10, "temperature": 0.0}
    alone = engine.generate("The answer is", sp, return_logprob=True, top_logprobs_num=5)
    mixed = engine.generate(["The answer is", "x", "ab"],
                            [sp, {**sp, "regex": REGEX}, {**sp, "regex": REGEX}],
                            return_logprob=True, top_logprobs_num=5)[0]
    assert mixed["output_ids"] == alone["output_ids"]
    a, b = alone["meta_info"], mixed["meta_info"]
    for (x, tx, _), (y, ty, _) in zip(a["output_token_logprobs"], b["output_token_logprobs"]):
        assert tx == ty and x == pytest.approx(y, abs=1e-4)
    for xs, ys in zip(a["output_top_logprobs"], b["output_top_logprobs"]):
        assert [t for _, t, _ in xs] == [t for _, t, _ in ys]
        assert [v for v, _, _ in xs] == pytest.approx([v for v, _, _ in ys], abs=1e-4)
