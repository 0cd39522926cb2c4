"""Per-request ``seed``: counter-based draws keyed by (seed, position, purpose).

1. The hashed numbers (specdial.worker.seeded_noise): bit-exact against a pure-Python SplitMix64,
   uniform on (0, 1) (chi-square on 20 bins and on 10 x 10 bins of neighbouring keys), distinct
   for distinct keys, equal for equal keys.
2. Batch invariance of the sampling functions: a seeded row gives the same token whatever the
   other rows (and the generator) are.
3. End to end through :class:`specdial.Engine`: a seeded request alone equals the same request
   among other seeded and unseeded ones and with another engine generator seed (fixed steps with
   a draft model, through the CUDA-graph runner path, with an EAGLE head; and without
   speculation); another seed gives another completion.
4. Lossless sampling (docs/design.md invariant 2) with the seeded noise: many rows, one seed each
   (and mixed with unseeded rows), chi-square at alpha = 1e-3 as in tests/test_sampling.py, and
   the end-to-end check of tests/test_engine_sampling.py with one seed per request.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import PROMPTS
from greedy import greedy
from specdial.engine import Engine
from specdial.worker.sampling import (PURPOSE_TOKEN, BatchSampling, SamplingParams, sample,
                                      sample_from_probs, speculative_accept, target_probs)
from specdial.worker.seeded_noise import (draw_keys, mix64, seed_to_int64, seeded_exponentials,
                                          seeded_uniforms)
from test_engine_sampling import N as N_ENGINE
from test_engine_sampling import V as V8
from test_engine_sampling import CRITICAL_DF7_ALPHA_1E3, PROMPT, chi2, exact_marginals, tiny_model
from test_sampling import P, Q, V, assert_fits, chi2_sf, gen

MASK = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
# upper 1e-3 critical values of chi-square (standard table), checked against gammaincc below
CRIT_DF19, CRIT_DF99 = 43.820, 148.230
# purposes other than PURPOSE_TOKEN: free values of the key's purpose bits, for the hash tests
PURPOSE_A, PURPOSE_B = 1, 2


def py_mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def seeds_tensor(seeds) -> torch.Tensor:
    return torch.tensor([seed_to_int64(s) for s in seeds], dtype=torch.int64)


def chi2_uniform(u: torch.Tensor, bins: int) -> float:
    counts = torch.histc(u.double(), bins=bins, min=0.0, max=1.0)
    expected = u.numel() / bins
    return float(((counts - expected) ** 2 / expected).sum())


# ---------------------------------------------------------------------------------------------
# 1. the hashed numbers

def test_critical_values_match_gammaincc():
    assert chi2_sf(CRIT_DF19, 19) == pytest.approx(1e-3, rel=2e-3)
    assert chi2_sf(CRIT_DF99, 99) == pytest.approx(1e-3, rel=2e-3)


def test_matches_pure_python_splitmix64():
    """int64 wrap-around arithmetic and masked shifts reproduce unsigned SplitMix64 exactly."""
    seeds = [0, 1, 12345, 2**63 - 1, 2**63, 2**64 - 1]
    positions = [0, 3, 17, 2**40, 5, 999]
    keys = draw_keys(seeds_tensor(seeds), torch.tensor(positions), PURPOSE_B)
    for key, s, p in zip(keys.tolist(), seeds, positions):
        assert key & MASK == py_mix64(py_mix64((s + GAMMA) & MASK) ^ ((p << 4) | PURPOSE_B))
    u = seeded_uniforms(keys, 5).double()
    for row, key in zip(u, keys.tolist()):
        outs = [py_mix64((key + (i + 1) * GAMMA) & MASK) for i in range(5)]
        assert row.tolist() == [((z >> 41) * 2 + 1) / 2**24 for z in outs]
    assert torch.equal(seeded_uniforms(keys), u[:, 0].float())  # a scalar draw is element 0
    z = torch.tensor([0, -1, 2**62, -(2**63)])
    assert [x & MASK for x in mix64(z).tolist()] == [py_mix64(x & MASK) for x in z.tolist()]


def test_uniforms_are_uniform_on_the_open_interval():
    keys = draw_keys(torch.arange(50), torch.arange(50) * 7, PURPOSE_TOKEN)
    u = seeded_uniforms(keys, 2000).flatten()  # 1e5 draws
    assert u.dtype == torch.float32 and u.numel() == 100_000
    assert (u > 0).all() and (u < 1).all()
    stat = chi2_uniform(u, 20)
    print(f"\n[chi2] uniform 20 bins: n={u.numel()} stat={stat:.2f} crit={CRIT_DF19} "
          f"p={chi2_sf(stat, 19):.3g}")
    assert stat < CRIT_DF19
    n = u.numel()
    mean, var = u.double().mean().item(), u.double().var().item()
    assert abs(mean - 0.5) < 4.5 * math.sqrt(1 / 12 / n)
    assert abs(var - 1 / 12) < 4.5 * math.sqrt(1 / 180 / n)  # Var((u - 1/2)^2) = 1/180
    ks = (u.double().sort().values - torch.arange(1, n + 1, dtype=torch.float64) / n).abs().max()
    assert ks.item() < 1.95 / math.sqrt(n)  # Kolmogorov-Smirnov, alpha 1e-3
    e = seeded_exponentials(keys, 2000).double()
    assert abs(e.mean().item() - 1) < 4.5 / math.sqrt(n) and torch.isfinite(e).all()


@pytest.mark.parametrize("neighbour", ["position", "seed", "purpose", "element"])
def test_neighbouring_keys_are_independent(neighbour):
    """Pairs (u at a key, u at the next seed / position / purpose / element) fill 10 x 10
    bins uniformly: no correlation between the draws of adjacent keys."""
    n = 40_000
    seeds, pos = torch.arange(n) * 3 + 11, torch.arange(n) % 500 + 1
    if neighbour == "element":
        pair = seeded_uniforms(draw_keys(seeds, pos, PURPOSE_A), 2)
        a, b = pair[:, 0], pair[:, 1]
    else:
        a = seeded_uniforms(draw_keys(seeds, pos, PURPOSE_A))
        s2 = seeds + 1 if neighbour == "seed" else seeds
        p2 = pos + 1 if neighbour == "position" else pos
        b = seeded_uniforms(draw_keys(s2, p2, PURPOSE_B if neighbour == "purpose"
                                      else PURPOSE_A))
    cell = (a * 10).long() * 10 + (b * 10).long()
    counts = torch.bincount(cell, minlength=100).double()
    stat = float(((counts - n / 100) ** 2 / (n / 100)).sum())
    print(f"\n[chi2] pairs of {neighbour} neighbours, 10x10 bins: stat={stat:.2f} "
          f"crit={CRIT_DF99} p={chi2_sf(stat, 99):.3g}")
    assert stat < CRIT_DF99


def test_equal_keys_equal_draws_distinct_keys_distinct():
    s = seeds_tensor([5, 5, 5, 5, 6, 2**64 - 1])
    p = torch.tensor([10, 10, 11, 10, 10, 10])
    k_tok, k_acc = draw_keys(s, p, PURPOSE_TOKEN), draw_keys(s, p, PURPOSE_B)
    u = seeded_uniforms(k_tok, 64)
    assert torch.equal(u[0], u[1]) and torch.equal(u[0], u[3])
    assert torch.equal(seeded_uniforms(draw_keys(s, p, PURPOSE_TOKEN), 64), u)  # stateless
    for other in (u[2], u[4], u[5], seeded_uniforms(k_acc, 64)[0]):
        assert not torch.equal(u[0], other)
    # all keys of one request over positions x purposes are distinct
    pos = torch.arange(4096).repeat(3)
    keys = torch.cat([draw_keys(torch.full((4096,), 5), pos[:4096], q)
                      for q in (PURPOSE_A, PURPOSE_B, PURPOSE_TOKEN)])
    assert keys.unique().numel() == keys.numel()
    with pytest.raises(ValueError, match="purpose"):
        draw_keys(s, p, 0)


# ---------------------------------------------------------------------------------------------
# 2. batch invariance of the sampling functions

def _params(seeds, temperature=1.0, **kw):
    return [SamplingParams(temperature=temperature, seed=s, **kw) for s in seeds]


def test_batch_sampling_seed_fields_and_select():
    params = _params([3, None, 2**64 - 1]) + [SamplingParams(seed=9)]  # greedy: not seeded
    bs = BatchSampling.from_params(params)
    assert bs.any_seeded and not bs.all_seeded
    assert bs.seeded_rows.tolist() == [0, 2] and bs.seeded_mask.tolist() == [1, 0, 1, 0]
    assert bs.seeds.tolist() == [3, 0, -1, 9]
    sub = bs.select(torch.tensor([2, 0]))
    assert sub.all_seeded and sub.seeds.tolist() == [-1, 3] and sub.seeded_rows.tolist() == [0, 1]
    sub = bs.select(torch.tensor([1, 3]))
    assert not sub.any_seeded and sub.seeded_rows.numel() == 0
    plain = BatchSampling.from_params(_params([None, None]))
    assert not plain.any_seeded and not plain.all_seeded


def _random_case(b, seed):
    g = gen(seed)
    probs = torch.rand(b, 50, generator=g) ** 4
    return probs, torch.randint(0, 10_000, (b,), generator=g)


def test_sample_from_probs_seeded_row_ignores_the_batch():
    probs, pos = _random_case(16, 0)
    seeds = [100 + i if i % 3 else None for i in range(16)]
    bs = BatchSampling.from_params(_params(seeds))
    base = sample_from_probs(probs, gen(1), sampling=bs, positions=pos)
    seeded = [i for i, s in enumerate(seeds) if s is not None]
    # permuted batch, other unseeded rows, another generator state
    perm = torch.randperm(16, generator=gen(2))
    probs2, pos2 = probs[perm].clone(), pos[perm].clone()
    seeds2 = [seeds[i] for i in perm.tolist()]
    unseeded2 = [j for j, s in enumerate(seeds2) if s is None]
    probs2[unseeded2] = torch.rand(len(unseeded2), 50, generator=gen(3))
    out2 = sample_from_probs(probs2, gen(4), sampling=BatchSampling.from_params(_params(seeds2)),
                             positions=pos2)
    inv = torch.argsort(perm)
    assert torch.equal(out2[inv][seeded], base[seeded])
    # each seeded row alone (an all-seeded batch: no generator at all)
    for i in seeded:
        alone = BatchSampling.from_params(_params([seeds[i]]))
        assert sample_from_probs(probs[i:i + 1], None, sampling=alone,
                                 positions=pos[i:i + 1]).item() == base[i].item()
    # through sample(): logits of the same rows, the first token of a prompt
    logits = probs.log()
    tok = sample(logits, bs, gen(5), pos)
    for i in seeded:
        assert sample(logits[i:i + 1], BatchSampling.from_params(_params([seeds[i]])), None,
                      pos[i:i + 1]).item() == tok[i].item()
    with pytest.raises(ValueError, match="positions"):
        sample(logits, bs, gen(5))


def test_speculative_accept_seeded_row_ignores_the_batch():
    b, k = 12, 3
    g = gen(10)
    logits = torch.randn(b, k + 1, V, generator=g) * 2
    q = torch.softmax(torch.randn(b, k, V, generator=g) * 2, -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(b, k)
    pos = torch.randint(1, 1000, (b,), generator=g)
    seeds = [7 * i if i % 2 else None for i in range(b)]
    bs = BatchSampling.from_params(_params(seeds))
    acc, out = speculative_accept(drafts, q, logits, bs, gen(11), pos)
    for i in range(1, b, 2):
        alone = BatchSampling.from_params(_params([seeds[i]]))
        a1, o1 = speculative_accept(drafts[i:i + 1], q[i:i + 1], logits[i:i + 1], alone, None,
                                    pos[i:i + 1])
        assert a1.item() == acc[i].item() and torch.equal(o1[0], out[i])
    assert len(set(acc[1::2].tolist())) > 1, "the seeded rows should stop at different drafts"
    # permuted batch in which row 3 keeps its seed and every other row changes its seed (the
    # unseeded rows get one, the seeded ones lose it); another generator state
    perm = torch.randperm(b, generator=gen(12))
    seeds2 = [seeds[j] if j == 3 else (500 + j if seeds[j] is None else None)
              for j in perm.tolist()]
    a2, o2 = speculative_accept(drafts[perm], q[perm], logits[perm],
                                BatchSampling.from_params(_params(seeds2)), gen(14), pos[perm])
    at = perm.tolist().index(3)
    assert a2[at] == acc[3] and torch.equal(o2[at], out[3])
    # the other rows' q and logits altered: every seeded row unchanged
    odd = torch.arange(1, b, 2)
    for i in range(b):
        q2, logits2 = q.clone(), logits.clone()
        rest = [j for j in range(b) if j != i]
        q2[rest], logits2[rest] = q2[rest].flip(-1), -logits2[rest]
        a3, o3 = speculative_accept(drafts, q2, logits2, bs, gen(13 + i), pos)
        if i % 2:
            assert a3[i] == acc[i] and torch.equal(o3[i], out[i])
    # k = 0 (plain decode through verify): the token at positions + 0, batch-independent too
    a0, o0 = speculative_accept(drafts[:, :0], None, logits[:, :1], bs, gen(15), pos)
    for i in odd.tolist():
        alone = BatchSampling.from_params(_params([seeds[i]]))
        _, o1 = speculative_accept(drafts[i:i + 1, :0], None, logits[i:i + 1, :1], alone, None,
                                   pos[i:i + 1])
        assert torch.equal(o1[0], o0[i])
    with pytest.raises(ValueError, match="positions"):
        speculative_accept(drafts, q, logits, bs, gen(11))


# ---------------------------------------------------------------------------------------------
# 3. end to end through the Engine

KW = dict(max_running_requests=8, kv_cache_tokens=2048, page_size=8)


def _run(engine, prompts, sps):
    return engine.generate(input_ids=prompts, sampling_params=sps)


@pytest.mark.parametrize("speculate", ["draft", "draft+graph-runner", "eagle", None])
def test_seeded_request_alone_equals_in_a_batch(tiny, speculate):
    """Fixed steps 3 (a draft model, the same through the CUDA-graph runner path emulated on
    the CPU, an EAGLE head) or no speculation, temperature 1."""
    drafter = () if speculate is None else (
        (tiny.eagle_random,) if speculate == "eagle" else (tiny.draft_noisy,))
    spec = {} if speculate is None else dict(speculative_adaptive=False, speculative_num_steps=3)
    if speculate == "draft+graph-runner":
        spec["cuda_graph_mode"] = "emulate"
    me = {"temperature": 1.0, "seed": 1234, "max_new_tokens": 30}
    prompt = PROMPTS[1]
    with Engine.from_modules(tiny.target, *drafter, seed=0, **spec, **KW) as engine:
        first = _run(engine, [prompt], [me])[0]
        alone = first["output_ids"]
        others = [{"temperature": 1.0, "seed": 5, "max_new_tokens": 20},
                  {"temperature": 0.7, "top_k": 20, "max_new_tokens": 40},  # unseeded
                  {"temperature": 1.0, "seed": 1235, "max_new_tokens": 30},
                  greedy(12),  # greedy
                  {"temperature": 1.0, "max_new_tokens": 25}]  # unseeded
        prompts = [PROMPTS[0], prompt, prompt, PROMPTS[2], prompt, prompt]
        batch = [o["output_ids"] for o in
                 _run(engine, prompts, others[:1] + [others[1], me] + others[2:])]
        if speculate == "draft+graph-runner":  # sampled drafts went through the runner
            assert engine.graph_stats()["eager"].get("draft:sampling", 0) > 0
    with Engine.from_modules(tiny.target, *drafter, seed=99, **spec, **KW) as engine:
        again = _run(engine, [PROMPTS[2], prompt], [others[1], me])[1]["output_ids"]
    assert len(alone) == 30
    assert batch[2] == alone, "a seeded request must not depend on its batch"
    assert again == alone, "nor on the engine's generator"
    assert batch[4] != alone, "another seed gives another completion"
    if speculate == "draft":  # drafts were sampled, verified and some accepted
        assert first["meta_info"]["spec_verify_ct"] < 30


STEPS_SETUPS = {
    "fixed 3": dict(speculative_adaptive=False, speculative_num_steps=3),
    "schedule 0..7": dict(steps_schedule=[0, 7, 1, 3, 5, 2, 6, 4, 0, 0, 7]),
    "adaptive": dict(speculative_adaptive=True),
    "adaptive, graph runners": dict(speculative_adaptive=True, cuda_graph_mode="emulate"),
}


@pytest.mark.parametrize("drafter_name", ["draft_noisy", "eagle_random", "draft_random",
                                          "eagle3_noisy"])
def test_seeded_tokens_are_the_plain_decoding_tokens_whatever_the_steps(request, drafter_name):
    """Issue 12: a seeded request's tokens equal its tokens without speculation, whatever the
    drafter (a close draft model, a random EAGLE head, a random draft model, an EAGLE-3 head
    with its own shuffled vocabulary), the steps (fixed, a schedule switching between 0 and 7
    every iteration, the adaptive policy) and its batch (alone, then among 31 others: seeded,
    unseeded and greedy). Before the coupled draws, the steps decided which keys the rejection
    sampler consumed, so the text changed with them."""
    models = request.getfixturevalue("exact" if drafter_name == "eagle3_noisy" else "tiny")
    me = {"temperature": 1.0, "seed": 7, "max_new_tokens": 40}
    others = [{"temperature": 1.0, "seed": 100 + i, "max_new_tokens": 10 + i % 25} if i % 3 == 0
              else {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 30} if i % 3 == 1
              else greedy(20) for i in range(31)]
    prompts = [PROMPTS[i % 3] for i in range(31)]
    kw = dict(max_running_requests=32, kv_cache_tokens=4096, page_size=8)
    with Engine.from_modules(models.target, seed=0, **kw) as engine:
        reference = _run(engine, [PROMPTS[1]], [me])[0]["output_ids"]
    assert len(reference) == 40
    drafter = getattr(models, drafter_name)
    for name, setup in STEPS_SETUPS.items():
        with Engine.from_modules(models.target, drafter, seed=3, **setup, **kw) as engine:
            alone = _run(engine, [PROMPTS[1]], [me])[0]
            batch = _run(engine, prompts[:16] + [PROMPTS[1]] + prompts[16:],
                         others[:16] + [me] + others[16:])
            histogram = alone["meta_info"]["spec_steps_histogram"]
        assert alone["output_ids"] == reference, f"{drafter_name}, {name}, alone"
        assert batch[16]["output_ids"] == reference, f"{drafter_name}, {name}, in a batch of 32"
        if name.startswith("schedule"):
            assert len(histogram) > 3, histogram  # the steps really changed mid-request
        if drafter_name.endswith("noisy") and name == "fixed 3":  # drafts really accepted
            assert alone["meta_info"]["spec_accept_length"] > 1.5, (name, alone["meta_info"])


# ---------------------------------------------------------------------------------------------
# 4. lossless sampling with seeded rows (docs/design.md invariant 2)

N = 40_000


def seeded_chain(p_logits, q, params_of, n=N):
    """The whole speculative step on ``n`` rows, one seed each: drafts sampled from ``q``
    [k, V] with the seeded token noise of their positions (as the drafter does), then
    speculative_accept."""
    k = q.shape[0]
    bs = BatchSampling.from_params([params_of(i) for i in range(n)])
    pos = torch.full((n,), 17, dtype=torch.int64)
    drafts = torch.stack([sample_from_probs(q[i].expand(n, V), gen(50 + i), sampling=bs,
                                            positions=pos + i)
                          for i in range(k)], 1)
    return speculative_accept(drafts, q.expand(n, k, V), p_logits.expand(n, k + 1, V), bs,
                              gen(60), pos)


def coupled_acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(argmax q/E = argmax p/E) for E ~ Exp(1)^V, per row of ``p``, ``q`` [..., V]:
    both pick x iff E_y > E_x max(p_y/p_x, q_y/q_x) for every y != x, which has probability
    1 / sum_y max(p_y/p_x, q_y/q_x) (integrating over E_x ~ Exp(1)); summed over x."""
    p, q = p.double(), q.double()
    both = (p > 0) & (q > 0)
    ratio = torch.maximum(p[..., None, :] / p[..., :, None], q[..., None, :] / q[..., :, None])
    return torch.where(both, 1 / ratio.nan_to_num(posinf=math.inf).sum(-1), 0.0).sum(-1)


def test_coupled_acceptance_formula():
    """Checked against a Monte Carlo of the race, and its limits: q = p accepts always, the
    coupled acceptance never beats rejection sampling's 1 - TV(p, q)."""
    g = gen(70)
    e = torch.empty(200_000, V).exponential_(generator=g)
    for p, q in zip(P[:3], Q):
        mc = ((p / e).argmax(-1) == (q / e).argmax(-1)).double().mean().item()
        theory = coupled_acceptance(p, q).item()
        assert abs(mc - theory) < 4.5 * math.sqrt(theory * (1 - theory) / e.shape[0])
        assert theory < torch.minimum(p, q).sum().item()
    assert coupled_acceptance(P[0], P[0]).item() == pytest.approx(1.0)


def _check_acceptance(label, acc, a):
    for i in (1, 2, 3):
        theory = a[:i].prod().item()
        emp = (acc >= i).double().mean().item()
        z = abs(emp - theory) / math.sqrt(theory * (1 - theory) / acc.numel())
        print(f"\n[accept] {label} P(accepted >= {i}): empirical {emp:.4f} theory {theory:.4f} "
              f"z={z:.2f}")
        assert z < 4.5


@pytest.mark.parametrize("mixed", [False, True])
def test_lossless_with_seeded_rows(mixed):
    """Every row seeded (seeds 0..N-1), or every other row unseeded: each emitted position
    follows p (chi-square alpha 1e-3, over all rows and over the seeded rows alone); the
    seeded rows accept at the coupled rate (:func:`coupled_acceptance`), the unseeded ones at
    rejection sampling's sum(min(p, q))."""
    sp = lambda i: SamplingParams(temperature=1.0,  # noqa: E731
                                  seed=None if mixed and i % 2 else 10**6 + i)
    acc, out = seeded_chain(P.log(), Q, sp)
    seeded = torch.arange(N) % 2 == 0 if mixed else torch.ones(N, dtype=torch.bool)
    for label, rows in [("all rows", torch.ones(N, dtype=torch.bool)), ("seeded rows", seeded)]:
        assert_fits(f"seeded{' mixed' if mixed else ''}, {label}: first token vs p_1",
                    out[rows, 0], P[0])
        for i in (1, 2, 3):
            kept = rows & (acc >= i)
            assert_fits(f"seeded, {label}: token {i + 1} vs p_{i + 1}", out[kept, i], P[i])
    _check_acceptance("seeded (coupled)", acc[seeded], coupled_acceptance(P[:3], Q))
    if mixed:
        _check_acceptance("unseeded (rejection)", acc[~seeded], torch.minimum(P[:3], Q).sum(-1))


def test_seeded_verify_emits_the_targets_own_draws():
    """Whatever the drafts and q, a seeded row emits argmax(p_i / E_i) with E_i keyed by its
    position: drafts equal to those draws are all accepted, a wrong one stops there and the
    target's draw replaces it; the same draws as sample() at each position (plain decoding)."""
    n, k = 64, 3
    g = gen(80)
    logits = torch.randn(n, k + 1, V, generator=g) * 2
    bs = BatchSampling.from_params(_params(range(500, 500 + n)))
    pos = torch.randint(5, 900, (n,), generator=g)
    own = torch.stack([sample(logits[:, i], bs, None, pos + i) for i in range(k + 1)], 1)
    acc, out = speculative_accept(own[:, :k].clone(), None, logits, bs, None, pos)
    assert (acc == k).all() and torch.equal(out, own)
    wrong = own[:, :k].clone()
    wrong[:, 1] = (wrong[:, 1] + 1) % V
    q = torch.softmax(torch.randn(n, k, V, generator=g), -1)
    acc, out = speculative_accept(wrong, q, logits, bs, gen(81), pos)
    assert (acc == 1).all() and torch.equal(out[:, :2], own[:, :2]) and (out[:, 2:] == -1).all()


def test_seeded_sample_with_top_k_fits_target_probs():
    row = torch.tensor([2.0, 0.0, 1.0, -1.0, 1.5, 0.5])
    bs = BatchSampling.from_params(_params(range(N), temperature=0.8, top_k=4))
    tokens = sample(row.expand(N, V), bs, None, torch.arange(N) % 7)
    expected = target_probs(row.view(1, 1, V), BatchSampling.from_params(_params([0], 0.8,
                                                                               top_k=4)))
    assert_fits("seeded sample() T=0.8 top_k=4", tokens, expected.view(V))


def test_engine_lossless_with_one_seed_per_request():
    """tests/test_engine_sampling.py's end-to-end check with seeds 1234 + i: N requests with the
    same prompt and distinct seeds are N independent samples of the target (chi-square on the
    2nd and 3rd tokens). With one shared seed they would all be the same completion."""
    target, drafter = tiny_model(0, layers=2), tiny_model(1, layers=1)
    sp = {"temperature": 1.0, "max_new_tokens": 3}
    m2, m3 = exact_marginals(target, sp)
    with Engine.from_modules(target, drafter, speculative_adaptive=False,
                             speculative_num_steps=2, max_running_requests=N_ENGINE,
                             kv_cache_tokens=N_ENGINE * 8, page_size=8) as eng:
        out = eng.generate(input_ids=[PROMPT] * N_ENGINE,
                           sampling_params=[{**sp, "seed": 1234 + i} for i in range(N_ENGINE)])
        same = eng.generate(input_ids=[PROMPT] * 8, sampling_params={**sp, "seed": 77})
    ids = np.array([o["output_ids"] for o in out])
    assert sum(o["meta_info"]["spec_verify_ct"] for o in out) < 2 * N_ENGINE
    s2 = chi2(np.bincount(ids[:, 1], minlength=V8), m2)
    s3 = chi2(np.bincount(ids[:, 2], minlength=V8), m3)
    print(f"\n[chi2] engine, one seed per request (N={N_ENGINE}, df=7, "
          f"crit={CRITICAL_DF7_ALPHA_1E3}): token 2 {s2:.2f}, token 3 {s3:.2f}")
    assert s2 < CRITICAL_DF7_ALPHA_1E3 and s3 < CRITICAL_DF7_ALPHA_1E3
    assert len({tuple(o["output_ids"]) for o in same}) == 1


def test_coupled_draws_in_column_chunks_equal_one_chunk(monkeypatch):
    """Large S x (k + 1) x V is hashed a few columns at a time: same draws."""
    import specdial.worker.sampling as sampling_module

    n, k = 8, 5
    logits = torch.randn(n, k + 1, V, generator=gen(90))
    bs = BatchSampling.from_params(_params([3 * i if i % 2 else None for i in range(n)]))
    pos = torch.arange(n) * 11
    drafts = torch.randint(0, V, (n, k), generator=gen(91))
    whole = speculative_accept(drafts, None, logits, bs, gen(92), pos)
    monkeypatch.setattr(sampling_module, "_COUPLED_NOISE_ELEMENTS", 2 * 4 * V)  # 2 columns
    chunked = speculative_accept(drafts, None, logits, bs, gen(92), pos)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
