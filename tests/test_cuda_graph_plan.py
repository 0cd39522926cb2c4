"""CUDA-graph machinery on the CPU: capture plans and pruning, static buffer sizing (the SGLang
#30549 configuration), padded replay through the same static buffers (eager and emulated
graphs) against unpadded eager passes, the pad-slot sentinel, fallbacks, the flashinfer
backend's argument preparation against a fake ``flashinfer`` module, and backend selection.

Real capture (``GraphPool(mode="cuda")``) and the real flashinfer kernels run only in
benches/gpu_check.py on a GPU."""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest
import torch

from specdial._core import AdaptiveConfig, AdaptiveSpeculativeParams
from specdial.attention import TorchAttentionBackend
from specdial.attention import flashinfer_backend as fb
from specdial.attention import select as sel
from specdial.kv_pool import KVPool
from specdial.models.batch import ForwardBatch
from specdial.attention.select import make_static_attention
from specdial.attention.torch_backend import TorchStaticAttention
from specdial.worker.graph_pool import GraphPool, capture_all
from specdial.worker.graph_tables import CapturePlan, default_cuda_graph_bs
from specdial.worker.step_buffers import KVLayout, StaticBuffers, static_buffer_shapes
from specdial.worker.step_runner import build_runners
from specdial.worker.drafters import make_drafter
from specdial.worker.sampling import BatchSampling, SamplingParams

SLOTS = 1024


# --------------------------------------------------------------------------- capture sizes
def test_default_cuda_graph_bs_follows_sglang_grid():
    assert default_cuda_graph_bs(1) == [1]
    assert default_cuda_graph_bs(8) == [1, 2, 4, 8]
    assert default_cuda_graph_bs(32) == [1, 2, 4, 8, 12, 16, 24, 32]
    assert default_cuda_graph_bs(100)[-3:] == [88, 96, 100]  # max appended off the grid
    sizes = default_cuda_graph_bs(600)
    assert sizes[sizes.index(256):sizes.index(256) + 3] == [256, 272, 288]
    assert sizes[-4:] == [512, 544, 576, 600] and 496 in sizes and 504 not in sizes
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError):
            default_cuda_graph_bs(bad)


def _params(sizes):
    p = AdaptiveSpeculativeParams(3, AdaptiveConfig.ema_default())
    p.set_cuda_graph_bs(sizes)
    return p


def test_capture_plan_prunes_with_the_policy_and_orders_largest_first():
    sizes = default_cuda_graph_bs(64)
    config = AdaptiveConfig.ema_default()
    params = _params(sizes)
    plan = CapturePlan.build(config.candidate_steps, sizes, params)
    assert plan.pruned and plan.graph_bs == tuple(sizes)
    for s in config.candidate_steps:
        assert plan.sizes[s] == tuple(sorted(params.cuda_graph_bs_for_step(s), reverse=True))
    assert plan.sizes[7] == (4, 2, 1) and plan.sizes[0][-1] == 8  # bs < 8 never plain-decodes
    assert CapturePlan.build(config.candidate_steps, sizes, config).sizes == plan.sizes
    order = plan.order()
    assert [bs for _, bs in order] == sorted((bs for _, bs in order), reverse=True)
    assert order[0] == (0, 64)  # only plain decoding reaches the slot of 64
    assert plan.passes(0) == ("verify", "extend")
    assert plan.passes(3) == ("draft", "verify", "extend")
    assert plan.num_graphs == sum(len(plan.passes(s)) for s, _ in order)
    full = CapturePlan.build(config.candidate_steps, sizes, params, prune=False)
    assert not full.pruned and all(v == tuple(reversed(sizes)) for v in full.sizes.values())
    assert full.num_graphs > plan.num_graphs
    assert plan.padded_bs(3, 5) == 8 and plan.padded_bs(7, 5) is None
    # every (steps, graph_bs) the policy can decide is captured
    for initial in config.candidate_steps:
        p = AdaptiveSpeculativeParams(initial, config)
        p.set_cuda_graph_bs(sizes)
        for bs in range(1, 70):
            d = p.decide(bs)
            if d.graph_bs is not None:
                assert d.graph_bs in plan.sizes[d.steps], (bs, d.steps, d.graph_bs)


def test_capture_plan_errors_and_no_drafter():
    with pytest.raises(ValueError, match="set_cuda_graph_bs"):
        CapturePlan.build([0, 1], [1, 2], AdaptiveSpeculativeParams(3, AdaptiveConfig.default()))
    with pytest.raises(ValueError, match="same list"):
        CapturePlan.build([1, 3], [1, 2], _params([1, 2, 4]))
    with pytest.raises(ValueError):
        CapturePlan.build([0], [0, 1])
    with pytest.raises(ValueError):
        CapturePlan.build([0, 1], [1], has_drafter=False)
    plain = CapturePlan.build([0], [4, 1, 2, 2], has_drafter=False)
    assert plain.graph_bs == (1, 2, 4) and plain.passes(0) == ("verify",)
    assert plain.to_dict()["num_graphs"] == 3


# --------------------------------------------------------------------------- sizing
def test_static_sizing_covers_the_sglang_30549_configuration(tiny):
    """SGLang #30549/#35275: 32 requests, initial steps 3 (4 tokens -> 128 rows), adaptive
    steps up to 7 (8 tokens -> 256 rows). Sizing from the initial steps fails loudly; sizing
    from the plan holds 256 rows and a 32 x 8 verify runs."""
    config = AdaptiveConfig.from_dict({"1": {"candidate_steps": [1, 3, 7]}})
    sizes = default_cuda_graph_bs(32)
    plan = CapturePlan.build(config.candidate_steps, sizes, config)
    assert plan.sizes[7][0] == 32 and plan.max_steps == 7
    shapes = static_buffer_shapes(max_bs=32, max_steps=7, hidden_size=64, vocab_size=192,
                                  kv_capacity=64)
    assert shapes["verify_input_ids"] == (256,) and shapes["verify_logits_out"] == (256, 192)
    assert static_buffer_shapes(max_bs=32, max_steps=3, hidden_size=64, vocab_size=192,
                                kv_capacity=64)["verify_input_ids"] == (128,)
    small = StaticBuffers(max_bs=32, max_steps=3, hidden_size=64, vocab_size=192,
                          kv_capacity=64, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"256 verify rows.*128 rows.*30549"):
        small.check(plan)
    env = _env(tiny.target, tiny.eagle_random, CapturePlan.build([7], [32]), "eager", cap=48)
    runner = env.runners[7]
    assert runner.buffers.rows == 256 and runner.buffers.verify_input_ids.shape == (256,)
    st = _state(env, 32, 7, seed=3)
    out = runner.verify(*st.verify_args())
    assert out.logits.shape == (256, 192) and runner.stats.replays["verify"] == 1
    ref = _eager(runner, lambda: runner.verify(*st.verify_args()))
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-4)


# --------------------------------------------------------------------------- test harness
class _Env(types.SimpleNamespace):
    pass


def _env(target, module, plan, mode, cap=64):
    drafter = make_drafter(module, target, max_steps=7) if module is not None else None
    kv = target.make_kv_pool(SLOTS)
    if drafter is not None:
        drafter.init_kv(SLOTS)
    pool = GraphPool("cpu", mode)
    runners = build_runners(plan, target=target, target_kv=kv, drafter=drafter,
                            backend=TorchAttentionBackend(), pool=pool, kv_capacity=cap)
    report = capture_all(runners, plan)
    return _Env(target=target, drafter=drafter, kv=kv, runners=runners, report=report, cap=cap)


class _State(types.SimpleNamespace):
    def verify_args(self):
        return self.ids, self.vpos, self.vloc, self.layout, self.L

    def draft_args(self):
        k = self.k
        return (self.ids.view(self.b, -1)[:, 0], self.vpos.view(self.b, -1)[:, :k].T.contiguous(),
                self.vloc.view(self.b, -1)[:, :k].T.contiguous(), self.layout, self.L)

    def extend_args(self):
        return (self.e_ids, self.e_pos, self.e_loc, self.layout, self.e_start, self.e_counts,
                self.e_hidden)


def _state(env, b, k, seed, counts=None):
    """Random requests: contexts of 3..20 tokens at random slots, K/V pools randomised, verify
    inputs for ``k`` drafts, and an extend over ``counts`` tokens from ``L + 1`` (``L`` at
    steps 0: the warm drafter's one-token extend)."""
    rng = np.random.default_rng(seed)
    n = k + 1
    L = rng.integers(3, 20, size=b).astype(np.int64)
    lens = L + n
    slots = rng.permutation(SLOTS)[: lens.sum()].astype(np.int64)
    offs = np.cumsum(lens) - lens
    gen = torch.Generator().manual_seed(seed)
    for pool in [env.kv] + ([env.drafter.kv] if env.drafter is not None else []):
        pool.k_buffer.copy_(torch.randn(pool.k_buffer.shape, generator=gen))
        pool.v_buffer.copy_(torch.randn(pool.v_buffer.shape, generator=gen))
    vpos = (L[:, None] + np.arange(n)[None]).reshape(-1)
    vloc = np.concatenate([slots[o + x: o + x + n] for o, x in zip(offs, L)])
    vocab = env.target.config.vocab_size
    start = L + 1 if k else L
    counts = rng.integers(0, max(k, 1) + 1, size=b) if counts is None else np.asarray(counts)
    e_pos = np.concatenate([np.arange(s, s + c) for s, c in zip(start, counts)]).astype(np.int64)
    e_loc = np.concatenate([slots[o + s: o + s + c] for o, s, c in zip(offs, start, counts)])
    m = int(counts.sum())
    return _State(b=b, k=k, L=L, layout=KVLayout(torch.from_numpy(slots), lens),
                  ids=torch.randint(0, vocab, (b * n,), generator=gen),
                  vpos=torch.from_numpy(vpos), vloc=torch.from_numpy(vloc.astype(np.int64)),
                  first_hidden=torch.randn(b, env.target.config.hidden_size, generator=gen),
                  e_ids=torch.randint(0, vocab, (m,), generator=gen),
                  e_pos=torch.from_numpy(e_pos), e_loc=torch.from_numpy(e_loc.astype(np.int64)),
                  e_start=start, e_counts=counts.astype(np.int64),
                  e_hidden=torch.randn(m, env.target.config.hidden_size, generator=gen))


def _eager(runner, fn):
    """Run ``fn`` with the runner disabled (unpadded eager passes, dynamic metadata)."""
    runner.enabled = False
    try:
        return fn()
    finally:
        runner.enabled = True


def _snapshot(env):
    pools = [env.kv] + ([env.drafter.kv] if env.drafter is not None else [])
    return [(p.k_buffer.clone(), p.v_buffer.clone()) for p in pools]


def _restore(env, snap):
    pools = [env.kv] + ([env.drafter.kv] if env.drafter is not None else [])
    for p, (k, v) in zip(pools, snap):
        p.k_buffer.copy_(k)
        p.v_buffer.copy_(v)


def _real(snap):
    """The K/V of every slot but the pad sentinel (the last one)."""
    return [(k[:, :-1], v[:, :-1]) for k, v in snap]


def _run_all(env, runner, st):
    """Draft (k >= 1), verify, extend; returns (tokens, logits, hidden, pools after)."""
    tokens = None
    if runner.steps:
        args = st.draft_args()
        tokens, _ = runner.draft(*args, first_hidden=st.first_hidden)
        tokens = tokens.clone()
    out = runner.verify(*st.verify_args())
    logits, hidden = out.logits.clone(), out.hidden.clone()
    runner.draft_extend(*st.extend_args())
    return tokens, logits, hidden, _snapshot(env)


# --------------------------------------------------------------------------- padding
DRAFTERS = {"eagle_random": ("tiny", "eagle_random"), "draft_noisy": ("tiny", "draft_noisy"),
            "eagle_noisy": ("tiny1", "eagle_noisy")}


@pytest.mark.parametrize("mode", ["eager", "emulate"])
@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("steps", [0, 1, 3])
def test_padded_replay_equals_unpadded_eager(request, name, steps, mode):
    """5 requests padded to a graph of 8 and run exactly at 5: the real rows' logits, hidden
    states, draft tokens and every KV write (pad slot excluded) equal the eager passes."""
    models, attr = DRAFTERS[name]
    ns = request.getfixturevalue(models)
    for sizes, b in (([8], 5), ([5], 5)):
        env = _env(ns.target, getattr(ns, attr), CapturePlan.build([steps], sizes), mode)
        runner = env.runners[steps]
        st = _state(env, b, steps, seed=steps + 10)
        start = _snapshot(env)
        got = _run_all(env, runner, st)
        _restore(env, start)
        ref = _eager(runner, lambda: _run_all(env, runner, st))
        assert sum(runner.stats.replays.values()) == len(runner.passes())
        if steps:
            assert torch.equal(got[0], ref[0])
        torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-4)
        torch.testing.assert_close(got[2], ref[2], rtol=0, atol=1e-4)
        assert torch.equal(got[1].argmax(-1), ref[1].argmax(-1))
        for (gk, gv), (rk, rv) in zip(_real(got[3]), _real(ref[3])):
            torch.testing.assert_close(gk, rk, rtol=0, atol=1e-5)
            torch.testing.assert_close(gv, rv, rtol=0, atol=1e-5)


def test_pad_slot_is_never_read_by_real_rows(tiny1):
    """Poison the sentinel before each pass: real rows stay finite and equal the eager pass,
    padded or not, and the only non-real slot written is the sentinel."""
    for sizes, b in (([4], 4), ([8], 3)):
        env = _env(tiny1.target, tiny1.eagle_noisy, CapturePlan.build([3], sizes), "eager")
        runner = env.runners[3]
        st = _state(env, b, 3, seed=21, counts=[3] * b)
        used = set(st.layout.indices.tolist())
        pools = [env.kv, env.drafter.kv]
        start = _snapshot(env)

        def poison():
            for p in pools:
                p.k_buffer[:, p.pad_slot] = float("nan")
                p.v_buffer[:, p.pad_slot] = float("nan")

        poison()
        tokens, _ = runner.draft(*st.draft_args(), first_hidden=st.first_hidden)
        tokens = tokens.clone()
        poison()
        out = runner.verify(*st.verify_args())
        logits = out.logits.clone()
        poison()
        runner.draft_extend(*st.extend_args())
        assert torch.isfinite(logits).all()
        after = _snapshot(env)
        _restore(env, start)
        ref_tokens, _ = _eager(runner, lambda: runner.draft(*st.draft_args(),
                                                            first_hidden=st.first_hidden))
        assert torch.equal(tokens, ref_tokens)
        ref = _eager(runner, lambda: runner.verify(*st.verify_args()))
        torch.testing.assert_close(logits, ref.logits, rtol=0, atol=1e-4)
        for (k0, _), (k1, _) in zip(start, after):
            changed = (k0 != k1).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
            assert set(changed) <= used | {SLOTS}


def test_emulated_graph_outputs_are_fixed_tensors(tiny):
    env = _env(tiny.target, tiny.eagle_random, CapturePlan.build([1], [4, 8]), "emulate")
    runner = env.runners[1]
    assert env.report.num_graphs == 6
    a = runner.verify(*_state(env, 3, 1, seed=1).verify_args())
    ptr = a.logits.data_ptr()
    first = a.logits.clone()
    b = runner.verify(*_state(env, 4, 1, seed=2).verify_args())  # same graph (bs 4)
    assert b.logits.data_ptr() == ptr and not torch.equal(b.logits[:6], first)
    c = runner.verify(*_state(env, 6, 1, seed=2).verify_args())  # bs 8 graph
    assert c.logits.shape[0] == 12 and runner.stats.replays["verify"] == 3


def test_fallbacks_are_eager_and_counted(tiny):
    env = _env(tiny.target, tiny.eagle_random, CapturePlan.build([3], [2, 4]), "eager")
    runner = env.runners[3]
    assert runner.padded_bs(3) == 4 and runner.padded_bs(5) is None
    assert runner.padded_bs(1, graph_bs=4) == 4 and runner.padded_bs(1, graph_bs=3) is None
    st = _state(env, 5, 3, seed=4)
    runner.verify(*st.verify_args())  # 5 > 4: above the largest graph
    st3 = _state(env, 3, 3, seed=5)
    runner.verify(*st3.verify_args(), graph_bs=8)  # the Rust key names an uncaptured size
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0)] * 3)
    tokens, probs = runner.draft(*st3.draft_args(), first_hidden=st3.first_hidden,
                                 sampling=sampling, generator=torch.Generator().manual_seed(0))
    assert tokens.shape == (3, 3) and probs.shape == (3, 3, 192)
    long = _state(env, 3, 3, seed=6, counts=[0, 0, 0])
    m = 6  # a catch-up of 6 tokens (> steps + 1) for request 0
    long.e_counts = np.array([m, 0, 0])
    long.e_start = np.array([1, 1, 1])
    long.e_pos = torch.arange(1, 1 + m)
    long.e_loc = long.layout.indices[1:1 + m]
    long.e_ids = torch.randint(0, 192, (m,))
    long.e_hidden = torch.randn(m, 64)
    runner.draft_extend(*long.extend_args())
    assert runner.stats.eager == {"verify:batch_not_captured": 2, "draft:sampling": 1,
                                  "extend:long": 1}
    runner.enabled = False
    runner.verify(*st3.verify_args())
    assert runner.stats.eager["verify:disabled"] == 1


def test_graph_pool_modes_and_buffer_errors(tiny):
    assert GraphPool("cpu").mode == "eager" and not GraphPool("cpu").use_graphs
    with pytest.raises(ValueError, match="CUDA device"):
        GraphPool("cpu", "cuda")
    with pytest.raises(ValueError):
        GraphPool("cpu", "replay")
    env = _env(tiny.target, None, CapturePlan.build([0], [2], has_drafter=False), "eager")
    runner = env.runners[0]
    assert runner.passes() == ("verify",)
    with pytest.raises(ValueError, match="outside 1..2"):
        runner.capture_one(3)
    with pytest.raises(ValueError, match="drafter"):
        runner.draft_extend(*_state(env, 1, 0, seed=0).extend_args())
    with pytest.raises(ValueError, match="sized for max_steps=0"):
        capture_all(env.runners, CapturePlan.build([1], [2]))
    with pytest.raises(ValueError):
        KVLayout(torch.arange(3), np.array([1, 1]))


# --------------------------------------------------------------------------- attention pieces
def test_expand_kv_indices_against_a_loop():
    flat = torch.arange(100, 100 + 12)
    flat_lens = np.array([5, 0, 7])
    kv_lens = np.array([6, 2, 4])
    valid = np.array([5, 0, 3])
    idx, req, pos = fb.expand_kv_indices(flat, flat_lens, kv_lens, valid, -1)
    expect, off = [], 0
    for fl, kl, v in zip(flat_lens, kv_lens, valid):
        expect += [100 + off + j if j < v else -1 for j in range(kl)]
        off += fl
    assert idx.tolist() == expect
    assert req.tolist() == [0] * 6 + [1] * 2 + [2] * 4 and pos.tolist()[:6] == list(range(6))
    with pytest.raises(ValueError):
        fb.expand_kv_indices(flat, flat_lens, kv_lens, np.array([6, 0, 3]), -1)
    with pytest.raises(ValueError):
        fb.expand_kv_indices(flat[:5], flat_lens, kv_lens, valid, -1)


def _pool_and_layout(seed, heads=4, kv_heads=2, d=8, dtype=torch.float32):
    torch.manual_seed(seed)
    pool = KVPool(2, 64, kv_heads, d, dtype=dtype)
    pool.k_buffer.normal_()
    pool.v_buffer.normal_()
    return pool


def test_torch_static_attention_matches_the_eager_backend():
    pool = _pool_and_layout(0)
    n, b, g, cap = 3, 3, 5, 24
    kv_lens = np.array([4, 9, 3])
    flat = torch.randperm(64)[: kv_lens.sum()]
    q = torch.randn(g * n, 4, 8)
    static = TorchStaticAttention(8, n, cap, "cpu")
    meta = static.plan(g, flat, np.r_[kv_lens, 0, 0], np.r_[kv_lens, n, n],
                       np.r_[kv_lens, 0, 0], pool.pad_slot)
    assert meta is static.plan(g, flat, np.r_[kv_lens, 0, 0], np.r_[kv_lens, n, n],
                               np.r_[kv_lens, 0, 0], pool.pad_slot)
    assert meta.kv_gather.shape == (g, cap) and meta.mask.shape == (g, 1, n, cap)
    backend = TorchAttentionBackend()
    out = backend.forward(q, 1, pool, meta, 0.3)
    ref_meta = backend.plan(torch.full((b,), n), torch.from_numpy(kv_lens), flat)
    ref = backend.forward(q[: b * n], 1, pool, ref_meta, 0.3)
    torch.testing.assert_close(out[: b * n], ref, rtol=0, atol=1e-5)
    assert torch.isfinite(out).all()
    assert (meta.kv_gather[b:] == pool.pad_slot).all()
    assert not (meta.kv_gather[:b] == pool.pad_slot).any()  # real rows never gather the pad
    with pytest.raises(ValueError, match="capacity"):
        static.plan(1, flat[:4], np.array([4]), np.array([cap + 1]), np.array([4]), 64)
    with pytest.raises(TypeError):
        make_static_attention(object(), 4, 1, 8, "cpu")


# --------------------------------------------------------------------------- fake flashinfer
class _FakeWrapper:
    """Implements the documented semantics of flashinfer's paged wrappers (page size 1 here):
    plan copies the layout (into the user buffers in CUDA-graph mode), run attends causally,
    bottom-right aligned, with GQA, over ``(k_cache, v_cache)`` ``[pages, 1, kvh, d]``."""

    log: list = []

    def __init__(self, workspace, layout="NHD", use_cuda_graph=False, **kw):
        self.workspace, self.layout, self.cuda_graph, self.kw = workspace, layout, use_cuda_graph, kw
        self.plans = 0
        _FakeWrapper.log.append(self)

    def _store(self, name, value):
        buf = self.kw.get(name)
        if self.cuda_graph:
            assert buf is not None and len(buf) >= len(value), name
            buf[: len(value)].copy_(value.to(buf.device, buf.dtype))
            return buf
        return value

    def run(self, q, paged_kv_cache):
        k_cache, v_cache = paged_kv_cache
        assert k_cache.dim() == 4 and k_cache.shape[1] == 1 and self.layout == "NHD"
        qo, kv, idx = self.qo_indptr.tolist(), self.kv_indptr.tolist(), self.kv_indices
        heads, kv_heads = q.shape[1], k_cache.shape[2]
        out = torch.empty_like(q)
        mask, off = getattr(self, "custom_mask", None), 0
        for r in range(len(kv) - 1):
            slots = idx[kv[r]:kv[r + 1]].long()
            k = k_cache[slots, 0].float().repeat_interleave(heads // kv_heads, 1)
            v = v_cache[slots, 0].float().repeat_interleave(heads // kv_heads, 1)
            n_q, n_kv = qo[r + 1] - qo[r], len(slots)
            for i in range(n_q):
                s = torch.einsum("hd,khd->hk", q[qo[r] + i].float(), k) * self.sm_scale
                if mask is not None:  # custom_mask: request-major, then query, then key
                    row = mask[off + i * n_kv: off + (i + 1) * n_kv]
                    s[:, ~row] = -math.inf
                elif self.causal:  # bottom-right aligned: query i sits at n_kv - n_q + i
                    s[:, n_kv - n_q + i + 1:] = -math.inf
                out[qo[r] + i] = torch.einsum("hk,khd->hd", s.softmax(-1), v).to(q.dtype)
            off += n_q * n_kv
        return out


class FakePrefill(_FakeWrapper):
    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, heads, kv_heads, head_dim,
             page_size, *, causal=False, sm_scale=None, q_data_type=None, kv_data_type=None,
             custom_mask=None):
        assert qo_indptr.device.type == "cpu" and qo_indptr.dtype == torch.int32
        self.custom_mask = custom_mask
        assert kv_indptr.dtype == torch.int32 and kv_indices.dtype == torch.int32
        assert last_page_len.dtype == torch.int32 and bool((last_page_len == 1).all())
        assert page_size == 1
        if self.cuda_graph:
            assert len(self.kw["qo_indptr_buf"]) == len(qo_indptr)
            assert len(self.kw["paged_kv_last_page_len_buf"]) == len(last_page_len)
        self.qo_indptr = self._store("qo_indptr_buf", qo_indptr)
        self.kv_indptr = self._store("paged_kv_indptr_buf", kv_indptr)
        self.kv_indices = self._store("paged_kv_indices_buf", kv_indices)
        self.causal, self.sm_scale, self.plans = causal, sm_scale, self.plans + 1
        self.args = (heads, kv_heads, head_dim, q_data_type, kv_data_type)


class FakeDecode(_FakeWrapper):
    def plan(self, indptr, indices, last_page_len, heads, kv_heads, head_dim, page_size, *,
             sm_scale=None, q_data_type=None, kv_data_type=None):
        assert indptr.dtype == torch.int32 and indices.dtype == torch.int32 and page_size == 1
        assert bool((last_page_len == 1).all())
        if self.cuda_graph:
            assert len(self.kw["paged_kv_indptr_buffer"]) == len(indptr)
        self.kv_indptr = self._store("paged_kv_indptr_buffer", indptr)
        self.kv_indices = self._store("paged_kv_indices_buffer", indices)
        self.qo_indptr = torch.arange(len(indptr))
        self.causal, self.sm_scale, self.plans = False, sm_scale, self.plans + 1
        self.args = (heads, kv_heads, head_dim, q_data_type, kv_data_type)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mod = types.ModuleType("flashinfer")
    mod.BatchPrefillWithPagedKVCacheWrapper = FakePrefill
    mod.BatchDecodeWithPagedKVCacheWrapper = FakeDecode
    mod.__version__ = "fake"
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    _FakeWrapper.log = []
    return mod


def test_flashinfer_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    with pytest.raises(ImportError, match=r"pip install 'specdial\[cuda\]'"):
        fb.FlashInferAttentionBackend("cpu")


def test_flashinfer_eager_plan_arguments_and_outputs(fake_flashinfer):
    backend = fb.FlashInferAttentionBackend("cpu", workspace_bytes=1 << 12)
    assert backend.workspace.dtype == torch.uint8 and backend.workspace.numel() == 1 << 12
    assert not backend.workspace.any()
    pool = _pool_and_layout(1, heads=8, kv_heads=2, d=16, dtype=torch.bfloat16)
    torch_backend = TorchAttentionBackend()
    for qo_lens, kv_lens in (([3, 1, 4], [5, 1, 9]), ([1, 1], [7, 3])):
        qo, kv = torch.tensor(qo_lens), torch.tensor(kv_lens)
        idx = torch.randperm(64)[: int(kv.sum())]
        meta = backend.plan(qo, kv, idx)
        assert meta.decode == (max(qo_lens) == 1)
        assert meta.kv_indptr_i32.tolist() == [0] + np.cumsum(kv_lens).tolist()
        assert meta.qo_indptr_i32.dtype == torch.int32 and meta.last_page_len_i32.tolist() == \
            [1] * len(qo_lens)
        q = torch.randn(int(qo.sum()), 8, 16, dtype=torch.bfloat16)
        for layer in (0, 1):
            out = backend.forward(q, layer, pool, meta, 0.25)
            ref = torch_backend.forward(q, layer, pool, torch_backend.plan(qo, kv, idx), 0.25)
            torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.02)
        wrapper = _FakeWrapper.log[-1]
        assert isinstance(wrapper, FakeDecode if meta.decode else FakePrefill)
        assert wrapper.plans == 1 and wrapper.workspace is backend.workspace  # once per pass
        assert wrapper.args == (8, 2, 16, torch.bfloat16, torch.bfloat16)
        assert wrapper.sm_scale == 0.25 and wrapper.causal == (not meta.decode)
    decode = [w for w in _FakeWrapper.log if isinstance(w, FakeDecode)]
    assert decode and decode[0].kw["use_tensor_cores"] is True  # group size 4
    with pytest.raises(TypeError, match="float32"):
        backend.forward(torch.randn(2, 8, 16), 0, pool, backend.plan(
            torch.tensor([1, 1]), torch.tensor([2, 2]), torch.arange(4)), 0.25)


def test_flashinfer_tree_mask_through_custom_mask(fake_flashinfer):
    """Draft trees (issue 29): a tree mask becomes the prefill wrapper's custom_mask (never
    the decode wrapper, causal off) and attends as the torch backend's tree mask does."""
    backend = fb.FlashInferAttentionBackend("cpu", workspace_bytes=1 << 12)
    pool = _pool_and_layout(1, heads=8, kv_heads=2, d=16, dtype=torch.bfloat16)
    torch_backend = TorchAttentionBackend()
    qo, kv = torch.tensor([4, 4]), torch.tensor([6, 11])
    tm = torch.eye(4, dtype=torch.bool).expand(2, 4, 4).clone()
    tm[:, :, 0] = True  # every node sees the root
    tm[1, 3, 2] = True
    idx = torch.randperm(64)[: int(kv.sum())]
    meta = backend.plan(qo, kv, idx, tree_mask=tm)
    assert not meta.decode and meta.custom_mask.numel() == 4 * 6 + 4 * 11
    q = torch.randn(8, 8, 16, dtype=torch.bfloat16)
    out = backend.forward(q, 0, pool, meta, 0.25)
    ref = torch_backend.forward(q, 0, pool, torch_backend.plan(qo, kv, idx, tree_mask=tm), 0.25)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.02)
    assert _FakeWrapper.log[-1].causal is False
    one = backend.plan(torch.tensor([1]), torch.tensor([3]), idx[:3],
                       tree_mask=torch.ones(1, 1, 1, dtype=torch.bool))
    assert not one.decode  # the decode wrapper takes no mask


def test_flashinfer_static_metadata_replans_fixed_buffers(fake_flashinfer):
    backend = fb.FlashInferAttentionBackend("cpu", workspace_bytes=256)
    pool = _pool_and_layout(2, heads=4, kv_heads=4, d=8, dtype=torch.float16)
    static = make_static_attention(backend, 8, 2, 16, "cpu")
    assert isinstance(static, fb.FlashInferStaticAttention)
    torch_backend = TorchAttentionBackend()
    meta = None
    for seed, kv_lens in ((0, np.array([5, 3])), (1, np.array([9, 2]))):
        flat = torch.randperm(64, generator=torch.Generator().manual_seed(seed))[: kv_lens.sum()]
        m = static.plan(4, flat, np.r_[kv_lens, 0, 0], np.r_[kv_lens, 2, 2],
                        np.r_[kv_lens, 0, 0], pool.pad_slot)
        assert meta is None or m is meta
        meta = m
        q = torch.randn(8, 4, 8, dtype=torch.float16)
        out = backend.forward(q, 0, pool, meta, 0.5)
        ref = torch_backend.forward(q[:4], 0, pool, torch_backend.plan(
            torch.tensor([2, 2]), torch.from_numpy(kv_lens), flat), 0.5)
        torch.testing.assert_close(out[:4].float(), ref.float(), rtol=0.01, atol=0.01)
        wrapper = meta.wrappers[next(iter(meta.wrappers))]
        assert wrapper.cuda_graph and len(wrapper.kw["qo_indptr_buf"]) == 5
        assert wrapper.kw["paged_kv_indices_buf"].numel() == 8 * 16
        assert static.kv_indptr[:5].tolist() == [0] + np.cumsum(np.r_[kv_lens, 2, 2]).tolist()
        assert static.kv_indices[kv_lens.sum():kv_lens.sum() + 4].tolist() == [pool.pad_slot] * 4
    assert len(meta.wrappers) == 1 and wrapper.plans == 2  # created once, re-planned per plan


def test_runner_over_flashinfer_static_metadata(fake_flashinfer, monkeypatch, tiny):
    """The runner's padded path through flashinfer's CUDA-graph metadata (fake kernels, float32
    allowed for the comparison) equals the torch backend's eager passes."""
    monkeypatch.setattr(fb, "_SUPPORTED_DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    backend = fb.FlashInferAttentionBackend("cpu", workspace_bytes=256)
    target, module = tiny.target, tiny.draft_noisy  # two-layer drafter: extend uses attention
    drafter = make_drafter(module, target, max_steps=7)
    kv = target.make_kv_pool(SLOTS)
    drafter.init_kv(SLOTS)
    plan = CapturePlan.build([3], [8])
    runners = build_runners(plan, target=target, target_kv=kv, drafter=drafter, backend=backend,
                            pool=GraphPool("cpu", "emulate"), kv_capacity=64)
    capture_all(runners, plan)
    runner = runners[3]
    env = _Env(target=target, drafter=drafter, kv=kv)
    st = _state(env, 5, 3, seed=7)
    start = _snapshot(env)
    got = _run_all(env, runner, st)
    _restore(env, start)
    ref_runner = build_runners(plan, target=target, target_kv=kv, drafter=drafter,
                               backend=TorchAttentionBackend(), pool=GraphPool("cpu", "eager"),
                               kv_capacity=64)[3]
    ref = _eager(ref_runner, lambda: _run_all(env, ref_runner, st))
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-4)
    for (gk, _), (rk, _) in zip(_real(got[3]), _real(ref[3])):
        torch.testing.assert_close(gk, rk, rtol=0, atol=1e-5)
    assert any(w.cuda_graph for w in _FakeWrapper.log)


# --------------------------------------------------------------------------- selection
def test_select_backend(monkeypatch):
    assert isinstance(sel.select_backend("cpu"), TorchAttentionBackend)
    assert sel.backend_name("cpu", "torch") == "torch"
    with pytest.raises(ValueError, match="CUDA device"):
        sel.backend_name("cpu", "flashinfer")
    with pytest.raises(ValueError, match="one of"):
        sel.backend_name("cpu", "triton")
    monkeypatch.setattr(sel, "flashinfer_available", lambda: False)
    assert sel.backend_name("cuda") == "torch"
    with pytest.raises(ImportError, match=r"specdial\[cuda\]"):
        sel.backend_name("cuda", "flashinfer")
    monkeypatch.setattr(sel, "flashinfer_available", lambda: True)
    assert sel.backend_name("cuda") == "flashinfer"
    assert sel.backend_name("cuda", dtype=torch.bfloat16) == "flashinfer"
    assert sel.backend_name("cuda", dtype=torch.float32) == "torch"
    assert sel.backend_name("cuda:1", "torch") == "torch"
    with pytest.raises(ValueError, match="float16/bfloat16"):
        sel.backend_name("cuda", "flashinfer", torch.float32)


def test_select_backend_constructs_flashinfer(fake_flashinfer, monkeypatch):
    monkeypatch.setattr(sel, "backend_name", lambda *a, **k: "flashinfer")
    backend = sel.select_backend("cpu", workspace_bytes=64, use_tensor_cores=False)
    assert isinstance(backend, fb.FlashInferAttentionBackend)
    assert backend.workspace.numel() == 64 and backend.use_tensor_cores is False


def test_pass_inputs_are_validated(tiny):
    env = _env(tiny.target, tiny.eagle_random, CapturePlan.build([3], [4]), "eager")
    runner = env.runners[3]
    st = _state(env, 3, 3, seed=8)
    ids, pos, loc, layout, start = st.verify_args()
    with pytest.raises(ValueError, match="mismatched"):
        runner.verify(ids[:-1], pos, loc, layout, start)
    with pytest.raises(ValueError, match="mismatched"):
        runner.verify(ids, pos, loc, layout, start[:2])
    with pytest.raises(ValueError, match="first_hidden"):
        runner.draft(*st.draft_args())
    with pytest.raises(ValueError, match="hidden_states"):
        runner.draft_extend(*st.extend_args()[:-1])
    with pytest.raises(ValueError, match="steps >= 1"):
        _env(tiny.target, tiny.eagle_random, CapturePlan.build([0], [4]), "eager").runners[0] \
            .draft(*st.draft_args(), first_hidden=st.first_hidden)
