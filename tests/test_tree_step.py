"""The worker's draft-tree iteration (issue 29) end to end on tiny models, driven by a
plan-like :class:`TreePlan` from a small slot allocator standing in for the scheduler: greedy
tokens equal target-only greedy for the draft model and EAGLE, across tree-shape changes, and
after the iterations the target's KV (the draft model's KV, EAGLE's features) at the chain
slots equals a fresh prefill of the emitted tokens (the accepted path's KV was copied from the scratch slots)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import PROMPTS
from specdial.attention import TorchAttentionBackend
from specdial.models.batch import ForwardBatch
from specdial.worker.batch_sampling import BatchSampling
from specdial.worker.drafters import make_drafter
from specdial.worker.inputs import DecodeInput, PrefillInput
from specdial.worker.logprobs import LogprobRows
from specdial.worker.sampling_params import SamplingParams
from specdial.worker.tree_step import TreePlan
from specdial.worker.worker import SpecWorker

NEW = 20
SLOTS = 1024
SHAPES = [(2, 3, 4), (4, 3, 8), (1, 3, 3), (3, 4, 12), (8, 2, 8), (2, 7, 12), (4, 4, 8),
          (3, 1, 3), (5, 5, 40)]


def greedy(b):
    return BatchSampling.from_params([SamplingParams()] * b)


class Slots:
    """The scheduler's part: a free list and each request's position -> slot list."""

    def __init__(self, n):
        self.free = list(range(n))[::-1]

    def take(self, n):
        return [self.free.pop() for _ in range(n)]

    def give(self, slots):
        self.free.extend(slots)


def reference_greedy(target, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        logits = _forward(target, seq)[0][-1]
        seq.append(int(logits.argmax()))
    return seq[len(prompt):]


def _forward(model, seq, pool=None):
    t = len(seq)
    pool = pool if pool is not None else model.make_kv_pool(t)
    idx = torch.arange(t)
    meta = TorchAttentionBackend().plan(torch.tensor([t]), torch.tensor([t]), idx)
    h = model(ForwardBatch(torch.tensor(seq), idx, idx, meta), pool, TorchAttentionBackend())
    return model.compute_logits(h), h


def assert_target_greedy_and_chain_kv(target, worker, chain, out, prompts=PROMPTS):
    """Each request's tokens ``out[r]`` are the target's greedy ones and the target KV at its
    chain slots ``chain[r]`` equals a fresh prefill of its sequence (tolerance: float32)."""
    for r, prompt in enumerate(prompts):
        assert out[r] == reference_greedy(target, prompt, len(out[r]))
        seq = list(prompt) + out[r][:-1]
        fresh = target.make_kv_pool(len(seq))
        _forward(target, seq, fresh)
        torch.testing.assert_close(worker.kv.k_buffer[:, torch.tensor(chain[r])],
                                   fresh.k_buffer[:, :len(seq)], atol=2e-5, rtol=1e-4)


def run(target, module, shapes, sampling=None, logprobs=None, prompts=PROMPTS, new_tokens=NEW,
        min_survival=0.0, verified=None, accepted=None, **worker_options):
    """Prefill, then tree iterations of ``shapes`` (None: plain decoding, steps 0, through
    ``SpecWorker.decode``) until every request has ``NEW`` tokens. ``worker_options``: more
    :class:`SpecWorker` keywords (CUDA graphs: tests/test_tree_graphs.py). ``min_survival``:
    the plans' per-request node threshold (tests/test_tree_budget.py); ``verified``: a list
    each tree iteration's ``(N, kept nodes [B])`` is appended to; ``accepted``: a list each tree
    iteration's accepted drafts ``[B]`` are appended to."""
    sampling = sampling or greedy(len(prompts))
    drafter = make_drafter(module, target, max_steps=7)
    slots = max(SLOTS, 96 * len(prompts))
    worker = SpecWorker(target, drafter, slots, max_running_requests=len(prompts),
                        context_length=96, step_values=range(8), **worker_options)
    alloc = Slots(slots)
    b = len(prompts)
    chain = [alloc.take(len(p)) for p in prompts]
    lens = np.array([len(p) for p in prompts], np.int64)
    inp = PrefillInput(np.arange(b), np.concatenate(prompts).astype(np.int64),
                       np.concatenate(chain).astype(np.int64), lens, lens.copy(),
                       np.ones(b, np.int64), np.cumsum(lens) - 1)
    with torch.inference_mode():
        first = worker.prefill(inp, sampling, None)
        out = [[int(t)] for t in first.tokens]
        lps = [[] for _ in range(b)]
        it = 0
        while min(len(o) for o in out) < new_tokens:
            k, d, n = shapes[it % len(shapes)] if shapes else (1, 0, 0)
            L = np.array([len(c) for c in chain], np.int64)
            new = [alloc.take(d + 1) for _ in range(b)]
            scratch = [alloc.take(n) for _ in range(b)]
            extra = [alloc.take(k * (d - 1)) for _ in range(b)] if k * (d - 1) > n else None
            if d == 0:
                plan = DecodeInput(0, None, np.arange(b), np.array([o[-1] for o in out]), L,
                                   np.concatenate(new).astype(np.int64), np.zeros(b, np.int64))
                scratch = [[] for _ in range(b)]
            else:
                plan = TreePlan(np.arange(b), np.array([o[-1] for o in out], np.int64), L,
                            np.concatenate(new).astype(np.int64),
                                np.concatenate(scratch).astype(np.int64), d, k, n,
                                None if extra is None
                                else np.concatenate(extra).astype(np.int64),
                                min_survival=min_survival)
            res = worker.decode(plan, sampling, None, logprobs)
            if verified is not None and d:
                verified.append((n, res.verified))
            if accepted is not None and d:
                accepted.append(np.asarray(res.accepted))
            for r in range(b):
                a = int(res.accepted[r])
                out[r].extend(res.tokens_of(r).tolist())
                if logprobs is not None and r in logprobs.rows_np:
                    i = int(np.searchsorted(logprobs.rows_np, r))
                    lps[r].extend(res.logprobs.logprob[i, : a + 1].tolist())
                chain[r].extend(new[r][: a + 1])
                alloc.give(new[r][a + 1:] + scratch[r] + (extra[r] if extra else []))
            it += 1
    return worker, chain, out, lps


@pytest.mark.parametrize("name", ["draft", "eagle"])
def test_tree_iterations_give_target_greedy_and_chain_kv(request, name):
    fx = request.getfixturevalue("tiny" if name == "draft" else "tiny1")
    target = fx.target
    module = fx.draft_noisy if name == "draft" else fx.eagle_noisy
    accepted = []
    worker, chain, out, _ = run(target, module, SHAPES, accepted=accepted)
    # tree iterations accepted drafts (every request emits its NEW tokens either way)
    assert sum(int(a.sum()) for a in accepted) > 0
    for r, prompt in enumerate(PROMPTS):
        want = reference_greedy(target, prompt, len(out[r]))
        assert out[r] == want
        seq = list(prompt) + out[r][:-1]  # positions 0 .. L - 1 hold KV
        assert len(chain[r]) == len(seq)
        fresh = target.make_kv_pool(len(seq))
        _, hidden = _forward(target, seq, fresh)
        slots = torch.tensor(chain[r])
        torch.testing.assert_close(worker.kv.k_buffer[:, slots], fresh.k_buffer[:, :len(seq)],
                                   atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(worker.kv.v_buffer[:, slots], fresh.v_buffer[:, :len(seq)],
                                   atol=2e-5, rtol=1e-4)
        assert int(worker.draft_len[r]) == len(seq)
        if name == "eagle":  # EAGLE-1's features (the target's final hidden states) moved too
            torch.testing.assert_close(worker.hidden[slots], hidden, atol=2e-5, rtol=1e-4)
        if name == "draft":  # the drafter's KV: a fresh drafter prefill of the same tokens
            dl = len(seq)
            dfresh = module.make_kv_pool(dl)
            _forward(module, seq, dfresh)
            torch.testing.assert_close(worker.drafter.kv.k_buffer[:, slots[:dl]],
                                       dfresh.k_buffer[:, :dl], atol=2e-5, rtol=1e-4)


def test_only_tree_plans_take_the_tree_path():
    """A chain's plan (no tree_topk, or tree_topk 1) keeps the chain stages unchanged."""
    from types import SimpleNamespace

    from specdial.worker.tree_step import is_tree_plan

    z = np.zeros(1, np.int64)
    assert not is_tree_plan(DecodeInput(2, None, z, z, z, np.zeros(3, np.int64), z + 2))
    assert not is_tree_plan(SimpleNamespace(tree_topk=1))
    assert is_tree_plan(SimpleNamespace(tree_topk=4))
    assert is_tree_plan(TreePlan(z, z, z, np.zeros(3, np.int64), np.zeros(2, np.int64), 2, 1, 2))


def test_tree_plan_errors_name_the_field():
    z = np.zeros(2, np.int64)
    with pytest.raises(ValueError, match="scratch_loc has 3 entries, expected 8"):
        TreePlan(z, z, z, np.zeros(8, np.int64), np.zeros(3, np.int64), 3, 2, 4)
    # the scratch is max(N, K (D - 1)) = 12 slots a request: the drafter's frontier needs more
    with pytest.raises(ValueError, match="scratch_loc has 8 entries, expected 24"):
        TreePlan(z, z, z, np.zeros(10, np.int64), np.zeros(8, np.int64), 4, 4, 4)
    with pytest.raises(ValueError, match="above the 6 nodes"):
        TreePlan(z, z, z, np.zeros(6, np.int64), np.zeros(14, np.int64), 2, 2, 7)
    with pytest.raises(ValueError, match="num_draft_tokens <= 64"):
        TreePlan(z, z, z, np.zeros(8, np.int64), np.zeros(130, np.int64), 3, 8, 65)


def test_processors_seeds_and_logprobs_follow_each_path(tiny):
    """Penalties, min_tokens and logit_bias on greedy and seeded rows: tree iterations emit
    exactly plain decoding's tokens (steps 0 through SpecWorker.decode) with the same raw
    log-probabilities, whatever the tree shapes."""
    params = [SamplingParams(repetition_penalty=1.8, logit_bias={5: 1.0}, max_new_tokens=64),
              SamplingParams(temperature=0.9, seed=7, frequency_penalty=1.0, min_tokens=12,
                             logit_bias={9: 6.0}, max_new_tokens=64),
              SamplingParams(temperature=1.0, seed=123, presence_penalty=1.5,
                             max_new_tokens=64)]
    sampling = BatchSampling.from_params(params, prompt_lens=[len(p) for p in PROMPTS],
                                         min_tokens_ids=[(), (9,), ()])
    lp = LogprobRows.build([0, None, 2], "cpu")
    module = tiny.draft_noisy
    _, _, plain, plain_lp = run(tiny.target, module, None, sampling, lp)
    for shapes in ([(2, 3, 4), (4, 3, 8)], [(3, 4, 12), (1, 3, 3), (2, 7, 12)]):
        _, _, got, got_lp = run(tiny.target, module, shapes, sampling, lp)
        for r in range(len(PROMPTS)):
            n = min(len(plain[r]), len(got[r]))
            assert got[r][:n] == plain[r][:n]
            m = min(len(plain_lp[r]), len(got_lp[r]), n - 1)
            assert (m > 10) == (r != 1)
            np.testing.assert_allclose(got_lp[r][:m], plain_lp[r][:m], atol=1e-4)
    # min_tokens holds the heavily biased token 9 back for 12 outputs, then it comes
    assert 9 not in plain[1][:12] and 9 in plain[1][12:15]


def test_eagle3_tree_iterations_give_target_greedy():
    """An EAGLE-3 head drafting over 6 of 8 target tokens (its trees' scores are -inf on the
    other two): greedy tokens and the target's KV as for a chain."""
    from test_eagle3_sampling import eagle3_head
    from test_engine_sampling import tiny_model

    target = tiny_model(0, layers=3)
    prompts = [[1, 2, 3], [7, 7, 0, 5, 4]]
    worker, chain, out, _ = run(target, eagle3_head(target), [(3, 3, 6), (6, 2, 12), (8, 4, 20),
                                                              (1, 5, 5)], prompts=prompts)
    assert_target_greedy_and_chain_kv(target, worker, chain, out, prompts)


@pytest.mark.parametrize("shape", [(2, 2, 4), (3, 2, 6)])
def test_unseeded_sampling_through_tree_iterations_keeps_the_target_distribution(shape):
    """Temperature 1, no seed: the 2nd and 3rd tokens (decided by tree iterations) of 3000
    copies of one prompt follow the exact target-only marginals (chi-square, df 7, alpha
    1e-3), with a random draft model on an 8-token vocabulary."""
    from test_engine_sampling import (CRITICAL_DF7_ALPHA_1E3, PROMPT, V, chi2, exact_marginals,
                                      tiny_model)

    target, draft = tiny_model(0, layers=2), tiny_model(1, layers=1)
    sp = {"temperature": 1.0}
    m2, m3 = exact_marginals(target, sp)
    rows = 3000
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0)] * rows)
    torch.manual_seed(5)
    _, _, out, _ = run(target, draft, [shape], sampling, prompts=[PROMPT] * rows,
                       new_tokens=3)
    ids = np.array([o[:3] for o in out])
    for col, m in ((1, m2), (2, m3)):
        stat = chi2(np.bincount(ids[:, col], minlength=V), m)
        assert stat < CRITICAL_DF7_ALPHA_1E3, (col, stat)
