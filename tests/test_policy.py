"""The policy's Python surface, and the compiled policy against the pure-Python reference."""

import json
import random

import numpy as np
import pytest

import specdial
from specdial import AdaptiveConfig, AdaptiveSpeculativeParams, AdaptiveStepSlot, StepDecision
from reference_policy import RefParams, RefSlot

SLOT = {"candidate_steps": [1, 3, 5], "ema_alpha": 1.0, "update_interval": 1, "warmup_batches": 0, "down_hysteresis": 0.0}


def test_slot_sglang_names():
    s = AdaptiveStepSlot(3, SLOT)
    assert (s.current_steps, s.ema_accept_len, s.candidate_steps, s.verify_count) == (3, 2.0, [1, 3, 5], 0)
    assert s.update([]) is None
    assert s.update([3, 3]) == 5
    assert s.update(np.array([0, 0], dtype=np.int32)) == 1
    assert s.verify_count == 2
    with pytest.raises(specdial.ConfigError, match="candidate_steps is missing"):
        AdaptiveStepSlot(3, {"ema_alpha": 0.5})
    with pytest.raises(specdial.ConfigError, match='unknown key "strategy"|strategy is not a slot setting'):
        AdaptiveStepSlot(3, {**SLOT, "strategy": "ema"})


@pytest.mark.parametrize(
    "accepted",
    [
        [1, 2, 3],
        np.array([1, 2, 3], dtype=np.int64),
        np.array([1, 2, 3], dtype=np.int32),
        np.array([1, 2, 3], dtype=np.uint8),
        np.array([9, 1, 9, 2, 9, 3], dtype=np.int64)[1::2],  # non-contiguous view
        (1, 2, 3),
    ],
)
def test_accepted_inputs(accepted):
    s = AdaptiveStepSlot(3, {**SLOT, "ema_alpha": 0.5, "warmup_batches": 100})
    s.update(accepted)
    assert s.ema_accept_len == pytest.approx(0.5 * 2.0 + 0.5 * 2.0)


def test_accepted_from_torch():
    torch = pytest.importorskip("torch")
    s = AdaptiveStepSlot(3, {**SLOT, "ema_alpha": 0.5, "warmup_batches": 100})
    s.update(torch.tensor([3, 3, 0], dtype=torch.int32).numpy())
    assert s.ema_accept_len == pytest.approx(2.0)


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        ([4], ValueError, r"accepted\[0\] = 4 is outside 0..=3"),
        ([1, -1], ValueError, r"accepted\[1\] = -1"),
        (np.array([[1, 2]]), ValueError, "must be 1-D"),
        (np.array([1.0, 2.0]), TypeError, "list of ints or a 1-D integer array"),
        (3, TypeError, "list of ints"),
        (["a"], TypeError, "list of ints"),
        (np.array([2**63], dtype=np.uint64), ValueError, "outside"),
    ],
)
def test_bad_accepted(bad, exc, match):
    s = AdaptiveStepSlot(3, SLOT)
    with pytest.raises(exc, match=match):
        s.update(bad)
    assert (s.current_steps, s.ema_accept_len, s.verify_count) == (3, 2.0, 0)


def test_params_surface():
    assert AdaptiveSpeculativeParams(3).config == AdaptiveConfig.default()
    p = AdaptiveSpeculativeParams(3, AdaptiveConfig.ema_default())
    assert p.candidate_steps == [0, 1, 3, 5, 7]
    assert p.config == AdaptiveConfig.ema_default()
    assert [p.get_steps_for_batch(b) for b in (1, 8, 32, 64)] == [3, 3, 1, 0]
    assert p.decide(9) == p.decide(20)
    d = p.decide(9)
    assert isinstance(d, StepDecision)
    assert (d.steps, d.num_draft_tokens, d.graph_bs, d.slot) == (3, 4, None, 1)
    # Every built-in strategy decides a chain of the same steps for every request.
    assert (d.verify_lengths, d.tree_shape) == (None, None)
    assert p.cuda_graph_bs_for_step(3) is None
    p.set_cuda_graph_bs([1, 2, 4, 8, 16, 32, 64])
    assert p.decide(5).graph_bs == 8 and p.decide(5).slot == 1
    assert p.decide(100).graph_bs is None
    assert p.cuda_graph_bs_for_step(7) == [1, 2, 4]
    assert p.cuda_graph_bs_for_step(0) == [8, 16, 32, 64]
    p.set_cuda_graph_bs(None)
    assert p.decide(5).slot == 0
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        p.get_steps_for_batch(0)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        p.on_verify_complete([0], -3)
    with pytest.raises(ValueError, match=r"cuda_graph_bs\[1\] = 0"):
        p.set_cuda_graph_bs([4, 0])
    with pytest.raises(specdial.ConfigError):
        AdaptiveSpeculativeParams(3, {"1": {"candidate_steps": []}})
    with pytest.raises(TypeError):
        AdaptiveSpeculativeParams(3, "default")


def test_zero_step_slot_probes_and_resets_ema():
    p = AdaptiveSpeculativeParams(0, {"1": {"candidate_steps": [0, 3], "warmup_batches": 0, "update_interval": 2}})
    assert p.slot_states() == [(1, 0, -1.0, 0)]
    assert p.on_verify_complete([0, 0], 1) is None
    assert p.slot_states()[0][2] == -1.0  # observations at steps 0 leave the EMA
    assert p.on_verify_complete([0, 0], 1) == 3
    assert p.slot_states()[0][1:3] == (3, 2.0)


def test_panic_becomes_internal_error():
    with pytest.raises(specdial.InternalError, match="deliberate panic"):
        specdial._core._panic_for_test()
    try:
        specdial._core._panic_for_test()
    except Exception:  # the point: a plain `except Exception` catches it
        pass


def random_config(rng: random.Random) -> dict:
    cfg: dict = {}
    bounds = sorted(rng.sample(range(1, 80), rng.randint(1, 4)))
    for b in bounds:
        slot = {"candidate_steps": rng.sample(range(0, 9), rng.randint(1, 4))}
        if rng.random() < 0.7:
            slot["ema_alpha"] = rng.choice([0.1, 0.2, 0.5, 1.0, rng.uniform(0.01, 1.0)])
        if rng.random() < 0.7:
            slot["update_interval"] = rng.randint(1, 6)
        if rng.random() < 0.7:
            slot["warmup_batches"] = rng.randint(0, 12)
        if rng.random() < 0.7:
            slot["down_hysteresis"] = rng.uniform(-1.0, 0.5)
        if rng.random() < 0.5:
            slot["up_hysteresis"] = rng.uniform(-0.5, 1.0)
        if rng.random() < 0.4:
            slot["ceiling_coeff"] = rng.choice([0.5, 1.0, 1.5, 3.0, rng.uniform(0, 4)])
        cfg[str(b)] = slot
    return cfg


@pytest.mark.parametrize("seed", range(60))
def test_matches_reference_policy_on_random_traces(seed):
    """Invariant 5: the compiled ema strategy makes exactly the reference's decisions."""
    rng = random.Random(seed)
    cfg = AdaptiveConfig.from_dict(random_config(rng))
    union = cfg.candidate_steps
    initial = rng.choice(union + [rng.randint(0, 9)])
    fast, ref = AdaptiveSpeculativeParams(initial, cfg), RefParams(initial, json.loads(cfg.to_json()))
    graphs = rng.choice([None, [1, 2, 4, 8, 16, 32, 48, 64]])
    fast.set_cuda_graph_bs(graphs)
    ref.set_cuda_graph_bs(graphs)
    rate = rng.random()
    for it in range(400):
        if it % 50 == 0:
            rate = rng.random()
        bs = rng.choice([1, 1, 2, 3, 7, 8, 12, 33, 70, 100])
        steps = fast.get_steps_for_batch(bs)
        assert steps == ref.get_steps_for_batch(bs), it
        n = rng.choice([bs, bs, 0])
        accepted = [min(steps, int(rng.expovariate(1 - rate + 1e-3))) for _ in range(n)]
        assert fast.on_verify_complete(np.asarray(accepted, dtype=np.int64), bs) == ref.on_verify_complete(accepted, bs), it
    for (b, steps, ema, count), bound, slot in zip(fast.slot_states(), ref.bounds, ref.slots):
        assert (b, steps, count) == (bound, slot.current_steps, slot.count)
        assert ema == pytest.approx(slot.ema, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize(
    "key, value",
    [
        ("candidate_steps", [1, 2, 3, 5]),
        ("ema_alpha", 0.9),
        ("update_interval", 1),
        ("warmup_batches", 0),
        ("down_hysteresis", 0.6),
        ("up_hysteresis", 0.45),
        ("ceiling_coeff", 0.5),
    ],
)
def test_every_accepted_key_changes_behaviour(key, value):
    """Invariant 5: changing any accepted key changes the decisions on some trace."""
    base = {"candidate_steps": [1, 3, 5], "update_interval": 3, "warmup_batches": 4, "down_hysteresis": -0.25}

    def run(cfg):
        p = AdaptiveSpeculativeParams(3, {"1": cfg})
        rng = random.Random(7)
        out = []
        for it in range(300):
            steps = p.get_steps_for_batch(1)
            rate = 0.95 if (it // 40) % 2 == 0 else 0.2
            acc = [min(steps, int(rng.expovariate(1 - rate)))] * 2
            p.on_verify_complete(acc, 2)
            out.append(steps)
        return out

    assert run({**base, key: value}) != run(base)


def test_every_slot_key_is_covered_by_the_behaviour_test():
    # If a new key is added to the config, the test above must grow with it.
    keys = set(json.loads(AdaptiveConfig.ema_default().to_json())["1"])
    tested = {p[0] for p in test_every_accepted_key_changes_behaviour.pytestmark[0].args[1]}
    assert keys == tested


def test_reference_slot_matches_single_slot():
    rng = random.Random(3)
    cfg = {"candidate_steps": [0, 2, 4], "ema_alpha": 0.4, "update_interval": 2, "warmup_batches": 3,
           "down_hysteresis": -0.1, "up_hysteresis": 0.2, "ceiling_coeff": 1.5}
    fast, ref = AdaptiveStepSlot(2, cfg), RefSlot(2, cfg)
    for _ in range(500):
        steps = fast.current_steps
        acc = [rng.randint(0, steps) for _ in range(rng.randint(0, 4))]
        assert fast.update(acc) == ref.update(acc)
        assert fast.ema_accept_len == pytest.approx(ref.ema, abs=1e-12)
