"""Sampling processors on a draft tree's verify columns: each column with its own path.

Penalties (repetition / frequency / presence), ``min_tokens`` and ``logit_bias``
(:mod:`specdial.worker.processors`) make the target's distribution at a tree node depend on
the tokens of its path: column ``c`` (the root or a node) decides sequence position
``L + 1 + depth(c)`` and its history is ``[0, L)`` plus the tokens of ``c``'s ancestors and
``c`` itself (the root ``x_L`` included), exactly what plain decoding has at that position
once those tokens were emitted. :func:`process_tree_columns` builds those per-column counts
with one batched product of the ancestor mask and the columns' one-hot tokens, and applies
the processors to the ``B * (N + 1)`` columns as rows of one call (rows repeated by
:func:`repeat_rows`), so no loop runs over nodes or requests.

The drafter's own tree is drafted from its raw logits: the processors only change what is
accepted, never what is emitted (any proposal is verified exactly).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from specdial.worker.processors import BatchProcessors, apply_processors
from specdial.worker.tree import DraftTree, ancestor_mask

__all__ = ["process_tree_columns", "repeat_rows", "step_histories", "tree_histories"]


def repeat_rows(proc: BatchProcessors, reps: int) -> BatchProcessors:
    """``proc`` with every row repeated ``reps`` times in place (row ``i`` becomes rows
    ``i * reps .. i * reps + reps - 1``), its ``(row, token)`` pairs repeated with it."""
    dev = proc.repetition.device
    off = torch.arange(reps, device=dev)

    def rows(r: torch.Tensor) -> torch.Tensor:
        return (r[:, None] * reps + off).reshape(-1)

    out = dataclasses.replace(
        proc, repetition=proc.repetition.repeat_interleave(reps),
        frequency=proc.frequency.repeat_interleave(reps),
        presence=proc.presence.repeat_interleave(reps),
        min_tokens=proc.min_tokens.repeat_interleave(reps),
        prompt_lens=proc.prompt_lens.repeat_interleave(reps),
        stop_rows=rows(proc.stop_rows), stop_ids=proc.stop_ids.repeat_interleave(reps),
        penalized=np.repeat(proc.penalized, reps),
        prompt_lens_host=np.repeat(proc.prompt_lens_host, reps))
    if proc.bias_rows is not None:
        assert proc.bias_ids is not None and proc.bias_values is not None
        out.bias_rows = rows(proc.bias_rows)
        out.bias_ids = proc.bias_ids.repeat_interleave(reps)
        out.bias_values = proc.bias_values.repeat_interleave(reps)
    return out


def tree_histories(base: torch.Tensor, tree: DraftTree, root_ids: torch.Tensor) -> torch.Tensor:
    """Per-column generated-token counts ``[B, N + 1, V]`` float32: ``base`` ``[B, V]`` (the
    counts over ``[0, L)``) plus one of each token on the column's path, the root ``x_L``
    (``root_ids`` ``[B]``) and the column itself included."""
    b, v = base.shape
    cols = torch.cat([root_ids[:, None], tree.tokens], 1)  # [B, N + 1]
    onehot = torch.zeros(b, cols.shape[1], v, dtype=torch.float32, device=base.device)
    onehot.scatter_(2, cols[..., None], 1.0)
    return base[:, None, :].float() + torch.bmm(ancestor_mask(tree.parents).float(), onehot)


def process_tree_columns(logits: torch.Tensor, proc: BatchProcessors, tree: DraftTree,
                         root_ids: torch.Tensor, first_pos: torch.Tensor,
                         base: torch.Tensor | None, prompt_seen: torch.Tensor | None
                         ) -> torch.Tensor:
    """Processed verify logits ``[B, N + 1, V]`` float32, column ``c`` with its own path's
    history (module docstring). ``first_pos`` ``[B]`` int64: ``L + 1``; ``base`` ``[B, V]``
    and ``prompt_seen`` ``[B, V]``: the rows' counts over ``[0, L)`` (required when
    ``proc.any_penalty``; :meth:`~specdial.worker.processors.TokenCounts.gather`)."""
    b, cols, v = logits.shape
    _, depth = tree.columns()
    positions = (first_pos.to(torch.int64)[:, None] + depth).reshape(-1)
    counts = seen = None
    if proc.any_penalty:
        if base is None or prompt_seen is None:
            raise ValueError("process_tree_columns: penalties need base counts and "
                             "prompt_seen")
        counts = tree_histories(base, tree, root_ids).reshape(b * cols, 1, v)
        seen = prompt_seen.repeat_interleave(cols, 0)
    out = apply_processors(logits.reshape(b * cols, 1, v), repeat_rows(proc, cols), positions,
                           counts, seen)
    return out.view(b, cols, v)


def step_histories(worker: Any, proc: BatchProcessors, rows: np.ndarray, ends: np.ndarray
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The worker's penalized rows' counts brought up to ``ends`` (host ``[B]``, the target
    lengths), then ``(base [B, V], prompt_seen [B, V])`` of ``rows``; ``(None, None)``
    without penalties."""
    if not proc.any_penalty:
        return None, None
    pen = proc.penalized
    worker.token_counts.catch_up(rows[pen], ends[pen], proc.prompt_lens_host[pen],
                                 worker.tables.req_to_ids)
    return worker.token_counts.gather(torch.from_numpy(rows).to(worker.device))
