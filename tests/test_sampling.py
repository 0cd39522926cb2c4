"""Token selection: SamplingParams validation, logits processing, greedy and lossless acceptance.

The lossless tests (docs/design.md invariant 2) are chi-square goodness-of-fit tests at
alpha = 1e-3 on a 6-token vocabulary, with fixed seeds (so deterministic). Critical values of the
chi-square distribution are hard-coded from the table and cross-checked against the regularized
upper incomplete gamma function (torch.special.gammaincc); p-values use the same function.
With about 40 such assertions a correct implementation fails one for a given seed set with
probability about 4 %; a failure after a seed change is a false alarm only if a much larger
sample (millions of rows) shows no deviation.
"""

import math

import pytest
import torch

from specdial.worker.sampling import (
    MIN_TEMPERATURE,
    BatchSampling,
    SamplingParams,
    sample,
    sample_from_probs,
    speculative_accept,
    target_probs,
)

ALPHA = 1e-3
# Upper 1e-3 critical values of chi-square by degrees of freedom (standard table).
CRIT = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}
N = 40_000
V = 6


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df) = Q(df / 2, stat / 2)."""
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                   torch.tensor(stat / 2, dtype=torch.float64)).item()


def chi2(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """Goodness of fit of ``tokens`` (1-D) to ``probs`` [V]; zero-probability cells must be empty.

    Returns (statistic, degrees of freedom, p-value).
    """
    probs = probs.double() / probs.double().sum()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"tokens outside the support: {counts.tolist()}"
    expected = tokens.numel() * probs[support]
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    df = int(support.sum()) - 1
    return stat, df, chi2_sf(stat, df)


def assert_fits(label: str, tokens: torch.Tensor, probs: torch.Tensor) -> float:
    stat, df, pval = chi2(tokens, probs)
    print(f"\n[chi2] {label}: n={tokens.numel()} df={df} stat={stat:.2f} "
          f"crit(alpha={ALPHA})={CRIT[df]} p={pval:.3g}")
    assert stat < CRIT[df], f"{label}: chi2 {stat:.2f} >= {CRIT[df]} (df={df}, p={pval:.3g})"
    return stat


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_chi2_table_matches_gammaincc():
    for df, crit in CRIT.items():
        assert chi2_sf(crit, df) == pytest.approx(ALPHA, rel=2e-3)


# ---------------------------------------------------------------------------------------------
# SamplingParams


BAD_VALUES = [
    ("max_new_tokens", [0, -1, 1.5, True, "3", None]),
    ("temperature", [-0.1, MIN_TEMPERATURE / 10, float("nan"), float("inf"), True, "0.5", None,
                     3.5e38, 1e39, 1e308]),  # above float32's largest finite value
    ("top_p", [0, 0.0, -0.1, 1.01, float("nan"), True, "1", None]),
    ("top_k", [-2, 1.0, True, "5", None]),
    ("stop_token_ids", [[1, -1], [1.0], [True], 5, "12", None, {1: 2}]),
    ("ignore_eos", [1, 0, "true", None]),
    ("seed", [-1, 2**64, 1.0, True, "7"]),
]


@pytest.mark.parametrize("field,value",
                         [(f, v) for f, values in BAD_VALUES for v in values],
                         ids=lambda x: repr(x))
def test_params_bad_value_names_field(field, value):
    for build in (lambda: SamplingParams.from_dict({field: value}),
                  lambda: SamplingParams(**{field: value})):
        with pytest.raises(ValueError) as err:
            build()
        msg = str(err.value)
        assert f"SamplingParams.{field}" in msg and repr(value) in msg and "allowed" in msg


def test_params_unknown_key_and_non_dict():
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict({"temperature": 0.5, "temprature": 0.5})
    msg = str(err.value)
    assert "'temprature'" in msg
    for name in ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                 "ignore_eos", "seed"):
        assert name in msg
    with pytest.raises(ValueError):
        SamplingParams.from_dict([("temperature", 0.5)])


def test_params_defaults_and_normalization():
    d = SamplingParams.from_dict(None)
    assert d == SamplingParams.from_dict({}) == SamplingParams()
    assert (d.max_new_tokens, d.temperature, d.top_p, d.top_k, d.stop_token_ids, d.ignore_eos,
            d.seed) == (128, 0.0, 1.0, -1, (), False, None)
    assert d.is_greedy
    p = SamplingParams.from_dict({"temperature": 1, "top_p": 1, "top_k": 0,
                                  "stop_token_ids": [2, 7], "ignore_eos": True,
                                  "seed": 2**64 - 1, "max_new_tokens": 1})
    assert isinstance(p.temperature, float) and p.temperature == 1.0
    assert isinstance(p.top_p, float)
    assert p.stop_token_ids == (2, 7) and not p.is_greedy
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE
    hash(p)  # frozen and hashable
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]


def test_batch_sampling_from_params_and_select():
    params = [SamplingParams(), SamplingParams(temperature=0.5, top_k=3),
              SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(top_k=5, top_p=0.5)]
    bs = BatchSampling.from_params(params, "cpu")
    assert bs.temperature.dtype == torch.float32 and bs.top_p.dtype == torch.float32
    assert bs.top_k.dtype == torch.int64 and bs.greedy_mask.dtype == torch.bool
    assert bs.greedy_mask.tolist() == [True, False, False, True]
    assert (bs.all_greedy, bs.any_top_k, bs.any_top_p) == (False, True, True)
    sub = bs.select(torch.tensor([3, 0]))
    assert sub.greedy_mask.tolist() == [True, True] and sub.top_k.tolist() == [5, -1]
    # greedy rows' top-k / top-p do not count: nothing to filter
    assert (sub.all_greedy, sub.any_top_k, sub.any_top_p) == (True, False, False)
    sub = bs.select(torch.tensor([2]))
    assert (sub.all_greedy, sub.any_top_k, sub.any_top_p) == (False, False, True)
    assert sub.batch_size == 1


# ---------------------------------------------------------------------------------------------
# target_probs / sample


def hand_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Reference for one row [V], written out step by step (temperature, top-k, top-p)."""
    x = logits.double().tolist()
    if temperature == 0:
        out = [0.0] * len(x)
        out[max(range(len(x)), key=lambda i: (x[i], -i))] = 1.0
        return torch.tensor(out)
    x = [v / temperature for v in x]
    keep = set(range(len(x)))
    if 0 < top_k < len(x):
        kth = sorted(x, reverse=True)[top_k - 1]
        keep = {i for i in keep if x[i] >= kth}
    z = sum(math.exp(x[i]) for i in keep)
    p = {i: math.exp(x[i]) / z for i in keep}
    if top_p < 1:
        order = sorted(keep, key=lambda i: (-p[i], i))
        kept, mass = [], 0.0
        for i in order:
            kept.append(i)
            mass += p[i]
            if mass >= top_p:
                break
        keep = set(kept)
    z = sum(p[i] for i in keep)
    return torch.tensor([p[i] / z if i in keep else 0.0 for i in range(len(x))])


def probs_of(logits_row, **kw) -> torch.Tensor:
    bs = BatchSampling.from_params([SamplingParams(**kw)])
    return target_probs(torch.tensor(logits_row, dtype=torch.float32)[None, None], bs)[0, 0]


def test_temperature():
    got = probs_of([1.0, 2.0, 3.0], temperature=0.5)
    torch.testing.assert_close(got, torch.tensor([2.0, 4.0, 6.0]).softmax(-1))
    torch.testing.assert_close(probs_of([1.0, 2.0, 3.0], temperature=1.0),
                               torch.tensor([1.0, 2.0, 3.0]).softmax(-1))


def test_top_k():
    got = probs_of([0.1, 3.0, 2.0, -1.0, 0.5], temperature=1.0, top_k=2)
    exp = torch.tensor([3.0, 2.0]).softmax(-1)
    torch.testing.assert_close(got, torch.tensor([0.0, exp[0], exp[1], 0.0, 0.0]))
    assert (got[[0, 3, 4]] == 0).all()
    # top_k >= V and top_k off keep everything
    full = torch.tensor([0.1, 3.0, 2.0, -1.0, 0.5]).softmax(-1)
    for k in (5, 100, 0, -1):
        torch.testing.assert_close(probs_of([0.1, 3.0, 2.0, -1.0, 0.5], temperature=1.0,
                                            top_k=k), full)
    # ties at the k-th value are all kept
    got = probs_of([1.0, 1.0, 1.0, 0.0], temperature=1.0, top_k=2)
    torch.testing.assert_close(got, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0]))


@pytest.mark.parametrize("top_p,kept", [(5e-324, [1]), (1e-46, [1]), (1e-40, [1]),
                                        (1e-6, [1]), (0.45, [1]), (0.75, [1, 3]),
                                        (0.9, [1, 3, 0]), (0.99, [1, 3, 0, 2]),
                                        (1.0, [1, 3, 0, 2])])
def test_top_p_smallest_prefix(top_p, kept):
    # vocabulary order deliberately not sorted: token 1 is the most likely
    p = torch.tensor([0.15, 0.5, 0.05, 0.3])
    got = probs_of(p.log().tolist(), temperature=1.0, top_p=top_p)
    exp = torch.zeros(4)
    exp[kept] = p[kept] / p[kept].sum()
    torch.testing.assert_close(got, exp)


def test_top_p_below_float32_keeps_the_most_likely_token():
    """Issue 12: a top_p in (0, 1] that rounds to 0.0 in float32 (below ~1.4e-45) once masked
    every token and sampled token 0; it must keep the most likely token, as any top_p does."""
    logits = torch.tensor([[0.5, 3.0, 1.0, 2.0]]).expand(64, 4)
    for top_p in (5e-324, 1e-46):
        params = SamplingParams(temperature=1.0, top_p=top_p)
        assert BatchSampling.from_params([params]).top_p.item() == 0.0  # the float32 underflow
        bs = BatchSampling.from_params([params] * 64)
        assert (sample(logits, bs, gen(1)) == 1).all()
        seeded = BatchSampling.from_params([SamplingParams(temperature=1.0, top_p=top_p,
                                                           seed=s) for s in range(64)])
        assert (sample(logits, seeded, None, torch.arange(64)) == 1).all()


def test_temperature_at_the_float32_limit_is_accepted():
    t = float(torch.finfo(torch.float32).max)
    assert SamplingParams(temperature=t).temperature == t
    probs = probs_of([1.0, 2.0, 3.0], temperature=t)
    assert torch.isfinite(probs).all() and probs.sum().item() == pytest.approx(1.0)


def test_order_temperature_then_top_k_then_top_p():
    logp = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # top-k first: [4/7, 3/7] -> top_p = 0.5 keeps only token 0 (top-p first would keep 0, 1)
    got = probs_of(logp.tolist(), temperature=1.0, top_k=2, top_p=0.5)
    torch.testing.assert_close(got, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    # temperature before top-p: at T = 2 the mass before token 2 is 0.607 < 0.65 -> 3 kept
    # (at T = 1 it would be 0.7 -> 2 kept)
    got = probs_of(logp.tolist(), temperature=2.0, top_p=0.65)
    exp = (logp[:3] / 2).softmax(-1)
    torch.testing.assert_close(got, torch.cat([exp, torch.zeros(1)]))


def test_batch_rows_independent_and_match_reference():
    g = gen(3)
    params = [SamplingParams(),
              SamplingParams(temperature=0.7, top_k=3),
              SamplingParams(temperature=1.3, top_p=0.8),
              SamplingParams(temperature=0.9, top_k=5, top_p=0.6),
              SamplingParams(temperature=2.0),
              SamplingParams(temperature=0.5, top_k=1),
              SamplingParams(top_k=2, top_p=0.3),  # greedy: filters ignored
              SamplingParams(temperature=1.0, top_k=50, top_p=0.999)]
    logits = torch.randn(len(params), 3, 9, generator=g) * 2
    got = target_probs(logits, BatchSampling.from_params(params))
    assert got.shape == logits.shape and got.dtype == torch.float32
    for b, sp in enumerate(params):
        for i in range(3):
            exp = hand_probs(logits[b, i], sp.temperature, sp.top_k, sp.top_p)
            torch.testing.assert_close(got[b, i], exp.float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.sum(-1), torch.ones(len(params), 3))
    # greedy rows: exact one-hot at the argmax
    assert torch.equal(got[0], torch.nn.functional.one_hot(logits[0].argmax(-1), 9).float())


def test_sample_greedy_topk1_and_distribution():
    g = gen(5)
    logits = torch.randn(4, 7, generator=g)
    bs = BatchSampling.from_params([SamplingParams(), SamplingParams(temperature=0.8, top_k=1),
                                    SamplingParams(), SamplingParams(temperature=0.8, top_k=1)])
    assert torch.equal(sample(logits, bs, g), logits.argmax(-1))
    # all-greedy draws nothing from the generator
    state = g.get_state()
    sample(logits, BatchSampling.from_params([SamplingParams()] * 4), g)
    assert torch.equal(state, g.get_state())
    # sampling rows follow target_probs
    sp = SamplingParams(temperature=0.8, top_k=5)
    row = torch.tensor([0.3, -1.0, 1.2, 0.0, 0.7, 2.0])
    tokens = sample(row.expand(N, V), BatchSampling.from_params([sp] * N), gen(6))
    assert tokens.dtype == torch.int64 and tokens.shape == (N,)
    assert_fits("sample() T=0.8 top_k=5", tokens, hand_probs(row, 0.8, 5, 1.0))


def test_sample_from_probs_unnormalized_weights():
    w = torch.tensor([0.0, 2.0, 0.0, 6.0, 2.0, 0.0])
    tokens = sample_from_probs(w.expand(N, V), gen(7))
    assert_fits("sample_from_probs weights", tokens, w)


# ---------------------------------------------------------------------------------------------
# greedy acceptance (docs/design.md invariant 1)


def logits_with_argmax(argmax: list[int], vocab: int = V, seed: int = 0) -> torch.Tensor:
    """[len(argmax), V] random logits whose argmax at row i is argmax[i] (margin >= 1)."""
    x = torch.randn(len(argmax), vocab, generator=gen(seed))
    x[torch.arange(len(argmax)), argmax] = x.max() + 1.0
    return x


def test_greedy_accept_hand_cases():
    target = logits_with_argmax([2, 4, 1, 3])  # positions 0..k, k = 3
    drafts = torch.tensor([[2, 4, 1],   # all accepted -> bonus = argmax at position 3
                           [2, 5, 1],   # mismatch at 1 -> correction 4
                           [0, 4, 1],   # mismatch at 0 -> correction 2
                           [2, 4, 0]])  # mismatch at 2 -> correction 1
    bs = BatchSampling.from_params([SamplingParams()] * 4)
    garbage_q = torch.full((4, 3, V), float("nan"))  # ignored on greedy rows
    for q in (None, garbage_q):
        acc, out = speculative_accept(drafts, q, target.expand(4, 4, V), bs, gen(0))
        assert acc.dtype == torch.int64 and out.dtype == torch.int64
        assert acc.tolist() == [3, 1, 0, 2]
        assert out.tolist() == [[2, 4, 1, 3], [2, 4, -1, -1], [2, -1, -1, -1], [2, 4, 1, -1]]


def test_greedy_k0_plain_decoding():
    target = torch.stack([logits_with_argmax([5], seed=1), logits_with_argmax([0], seed=2)])
    empty = torch.empty(2, 0, dtype=torch.int64)
    for params in ([SamplingParams()] * 2, [SamplingParams(), SamplingParams(temperature=1.0)]):
        acc, out = speculative_accept(empty, None, target, BatchSampling.from_params(params),
                                      gen(0))
        assert acc.tolist() == [0, 0] and out.shape == (2, 1)
        assert out[0].tolist() == [5] and 0 <= out[1, 0] < V
    # k = 0 with sampling: the single token follows p
    sp = SamplingParams(temperature=1.0)
    p = torch.tensor([0.1, 0.2, 0.3, 0.05, 0.05, 0.3])
    acc, out = speculative_accept(torch.empty(N, 0, dtype=torch.int64), None,
                                  p.log().expand(N, 1, V), BatchSampling.from_params([sp] * N),
                                  gen(11))
    assert (acc == 0).all()
    assert_fits("k=0 sampling", out[:, 0], p)


def test_mixed_greedy_and_sampling_batch():
    k = 3
    greedy_target = logits_with_argmax([2, 4, 1, 3])
    # sampling row whose target puts all mass (after softmax) on the drafts and then on token 5
    sure = torch.full((k + 1, V), -60.0)
    sure[torch.arange(k + 1), torch.tensor([0, 1, 2, 5])] = 60.0
    target = torch.stack([greedy_target, sure, greedy_target, torch.randn(k + 1, V)])
    drafts = torch.tensor([[2, 5, 1], [0, 1, 2], [2, 4, 1], [3, 3, 3]])
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(),
              SamplingParams(temperature=0.7, top_k=3, top_p=0.9)]
    bs = BatchSampling.from_params(params)
    q = torch.full((4, k, V), 1.0 / V)
    for draft_probs in (None, q):
        acc, out = speculative_accept(drafts, draft_probs, target, bs, gen(1))
        assert acc[:3].tolist() == [1, 3, 3]
        assert out[:3].tolist() == [[2, 4, -1, -1], [0, 1, 2, 5], [2, 4, 1, 3]]
        assert 0 <= acc[3] <= k
        n = int(acc[3]) + 1
        assert out[3, :int(acc[3])].tolist() == [3] * int(acc[3])
        assert 0 <= out[3, n - 1] < V and (out[3, n:] == -1).all()
    # greedy rows give the same answer alone as in the mixed batch
    alone = BatchSampling.from_params([params[0]])
    acc0, out0 = speculative_accept(drafts[:1], None, target[:1], alone, gen(9))
    assert acc0.tolist() == [1] and out0.tolist() == [[2, 4, -1, -1]]


def test_reproducible_with_generator():
    g = gen(0)
    target = torch.randn(64, 4, V, generator=g)
    q = torch.randn(64, 3, V, generator=g).softmax(-1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(64, 3)
    bs = BatchSampling.from_params([SamplingParams(temperature=0.9, top_p=0.95)] * 64)
    a = speculative_accept(drafts, q, target, bs, gen(42))
    b = speculative_accept(drafts, q, target, bs, gen(42))
    c = speculative_accept(drafts, q, target, bs, gen(43))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])


def test_shape_errors():
    bs = BatchSampling.from_params([SamplingParams()] * 2)
    d = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="target_logits"):
        speculative_accept(d, None, torch.zeros(2, 3, V), bs, None)
    with pytest.raises(ValueError, match="draft_probs"):
        speculative_accept(d, torch.zeros(2, 3, V + 1), torch.zeros(2, 4, V), bs, None)
    with pytest.raises(ValueError, match="draft_tokens"):
        speculative_accept(d.int(), None, torch.zeros(2, 4, V), bs, None)
    with pytest.raises(ValueError, match="sampling"):
        speculative_accept(d[:1], None, torch.zeros(1, 4, V), bs, None)
    with pytest.raises(ValueError, match="target_probs"):
        target_probs(torch.zeros(3, 1, V), bs)


def test_empty_residual_falls_back_to_p():
    """q = 2 p (not a distribution): rejection has residual max(0, p - q) = 0 -> sample from p."""
    sp = SamplingParams(temperature=1.0, top_k=3)
    logits = torch.tensor([2.0, 0.0, 1.0, -1.0, 1.5, 0.5])
    bs = BatchSampling.from_params([sp] * N)
    p = target_probs(logits.expand(N, 2, V).contiguous(), bs)
    drafts = torch.multinomial(p[:, 0], 1, generator=gen(2))
    acc, out = speculative_accept(drafts, 2 * p[:, :1], logits.expand(N, 2, V), bs, gen(3))
    rejected = acc == 0
    assert 0.45 < rejected.float().mean() < 0.55  # accept probability p / 2p
    assert_fits("empty residual -> p", out[rejected, 0], p[0, 0])


# ---------------------------------------------------------------------------------------------
# lossless sampling (docs/design.md invariant 2)

P = torch.tensor([[0.30, 0.25, 0.20, 0.12, 0.08, 0.05],
                  [0.05, 0.40, 0.05, 0.30, 0.10, 0.10],
                  [0.10, 0.10, 0.30, 0.10, 0.30, 0.10],
                  [0.25, 0.05, 0.05, 0.25, 0.15, 0.25]])  # p_1..p_4 (k = 3 plus the bonus)
Q = torch.tensor([[0.05, 0.10, 0.15, 0.20, 0.25, 0.25],
                  [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
                  [0.10, 0.20, 0.20, 0.20, 0.20, 0.10]])  # q_1..q_3, different from p


def draw_drafts(q: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    """[n, k] draft tokens, column i sampled from q[i] (or from q[b, i] if q is [n, k, V])."""
    if q.dim() == 2:
        return torch.multinomial(q, n, replacement=True, generator=g).T.contiguous()
    return torch.multinomial(q.reshape(-1, q.shape[-1]), 1, generator=g).view(q.shape[:2])


def run_accept(p_logits, q, params, seed, pass_q=True, n=N):
    """speculative_accept on n independent rows sharing target logits [k+1, V] and q [k, V]."""
    g = gen(seed)
    k = p_logits.shape[0] - 1
    drafts = draw_drafts(q, n, g)
    draft_probs = q.expand(n, k, V) if pass_q else None
    bs = BatchSampling.from_params([params] * n)
    return speculative_accept(drafts, draft_probs, p_logits.expand(n, k + 1, V), bs, g)


def reference_accept(p, q, seed, resample="residual", n=N):
    """Test-local Leviathan/Chen acceptance; ``resample="target"`` is the WRONG rule that
    resamples a rejected position from p instead of norm(max(0, p - q)). Returns the first
    emitted token per row."""
    g = gen(seed)
    k = q.shape[0]
    drafts = draw_drafts(q, n, g)
    pos = torch.arange(k)
    p_x, q_x = p[pos, drafts], q[pos, drafts]  # [n, k]
    u = torch.rand(n, k, generator=g)
    accepted = (u * q_x < p_x).long().cumprod(-1).sum(-1)
    q_pad = torch.cat([q, torch.zeros(1, V)])
    if resample == "residual":
        dist = (p[accepted] - q_pad[accepted]).clamp_min(0)
    else:
        dist = p[accepted]
    last = torch.multinomial(dist, 1, generator=g).squeeze(1)
    return torch.where(accepted > 0, drafts[:, 0], last)


def test_lossless_per_position_and_acceptance_rate():
    sp = SamplingParams(temperature=1.0)
    acc, out = run_accept(P.log(), Q, sp, seed=100)
    assert_fits("first token vs p_1", out[:, 0], P[0])
    # position i+1 given the first i drafts were accepted: the target distribution there does
    # not depend on earlier tokens (fixed logits), so the emitted token must follow p_{i+1}
    for i in (1, 2, 3):
        rows = acc >= i
        label = "bonus vs p_4 | all 3 accepted" if i == 3 else f"token {i + 1} vs p_{i + 1}"
        assert_fits(label, out[rows, i], P[i])
    # the padding after the emitted tokens
    pos = torch.arange(4)
    assert ((out == -1) == (pos > acc[:, None])).all()
    # acceptance rates match theory: P(accepted >= i) = prod_{j <= i} sum_x min(p_j, q_j)
    a = torch.minimum(P[:3], Q).sum(-1)
    for i in (1, 2, 3):
        theory = a[:i].prod().item()
        emp = (acc >= i).double().mean().item()
        z = abs(emp - theory) / math.sqrt(theory * (1 - theory) / N)
        print(f"\n[accept] P(accepted >= {i}): empirical {emp:.4f} theory {theory:.4f} z={z:.2f}")
        assert z < 4.5


def test_wrong_resampling_rule_fails_same_test():
    """The test has power: resampling from p instead of norm(max(0, p - q)) is caught."""
    good = reference_accept(P, Q, seed=200, resample="residual")
    assert_fits("reference rule, first token vs p_1", good, P[0])
    bad = reference_accept(P, Q, seed=200, resample="target")
    stat, df, pval = chi2(bad, P[0])
    print(f"\n[chi2] WRONG rule (resample from p), first token vs p_1: n={N} df={df} "
          f"stat={stat:.2f} crit={CRIT[df]} p={pval:.3g}")
    assert stat > CRIT[df]


def test_lossless_second_emitted_token_over_two_iterations():
    """Context-independent p (same at every position): the second emitted token, whether it
    comes from this verify or (after a rejection at position 0) from the next one, follows p."""
    sp = SamplingParams(temperature=1.0)
    p_logits = P[0].log().expand(4, V)
    q = Q[0].expand(3, V)
    acc, out = run_accept(p_logits, q, sp, seed=310)
    _, out_next = run_accept(p_logits, q, sp, seed=311)
    second = torch.where(acc >= 1, out[:, 1], out_next[:, 0])
    assert_fits("first token, same p everywhere", out[:, 0], P[0])
    assert_fits("second emitted token (two iterations)", second, P[0])


@pytest.mark.parametrize("pass_q", [True, False], ids=["q_given", "q_none"])
def test_lossless_greedy_drafter_and_none_q(pass_q):
    """A deterministic drafter (draft = argmax q) with q one-hot, or a sampled draft with
    draft_probs=None: both keep the output distribution equal to p."""
    sp = SamplingParams(temperature=1.0)
    if pass_q:
        q = torch.nn.functional.one_hot(Q.argmax(-1), V).float()
        label = "one-hot drafter"
    else:
        q = Q
        label = "sampled drafts, draft_probs=None"
    acc, out = run_accept(P.log(), q, sp, seed=400, pass_q=pass_q)
    assert_fits(f"{label}: first token vs p_1", out[:, 0], P[0])
    assert_fits(f"{label}: token 2 vs p_2", out[acc >= 1, 1], P[1])
    # acceptance at position 1 is sum_x q(x) p(x) in both cases
    theory = (Q[0] * P[0]).sum().item() if not pass_q else P[0, Q[0].argmax()].item()
    emp = (acc >= 1).double().mean().item()
    assert abs(emp - theory) < 4.5 * math.sqrt(theory * (1 - theory) / N)


@pytest.mark.parametrize("kw", [dict(temperature=0.7, top_k=4),
                                dict(temperature=1.5, top_p=0.8),
                                dict(temperature=0.9, top_k=5, top_p=0.9)],
                         ids=["T0.7_topk4", "T1.5_topp0.8", "T0.9_topk5_topp0.9"])
def test_lossless_processed_distribution(kw):
    """p is the processed target distribution (checked against the hand reference); the
    drafter samples from its own logits under the same processing."""
    sp = SamplingParams(**kw)
    g = gen(500)
    k = 2
    target = torch.randn(k + 1, V, generator=g) * 1.5
    draft_logits = torch.randn(k, V, generator=g) * 1.5
    q = target_probs(draft_logits[None], BatchSampling.from_params([sp]))[0]
    p = torch.stack([hand_probs(target[i], sp.temperature, sp.top_k, sp.top_p)
                     for i in range(k + 1)])
    acc, out = run_accept(target, q, sp, seed=501)
    assert_fits(f"{kw}: first token vs processed p_1", out[:, 0], p[0])
    assert_fits(f"{kw}: token 2 vs processed p_2", out[acc >= 1, 1], p[1])
    assert_fits(f"{kw}: bonus vs processed p_3", out[acc == 2, 2], p[2])
