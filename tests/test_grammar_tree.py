"""Issue 31 with draft trees (worker/grammar_tree.py), without an engine:

- the verify masks are each column's path state: equal to a fresh matcher advanced along the
  column's path, and to xgrammar's own ``traverse_draft_tree`` on the reachable columns; a
  column behind a refused token is all-allowed (unreachable); the matchers end at the root;
- drafting under a grammar: every node the drafter scored finite is grammar-valid (a fresh
  matcher accepts its whole path), on the built-in tokenizer with a JSON schema;
- lossless sampling: on a tiny vocabulary whose grammar allows a path-dependent subset, a
  chi-square per emitted position (conditioned on the emitted prefix) shows the constrained
  target distribution under tree speculation (topk 2 and 3), and the same statistic detects two
  wrong rules: the verify left unmasked, and every column masked with the root's state;
- logprobs of constrained rows are the masked distribution's.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

import specdial
from specdial.worker.batch_sampling import BatchSampling
from specdial.worker.grammar import GrammarBackend, new_matcher
from specdial.worker.grammar_masks import BatchGrammar, unpack_bitmask
from specdial.worker.grammar_spec import StructuredSpec
from specdial.worker.grammar_tree import TreeGrammar
from specdial.worker.sampling import SamplingParams
from specdial.worker.tree import DraftTree
from specdial.worker.tree_accept import tree_accept
from test_sampling import chi2_sf
from tree_helpers import ToyLM, column_logits, draft_tree

TARGET = Path(specdial.__file__).parent / "builtin" / "target"
SCHEMA = json.dumps({"type": "object", "properties": {
    "id": {"type": "integer"}, "tag": {"enum": ["ab", "cd"]}}, "required": ["id", "tag"]})
# tiny vocabulary: 0 is the stop token; the grammar's allowed set depends on the path
TINY = ["<eos>", "a", "b", "c", "d", "e", "f", "g"]
TINY_REGEX = "([abc][bcd])+e"


@pytest.fixture(scope="module")
def backend():
    tok = AutoTokenizer.from_pretrained(TARGET)
    return GrammarBackend(tok, 4096, [tok.eos_token_id])


@pytest.fixture(scope="module")
def tiny_grammar():
    info = xgr.TokenizerInfo(TINY, stop_token_ids=[0])
    return xgr.GrammarCompiler(info).compile_regex(TINY_REGEX)


def _allowed(matcher, vocab):
    bm = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bm, 0)
    return unpack_bitmask(bm, vocab)[0]


def _reference_column(compiled, history, path, vocab):
    """A fresh matcher after ``history`` then ``path``: its mask, or None if refused."""
    m = new_matcher(compiled)
    for t in list(history) + list(path):
        if not m.accept_token(int(t)):
            return None
    return _allowed(m, vocab)


def _paths(tree: DraftTree, b: int):
    paths = [()]
    for t, p in zip(tree.tokens[b].tolist(), tree.parents[b].tolist()):
        paths.append(paths[p + 1] + (t,))
    return paths


class RandomDrafter:
    """Random drafter logits ``[..., V]`` (the toy interface of tree_helpers)."""

    def __init__(self, vocab, seed):
        self.vocab, self.g = vocab, torch.Generator().manual_seed(seed)

    def __call__(self, prev, last):
        return torch.randn(*last.shape, self.vocab, generator=self.g) * 3


@pytest.mark.parametrize("topk, depth, nodes", [(2, 3, 6), (4, 4, 16), (3, 2, 9)])
def test_drafted_nodes_are_valid_and_verify_masks_are_each_paths_state(backend, topk, depth,
                                                                       nodes):
    compiled = backend.compile(StructuredSpec("json_schema", SCHEMA))
    tok = AutoTokenizer.from_pretrained(TARGET)
    histories = [[], tok.encode('{"id": 1', add_special_tokens=False),
                 tok.encode('{"id": 12, "tag": "a', add_special_tokens=False)]
    matchers = []
    for h in histories:
        m = new_matcher(compiled)
        assert all(m.accept_token(t) for t in h)
        matchers.append(m)
    b, vocab = len(histories) + 1, 4096
    grammar = BatchGrammar(matchers + [None], vocab, torch.device("cpu"))  # last row free
    tg = TreeGrammar(grammar)
    last = torch.zeros(b, dtype=torch.int64)
    tree = draft_tree(RandomDrafter(vocab, topk * 10 + depth), last, last, topk, depth, nodes,
                      grammar=tg)
    tg.start_verify(tree)
    masked = tg.mask_verify(torch.zeros(b, nodes + 1, vocab))
    assert torch.equal(torch.isfinite(masked), tg.column_mask)
    finite = torch.isfinite(tree.scores)
    for i, h in enumerate(histories):
        assert matchers[i].is_terminated() is False and _paths(tree, i)[0] == ()
        paths = _paths(tree, i)
        for c, path in enumerate(paths):
            ref = _reference_column(compiled, h, path, vocab)
            if c and finite[i, c - 1]:  # a node the drafter scored: grammar-valid
                assert ref is not None, (i, path)
            got = tg.column_mask[i, c]
            assert torch.equal(got, ref) if ref is not None else bool(got.all())
        # the matcher is back at the request's state: the root mask is unchanged
        assert torch.equal(_allowed(matchers[i], vocab), tg.column_mask[i, 0])
        _check_traverse(matchers[i], tree, i, tg.column_mask[i], vocab)
    assert tg.column_mask[-1].all()  # the unconstrained row: no mask


def _check_traverse(matcher, tree, b, ours, vocab):
    """xgrammar's own tree traversal (SGLang's format: node 0 the root, first-child and
    next-sibling links) gives the same masks on the reachable columns."""
    pcol, _ = tree.columns()
    cols = pcol.shape[1]
    first, sibling = [-1] * cols, [-1] * cols
    for c in range(cols - 1, 0, -1):  # children in column order
        p = int(pcol[b, c])
        sibling[c], first[p] = first[p], c
    tokens = torch.cat([torch.zeros(1, dtype=torch.int64), tree.tokens[b]])
    bm = xgr.allocate_token_bitmask(cols, vocab)
    assert matcher.traverse_draft_tree(torch.tensor(first), torch.tensor(sibling), tokens, bm)
    ref = unpack_bitmask(bm, vocab)
    reach = ref.any(-1)  # xgrammar leaves refused (unreachable) columns all zero
    assert reach[0] and torch.equal(ours[reach], ref[reach])
    assert ours[~reach].all()


def _tiny_iteration(compiled, rows, topk, depth, nodes, rule, seed):
    """One tree iteration of ``rows`` requests at temperature 1 on the tiny vocabulary (every
    request at the grammar's start, context ``(f, g)``), verify masked by ``rule``: "path"
    (the module's), "none" (verify unmasked) or "root" (every column the root's state)."""
    v = len(TINY)
    target = ToyLM(v, seed=1, scale=1.0)
    drafter = ToyLM(v, seed=2, base=target, noise=1.5)
    grammar = BatchGrammar([new_matcher(compiled) for _ in range(rows)], v, torch.device("cpu"))
    tg = TreeGrammar(grammar)
    prev, last = torch.full((rows,), 6), torch.full((rows,), 7)
    tree = draft_tree(drafter, prev, last, topk, depth, nodes, grammar=tg)
    logits = column_logits(target, tree, prev, last)
    tg.start_verify(tree)
    masked = tg.mask_verify(logits)
    if rule == "none":
        masked = logits
    elif rule == "root":
        masked = logits.masked_fill(~tg.column_mask[:, :1], -math.inf)
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0)] * rows)
    g = torch.Generator().manual_seed(seed)
    accepted, _, out = tree_accept(tree, masked, sampling, g)
    return accepted, out, target


def _per_position_chi2(compiled, accepted, out, target, depth, min_count=300):
    """``[(position, prefix, stat, df, p)]``: the token emitted at each position, among rows
    that emitted it, grouped by the emitted prefix, against the constrained target there
    (the target at ``(prev, last)`` of the prefix, masked with the grammar's state after it).
    A token outside the support gives ``stat = inf, p = 0``."""
    v = len(TINY)
    results = []
    for j in range(depth + 1):
        groups = defaultdict(list)
        for r in torch.nonzero(accepted >= j).flatten().tolist():
            groups[tuple(out[r, :j].tolist())].append(int(out[r, j]))
        for prefix, toks in groups.items():
            if len(toks) < min_count:
                continue
            ctx = (6, 7) + prefix
            mask = _reference_column(compiled, [], prefix, v)
            p = torch.softmax(target(torch.tensor(ctx[-2]), torch.tensor(ctx[-1]))
                              .masked_fill(~mask, -math.inf), -1).double()
            counts = torch.bincount(torch.tensor(toks), minlength=v).double()
            support = p > 0
            if counts[~support].sum() > 0:
                results.append((j, prefix, math.inf, 0, 0.0))
                continue
            df = int(support.sum()) - 1
            if df == 0:
                continue
            exp = len(toks) * p[support]
            stat = float(((counts[support] - exp) ** 2 / exp).sum())
            results.append((j, prefix, stat, df, chi2_sf(stat, df)))
    return results


@pytest.mark.parametrize("topk, depth, nodes", [(2, 3, 6), (3, 2, 6)])
def test_constrained_distribution_is_exact_under_tree_speculation(tiny_grammar, topk, depth,
                                                                  nodes):
    accepted, out, target = _tiny_iteration(tiny_grammar, 12000, topk, depth, nodes, "path", 0)
    res = _per_position_chi2(tiny_grammar, accepted, out, target, depth)
    positions = {j for j, *_ in res}
    assert positions >= set(range(depth + 1))  # every position, the bonus one included
    assert bool((accepted > 0).any()) and bool((accepted < depth).any())
    worst = min(p for *_, p in res)
    print(f"\n[chi2 tree {topk}/{depth}/{nodes}] {len(res)} groups, smallest p {worst:.3g}")
    assert worst > 1e-3 / len(res), res  # Bonferroni over the groups


@pytest.mark.parametrize("rule", ["none", "root"])
def test_chi_square_detects_a_wrong_verify_mask(tiny_grammar, rule):
    """The statistic above with the verify unmasked, or masked with the root's state at every
    column (not each path's): some position's emitted tokens are off the constrained target."""
    accepted, out, target = _tiny_iteration(tiny_grammar, 12000, 2, 3, 6, rule, 0)
    res = _per_position_chi2(tiny_grammar, accepted, out, target, 3)
    worst = min(res, key=lambda r: r[4])
    print(f"\n[chi2 tree, verify rule {rule!r}] worst group {worst}")
    assert worst[4] < 1e-9


def test_logprob_logits_are_the_masked_columns(tiny_grammar):
    v = len(TINY)
    grammar = BatchGrammar([new_matcher(tiny_grammar), None], v, torch.device("cpu"))
    tg = TreeGrammar(grammar)
    drafter = ToyLM(v, seed=3)
    last = torch.tensor([7, 7])
    tree = draft_tree(drafter, last, last, 2, 2, 4, grammar=tg)
    raw = torch.randn(2, 5, v)
    tg.start_verify(tree)
    tg.mask_verify(raw)
    cols = torch.tensor([[0, 1, 3], [0, 2, 2]])
    got = tg.logprob_logits(raw.gather(1, cols[:, :, None].expand(-1, -1, v)), cols)
    paths = _paths(tree, 0)
    for i, c in enumerate(cols[0].tolist()):
        ref = _reference_column(tiny_grammar, [], paths[c], v)
        if ref is None:
            ref = torch.ones(v, dtype=torch.bool)
        assert torch.equal(torch.isfinite(got[0, i]), ref)
    assert torch.equal(got[1], raw[1].gather(0, cols[1][:, None].expand(-1, v)))


def test_hooks_out_of_order_are_errors(tiny_grammar):
    tg = TreeGrammar(BatchGrammar([new_matcher(tiny_grammar)], len(TINY), torch.device("cpu")))
    with pytest.raises(RuntimeError, match="before start_level"):
        tg.mask_level(torch.zeros(1, 2, len(TINY)))
    with pytest.raises(RuntimeError, match="before start_verify"):
        tg.mask_verify(torch.zeros(1, 3, len(TINY)))
    with pytest.raises(RuntimeError, match="before mask_verify"):
        tg.logprob_logits(torch.zeros(1, 2, len(TINY)), torch.zeros(1, 2, dtype=torch.int64))


def test_after_a_stop_token_only_stop_tokens_are_allowed(tiny_grammar):
    """A path through the grammar's end (``ignore_eos``): the stop token's column allows stop
    tokens only, a second stop token keeps it so, another token is refused (unreachable)."""
    v = len(TINY)
    m = new_matcher(tiny_grammar)
    assert all(m.accept_token(t) for t in (1, 2))  # "ab": e allowed next
    tg = TreeGrammar(BatchGrammar([m], v, torch.device("cpu")))
    e, eos = TINY.index("e"), 0
    tree = DraftTree(tokens=torch.tensor([[e, eos, eos, 1]]), parents=torch.tensor([[-1, 0, 1, 1]]),
                     depths=torch.tensor([[1, 2, 3, 3]]), scores=torch.zeros(1, 4), depth=3,
                     topk=2)
    tg.start_verify(tree)
    tg.mask_verify(torch.zeros(1, 5, v))
    only_stop = torch.zeros(v, dtype=torch.bool)
    only_stop[eos] = True
    assert torch.equal(tg.column_mask[0, 1], only_stop)  # after "e": the stop token
    assert torch.equal(tg.column_mask[0, 2], only_stop)  # after "e<eos>": stop tokens only
    assert torch.equal(tg.column_mask[0, 3], only_stop)  # after "e<eos><eos>"
    assert tg.column_mask[0, 4].all()  # "e<eos>a": refused, unreachable
    assert not m.is_terminated()
    assert np.array_equal(_allowed(m, v).numpy(), tg.column_mask[0, 0].numpy())


@pytest.mark.parametrize("depth", [1, 3, 5])
def test_one_host_wait_per_tree_level(tiny_grammar, monkeypatch, depth):
    """The hooks wait for the device once per level: ``depth - 1`` frontiers and the tree
    before the verify (level 1's mask is the request's current state: no wait)."""
    import specdial.worker.grammar_tree as gt

    waits = []
    monkeypatch.setattr(gt, "_host", lambda pending: waits.append(1) or pending[0].numpy())
    v = len(TINY)
    tg = TreeGrammar(BatchGrammar([new_matcher(tiny_grammar)] * 1, v, torch.device("cpu")))
    last = torch.tensor([7])
    tree = draft_tree(ToyLM(v, seed=4), last, last, 2, depth, depth, grammar=tg)
    tg.start_verify(tree)
    tg.mask_verify(torch.zeros(1, depth + 1, v))
    assert len(waits) == depth
