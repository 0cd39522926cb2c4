"""Lossless sampling through Engine.generate (docs/design.md invariant 2), end to end.

The accept rule itself is tested in tests/test_sampling.py (with a wrong rule shown to fail).
Here the whole engine runs, so the wiring is checked too: the draft distribution q the drafter
reports must be the one its tokens were sampled from, with the same temperature/top-k
processing as the target's p. On an 8-token vocabulary, the marginal distribution of the 2nd
and 3rd completion tokens (both produced by verify at steps 2) must match the exact marginal
computed from the target alone, by a chi-square test at alpha = 1e-3 (df = 7, critical value
24.32).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from specdial.engine import Engine
from specdial.models import LlamaForCausalLM
from specdial.models.config import ModelConfig

V = 8
CRITICAL_DF7_ALPHA_1E3 = 24.322
PROMPT = [1, 2, 3]
N = 3000


def tiny_model(seed: int, layers: int) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": V, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.5)  # peaky, clearly different distributions
    return model.eval()


def tiny_eagle(target: LlamaForCausalLM):
    """A random EAGLE head over ``target`` (weights N(0, 0.3) but the norms), seed 5."""
    import dataclasses

    from specdial.models import EagleHead
    from specdial.models.eagle import EAGLE_ARCHITECTURE

    cfg = dataclasses.replace(target.config, architecture=EAGLE_ARCHITECTURE, num_hidden_layers=1)
    torch.manual_seed(5)
    head = EagleHead(cfg, target.embed_tokens, target.lm_head).eval()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)
    return head


def exact_marginals(target: LlamaForCausalLM, sp: dict) -> tuple[np.ndarray, np.ndarray]:
    """P(t2) and P(t3) from target-only probabilities (same temperature/top-k processing)."""
    eng = Engine.from_modules(target, speculative_adaptive=False, max_running_requests=V * V,
                              kv_cache_tokens=4096, page_size=4)

    def probs(prefixes):
        return eng_probs(eng, prefixes, sp)

    p1 = probs([PROMPT])[0]
    p2_given = probs([PROMPT + [a] for a in range(V)])  # [V, V]
    p3_given = probs([PROMPT + [a, b] for a, b in itertools.product(range(V), range(V))])
    joint12 = p1[:, None] * p2_given
    m2 = joint12.sum(0)
    m3 = (joint12.reshape(-1, 1) * p3_given).sum(0)
    return m2, m3


def eng_probs(eng: Engine, prefixes: list[list[int]], sp: dict) -> np.ndarray:
    from specdial.worker.sampling import BatchSampling, SamplingParams, target_probs

    with torch.inference_mode():
        out = []
        for prefix in prefixes:
            ids = torch.tensor(prefix)
            logits = full_logits(eng.target, ids)[-1:]
            sampling = BatchSampling.from_params([SamplingParams.from_dict(sp)])
            out.append(target_probs(logits[None], sampling)[0, 0].double().numpy())
    return np.stack(out)


def full_logits(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    from specdial.attention import TorchAttentionBackend
    from specdial.models.batch import ForwardBatch

    n = ids.numel()
    backend = TorchAttentionBackend()
    pool = model.make_kv_pool(n)
    slots = torch.arange(n)
    meta = backend.plan(torch.tensor([n]), torch.tensor([n]), slots)
    batch = ForwardBatch(input_ids=ids, positions=torch.arange(n), out_loc=slots, attn=meta)
    return model.compute_logits(model(batch, pool, backend))


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("algo", ["DRAFT", "EAGLE"])
@pytest.mark.parametrize("sp", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 5}])
def test_speculative_sampling_keeps_the_target_distribution(algo, sp):
    target = tiny_model(0, layers=2)
    if algo == "DRAFT":
        drafter = tiny_model(1, layers=1)
    else:
        drafter = tiny_eagle(target)
    m2, m3 = exact_marginals(target, sp)
    eng = Engine.from_modules(target, drafter, speculative_adaptive=False, speculative_num_steps=2,
                              max_running_requests=N, kv_cache_tokens=N * 8, page_size=8)
    out = eng.generate(input_ids=[PROMPT] * N,
                       sampling_params=[{"max_new_tokens": 3, "seed": 1234 + i, **sp}
                                        for i in range(N)])
    ids = np.array([o["output_ids"] for o in out])
    assert ids.shape == (N, 3)
    verifies = sum(o["meta_info"]["spec_verify_ct"] for o in out)
    assert verifies < 2 * N, "some drafts must be accepted for the test to mean anything"
    s2 = chi2(np.bincount(ids[:, 1], minlength=V), m2)
    s3 = chi2(np.bincount(ids[:, 2], minlength=V), m3)
    assert s2 < CRITICAL_DF7_ALPHA_1E3, (s2, m2)
    assert s3 < CRITICAL_DF7_ALPHA_1E3, (s3, m3)
