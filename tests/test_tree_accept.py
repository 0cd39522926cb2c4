"""Lossless acceptance of draft trees (issue 29; invariants 1, 2 and 7).

Greedy: tree decoding emits target-only greedy tokens for every tree shape (topk 1-8, N up to
64, depth up to 7), random and good drafters, and shape changes between iterations. Sampling:
chi-square per position on a 4-token vocabulary against the exact distribution, and a
deliberately wrong rule (rejected children not removed from the residual) failing the same test.
Seeded rows: the tokens do not depend on the tree's shape or the drafter.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from specdial.worker import tree_accept as ta
from specdial.worker.sampling import BatchSampling, SamplingParams, sample
from specdial.worker.tree_accept import path_columns, tree_accept

from tree_helpers import ToyLM, column_logits, draft_tree, valid_shapes

SHAPES = list(valid_shapes())


def _decode(target, drafter, shapes, sampling, prev, last, steps, *, start_pos=None,
            generator=None):
    """Tree decoding of ``B`` rows until each has ``steps`` tokens; ``shapes(i)`` gives the
    (topk, depth, N) of iteration ``i``. Returns ``[B, steps]`` int64."""
    b = prev.shape[0]
    out = [[] for _ in range(b)]
    pos = start_pos.clone() if start_pos is not None else torch.zeros(b, dtype=torch.int64)
    it = 0
    while min(len(o) for o in out) < steps:
        k, d, n = shapes(it)
        tree = draft_tree(drafter, prev, last, k, d, n)
        logits = column_logits(target, tree, prev, last)
        acc, path, toks = tree_accept(tree, logits, sampling, generator, pos + 1)
        assert (path_columns(path).diff(dim=1) >= 0).all()
        for r in range(b):
            out[r].extend(toks[r, :acc[r] + 1].tolist())
        emitted = toks.gather(1, acc[:, None]).squeeze(1)
        prev_new = torch.where(acc > 0, toks.gather(1, (acc - 1).clamp(min=0)[:, None])
                               .squeeze(1), last)
        prev, last, pos = prev_new, emitted, pos + acc + 1
        it += 1
    return torch.tensor([o[:steps] for o in out])


def _greedy_reference(target, prev, last, steps):
    out = []
    for _ in range(steps):
        nxt = target(prev, last).argmax(-1)
        out.append(nxt)
        prev, last = last, nxt
    return torch.stack(out, 1)


@pytest.mark.parametrize("good", [False, True])
def test_greedy_equals_target_only_for_every_shape(good):
    v, b, steps = 24, 4, 12
    target = ToyLM(v, seed=1)
    drafter = ToyLM(v, seed=2, base=target, noise=0.3) if good else ToyLM(v, seed=3)
    greedy = BatchSampling.from_params([SamplingParams()] * b)
    prev, last = torch.tensor([0, 5, 9, 23]), torch.tensor([1, 2, 17, 4])
    want = _greedy_reference(target, prev, last, steps)
    for shape in SHAPES:
        got = _decode(target, drafter, lambda i: shape, greedy, prev, last, steps)
        assert torch.equal(got, want), shape


def test_greedy_across_shape_changes_and_accepts_long_paths():
    v, b, steps = 24, 4, 40
    target = ToyLM(v, seed=1)
    drafter = ToyLM(v, seed=2, base=target, noise=0.1)
    greedy = BatchSampling.from_params([SamplingParams()] * b)
    prev, last = torch.tensor([0, 5, 9, 23]), torch.tensor([1, 2, 17, 4])
    rng = random.Random(0)
    seq = [rng.choice(SHAPES) for _ in range(steps)]
    got = _decode(target, drafter, lambda i: seq[i], greedy, prev, last, steps)
    assert torch.equal(got, _greedy_reference(target, prev, last, steps))
    # a near-target drafter is accepted deep into the tree (the walk is not trivially short)
    tree = draft_tree(drafter, prev, last, 4, 6, 30)
    acc, _, _ = tree_accept(tree, column_logits(target, tree, prev, last), greedy, None)
    assert int(acc.max()) >= 4


# ---------------------------------------------------------------- sampling (chi-square)
V = 4
ROWS = 24000
CRIT_DF3 = 16.27  # chi-square, alpha 1e-3, df 3
CRIT_DF63 = 103.4  # df 63 (the joint of three tokens)


def _exact_joint(target, prev, last, steps):
    """Exact distribution of the next ``steps`` tokens: ``{tokens: probability}``."""
    out = {}
    for seq in itertools.product(range(V), repeat=steps):
        p, a, b_ = 1.0, prev, last
        for t in seq:
            p *= float(target(torch.tensor(a), torch.tensor(b_)).softmax(-1)[t])
            a, b_ = b_, t
        out[seq] = p
    return out


def _chi_square(tokens, target, prev, last):
    steps = tokens.shape[1]
    joint = _exact_joint(target, prev, last, steps)
    n = tokens.shape[0]
    stats = []
    for j in range(steps):  # per position
        marg = [sum(p for s, p in joint.items() if s[j] == t) for t in range(V)]
        obs = torch.bincount(tokens[:, j], minlength=V).double()
        stats.append(sum((obs[t] - n * marg[t]) ** 2 / (n * marg[t]) for t in range(V)).item())
    idx = (tokens * torch.tensor([V ** (steps - 1 - j) for j in range(steps)])).sum(1)
    obs = torch.bincount(idx, minlength=V ** steps).double()
    joint_stat = sum((obs[i] - n * p) ** 2 / (n * p)
                     for i, p in enumerate(joint[s] for s in itertools.product(range(V),
                                                                              repeat=steps)))
    return stats, float(joint_stat)


def _sampled(shape, rule_ok=True, monkeypatch=None):
    target = ToyLM(V, seed=11, scale=1.0)
    drafter = ToyLM(V, seed=12, scale=1.0)  # a random drafter: many rejections
    if not rule_ok:
        monkeypatch.setattr(ta, "_zero_out", lambda r, x, rejected: r)
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0)] * ROWS)
    prev, last = torch.full((ROWS,), 1), torch.full((ROWS,), 2)
    gen = torch.Generator().manual_seed(123)
    toks = _decode(target, drafter, lambda i: shape, sampling, prev, last, 3, generator=gen)
    return _chi_square(toks, target, 1, 2)


@pytest.mark.parametrize("shape", [(2, 2, 4), (3, 3, 10), (4, 2, 20)])
def test_sampling_is_lossless_per_position(shape):
    per_pos, joint = _sampled(shape)
    assert max(per_pos) < CRIT_DF3, per_pos
    assert joint < CRIT_DF63, joint


def test_a_wrong_residual_rule_fails_the_chi_square(monkeypatch):
    per_pos, joint = _sampled((3, 3, 10), rule_ok=False, monkeypatch=monkeypatch)
    assert max(per_pos) > CRIT_DF3 and joint > CRIT_DF63, (per_pos, joint)


# ---------------------------------------------------------------- seeded rows
def test_seeded_tokens_do_not_depend_on_the_tree():
    v, b, steps = 16, 6, 10
    target = ToyLM(v, seed=21, scale=1.0)
    params = [SamplingParams(temperature=0.8, seed=s) for s in range(b - 1)] + [
        SamplingParams(temperature=0.8)]  # one unseeded row in the batch
    sampling = BatchSampling.from_params(params)
    prev, last = torch.arange(b) % v, (torch.arange(b) * 3) % v
    start = torch.arange(b) + 7  # L: sequence index of the root
    # plain seeded decoding: the token at index L + 1 + i drawn with key (seed, L + 1 + i)
    ref, p_, l_ = [], prev, last
    for i in range(steps):
        t = sample(target(p_, l_), sampling, None, start + 1 + i)
        ref.append(t)
        p_, l_ = l_, t
    ref = torch.stack(ref, 1)[: b - 1]
    gen = torch.Generator().manual_seed(0)
    for drafter_seed, shapes in [(22, lambda i: (1, 3, 3)), (23, lambda i: (4, 5, 24)),
                                 (24, lambda i: SHAPES[(7 * i) % len(SHAPES)])]:
        drafter = ToyLM(v, seed=drafter_seed, scale=1.0)
        got = _decode(target, drafter, shapes, sampling, prev, last, steps, start_pos=start,
                      generator=gen)
        assert torch.equal(got[: b - 1], ref)


def test_child_table_orders_children_and_checks_the_bound():
    from specdial.worker.tree import DraftTree
    from specdial.worker.tree_accept import child_table

    parents = torch.tensor([[-1, -1, 0, 0, 1, -1]])
    tree = DraftTree(torch.arange(6)[None], parents, torch.tensor([[1, 1, 2, 2, 2, 1]]),
                     torch.zeros(1, 6), depth=2, topk=3)
    assert child_table(tree, check=True).tolist() == [[[1, 2, 6], [3, 4, -1], [5, -1, -1],
                                                        [-1, -1, -1], [-1, -1, -1],
                                                        [-1, -1, -1], [-1, -1, -1]]]
    tree.topk = 2
    with pytest.raises(ValueError, match="more than topk=2 children"):
        child_table(tree, check=True)


def _walk_reference(choice, tree):
    """The level-by-level walk in plain Python: follow the child whose token is the choice."""
    out = []
    for b in range(choice.shape[0]):
        cur, path = 0, []
        for _ in range(tree.depth):
            kids = [i + 1 for i in range(tree.num_nodes)
                    if int(tree.parents[b, i]) + 1 == cur
                    and int(tree.tokens[b, i]) == int(choice[b, cur])]
            if not kids:
                break
            cur = kids[0]
            path.append(cur)
        out.append((len(path), path + [-1] * (tree.depth - len(path)), int(choice[b, cur])))
    return out


@pytest.mark.parametrize("shape", [(2, 3, 5), (4, 4, 16), (8, 7, 64), (3, 7, 12)])
def test_vectorised_walk_equals_the_level_by_level_walk(shape):
    """The all-columns greedy walk (ancestor mask) picks the walk's path on random trees whose
    choices often follow a child, so paths of every length up to the depth occur."""
    k, d, n = shape
    gen = torch.Generator().manual_seed(7)
    drafter = ToyLM(64, seed=3)
    prev, last = torch.randint(0, 64, (6,), generator=gen), torch.randint(0, 64, (6,),
                                                                         generator=gen)
    tree = draft_tree(drafter, prev, last, k, d, n)
    pcol, _ = tree.columns()
    col_tokens = torch.cat([torch.full((6, 1), -1), tree.tokens], 1)
    lengths = set()
    for trial in range(20):
        # each column's choice: a random child's token (often) or a random token
        choice = torch.randint(0, 64, (6, n + 1), generator=gen)
        for b in range(6):
            for c in range(n + 1):
                kids = (pcol[b] == c).nonzero().flatten()
                if len(kids) and trial % 4:  # follow a random child (every 4th trial: none)
                    pick = kids[int(torch.randint(0, len(kids), (1,), generator=gen))]
                    choice[b, c] = col_tokens[b, pick]
        acc, path, last_tok = ta._exact_walk(choice, tree, col_tokens,
                                             ta.ancestor_mask(tree.parents))
        ref = _walk_reference(choice, tree)
        assert acc.tolist() == [r[0] for r in ref]
        assert path.tolist() == [r[1] for r in ref]
        assert last_tok.tolist() == [r[2] for r in ref]
        lengths |= set(acc.tolist())
    assert 0 in lengths and max(lengths) >= min(d, 4)  # short and long paths both checked
