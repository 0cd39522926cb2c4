"""Lossless sampling with an EAGLE-3 drafter (docs/design.md invariant 2), end to end.

The head drafts over 6 of the 8 target tokens (a shuffled draft vocabulary: ``d2t`` is not the
identity), so its ``q`` is zero on two target tokens and those can only come from the rejection
residual or the bonus token. As in tests/test_engine_sampling.py (whose helpers this uses), the
marginals of the 2nd and 3rd completion tokens at steps 2 must match the exact target-only
marginals by a chi-square test at alpha = 1e-3 (df = 7), for seeded requests (keyed draws) and
for unseeded ones (the engine generator)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdial.engine import Engine
from specdial.models import Eagle3Head, Eagle3Spec, ModelConfig
from specdial.worker.drafters import Eagle3Drafter
from specdial.worker.sampling import BatchSampling, SamplingParams
from test_engine_sampling import (CRITICAL_DF7_ALPHA_1E3, PROMPT, V, chi2, exact_marginals,
                                  tiny_model)

N = 3000
DRAFT_VOCAB = [5, 2, 7, 0, 3, 6]  # draft id i is target token DRAFT_VOCAB[i]; 1 and 4 absent


def eagle3_head(target) -> Eagle3Head:
    cfg = ModelConfig.from_dict({**target.config.to_dict(), "num_hidden_layers": 1,
                                 "architectures": ["LlamaForCausalLMEagle3"]})
    spec = Eagle3Spec(aux_layers=(0, 1, 2), target_hidden_size=cfg.hidden_size,
                      draft_vocab_size=len(DRAFT_VOCAB))
    torch.manual_seed(7)
    head = Eagle3Head(cfg, spec, target.embed_tokens)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)
    head.set_vocab_map(torch.tensor(DRAFT_VOCAB) - torch.arange(len(DRAFT_VOCAB)))
    return head.eval()


def test_draft_distribution_lives_on_the_mapped_target_ids():
    target = tiny_model(0, layers=2)
    drafter = Eagle3Drafter(eagle3_head(target), target)
    logits = torch.randn(4, len(DRAFT_VOCAB))
    full = drafter.to_target_logits(logits)
    assert torch.equal(full[:, DRAFT_VOCAB], logits)
    assert torch.isinf(full[:, [1, 4]]).all() and (full[:, [1, 4]] < 0).all()
    assert drafter.to_target_ids(torch.arange(len(DRAFT_VOCAB))).tolist() == DRAFT_VOCAB
    # sampled drafts and their q: target ids of the draft vocabulary, q = 0 elsewhere
    from specdial.attention import TorchAttentionBackend
    from specdial.models import ForwardBatch

    backend, b, k = TorchAttentionBackend(), 64, 2
    drafter.init_kv(b * (k + 1))
    slots = torch.arange(b * k).view(k, b)
    steps = []
    for i in range(k):
        meta = backend.plan(torch.ones(b, dtype=torch.int64), torch.full((b,), i + 1),
                            slots[: i + 1].T.reshape(-1))
        ids = torch.full((b,), 3) if i == 0 else torch.zeros(b, dtype=torch.int64)
        steps.append(ForwardBatch(ids, torch.full((b,), i), slots[i], meta))
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0)] * b)
    with torch.inference_mode():
        tokens, q = drafter.draft(k, steps, backend, first_hidden=torch.zeros(b, 32),
                                  sampling=sampling, generator=torch.Generator().manual_seed(0))
    assert set(tokens.unique().tolist()) <= set(DRAFT_VOCAB)
    assert q is not None and q.shape == (b, k, V) and (q[..., [1, 4]] == 0).all()
    torch.testing.assert_close(q.sum(-1), torch.ones(b, k))


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("sp", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 5}])
def test_eagle3_sampling_keeps_the_target_distribution(sp, seeded):
    target = tiny_model(0, layers=2)
    m2, m3 = exact_marginals(target, sp)
    eng = Engine.from_modules(target, eagle3_head(target), speculative_adaptive=False,
                              speculative_num_steps=2, max_running_requests=N,
                              kv_cache_tokens=N * 8, page_size=8, seed=99)
    assert eng.speculative_algorithm == "EAGLE3"
    params = [{"max_new_tokens": 3, **sp, **({"seed": 4321 + i} if seeded else {})}
              for i in range(N)]
    out = eng.generate(input_ids=[PROMPT] * N, sampling_params=params)
    ids = np.array([o["output_ids"] for o in out])
    assert ids.shape == (N, 3)
    verifies = sum(o["meta_info"]["spec_verify_ct"] for o in out)
    assert verifies < 2 * N, "some drafts must be accepted for the test to mean anything"
    if m2[[1, 4]].sum() > 0.02:  # tokens outside the draft vocabulary still occur
        assert np.isin(ids[:, 1], [1, 4]).any()
    s2 = chi2(np.bincount(ids[:, 1], minlength=V), m2)
    s3 = chi2(np.bincount(ids[:, 2], minlength=V), m3)
    assert s2 < CRITICAL_DF7_ALPHA_1E3, (s2, m2)
    assert s3 < CRITICAL_DF7_ALPHA_1E3, (s3, m3)
