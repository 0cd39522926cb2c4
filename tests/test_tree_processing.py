"""Sampling processors on a draft tree's verify columns (issue 29): every column is processed
with its own path's history and position, checked against apply_processors called column by
column with the path spelled out in Python."""

from __future__ import annotations

import torch

from specdial.worker.batch_sampling import BatchSampling
from specdial.worker.processors import apply_processors
from specdial.worker.sampling_params import SamplingParams
from specdial.worker.tree_processing import process_tree_columns, repeat_rows

from tree_helpers import ToyLM, draft_tree


def test_each_column_uses_its_own_path_and_position():
    v, b = 12, 3
    params = [SamplingParams(repetition_penalty=1.7, frequency_penalty=0.6,
                             logit_bias={3: 1.5}),
              SamplingParams(temperature=0.8, presence_penalty=1.2, min_tokens=9),
              SamplingParams(temperature=0.7, frequency_penalty=-0.5, min_tokens=7)]
    prompt_lens = [4, 2, 5]
    proc = BatchSampling.from_params(params, prompt_lens=prompt_lens,
                                     min_tokens_ids=[(), (1, 2), (4,)]).processors
    drafter = ToyLM(v, seed=4, scale=1.0)
    prev, last = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    tree = draft_tree(drafter, prev, last, 3, 4, 14)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 3, (b, v), generator=g, dtype=torch.int32)
    seen = torch.rand(b, v, generator=g) < 0.3
    first_pos = torch.tensor([10, 7, 9])  # L + 1: rows 1 and 2 cross min_tokens in the tree
    logits = torch.randn(b, 15, v, generator=g)
    got = process_tree_columns(logits, proc, tree, last, first_pos, base, seen)
    for r in range(b):
        sub = repeat_rows(proc, 1)  # a copy; rows selected below through one-row batches
        for c in range(15):
            path, node = [], c - 1
            while node >= 0:
                path.append(int(tree.tokens[r, node]))
                node = int(tree.parents[r, node])
            hist = base[r].float().clone()
            for t in path + [int(last[r])]:
                hist[t] += 1
            depth = 0 if c == 0 else int(tree.depths[r, c - 1])
            pos = first_pos.clone()
            pos[r] += depth
            counts = base.float()[:, None, :].clone()
            counts[r, 0] = hist
            want = apply_processors(logits[:, c:c + 1], sub, pos, counts, seen)[r, 0]
            torch.testing.assert_close(got[r, c], want)
    assert not torch.equal(got, process_tree_columns(logits, proc, tree, last, first_pos,
                                                     base, seen * False))
