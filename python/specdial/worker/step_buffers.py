"""The one buffer set of the step runners and the types their passes exchange.

- :func:`static_buffer_shapes` / :class:`StaticBuffers`: every fixed-address input buffer,
  sized from the **largest** steps value and the largest batch: verify rows
  ``max_bs * (max_steps + 1)``. SGLang #30549 / #35275: with adaptive steps, a shared buffer
  sized from the initial steps (128 rows) crashed when 32 requests x 8 draft tokens = 256 rows
  were replayed. The decode preparation writes a batch's inputs into these buffers once; an
  eager pass reads their prefix, a replayed graph the prefix padded to its size.
- :class:`KVLayout`: one flat list of KV slots per request covering positions
  ``0 .. lens[b] - 1`` (a ``RequestTables.kv_indices`` gather, or a ``SchedulePlan``'s
  ``kv_indices``/``kv_lens``); each pass attends to a prefix of it.
- :class:`VerifyOutput`, :class:`RunnerStats`: a verify pass's results, replay / fallback
  counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specdial.worker.graph_tables import PASSES

if TYPE_CHECKING:
    from specdial.worker.graph_tables import CapturePlan

I64 = torch.int64


def static_buffer_shapes(*, max_bs: int, max_steps: int, hidden_size: int, vocab_size: int,
                         kv_capacity: int,
                         feature_size: int | None = None) -> dict[str, tuple[int, ...]]:
    """Shape of every static buffer (and graph output) for batches up to ``max_bs`` requests and
    steps up to ``max_steps`` (``rows = max_bs * (max_steps + 1)`` verify tokens).
    ``feature_size``: width of the drafter's target features (EAGLE-1: ``hidden_size``, the
    default; EAGLE-3: the head's hidden size, its fused aux states).

    Inputs (fixed addresses, allocated by :class:`StaticBuffers`; int64 unless noted):

    - ``verify_input_ids`` / ``verify_positions`` / ``verify_out_loc`` ``[rows]``;
    - ``draft_input_ids`` / ``draft_positions`` / ``draft_out_loc`` ``[max_steps, max_bs]``,
      ``draft_first_hidden`` ``[max_bs, feature_size]`` (model dtype; EAGLE's ``h_{L-1}``);
    - ``extend_input_ids`` / ``extend_positions`` / ``extend_out_loc`` ``[rows]``,
      ``extend_hidden`` ``[rows, feature_size]`` (model dtype; EAGLE features);
    - per attention call site ``kv_capacity`` KV positions per request (the static attention
      metadata: ``[max_bs, kv_capacity]`` KV slots).

    Graph outputs (allocated in the graph pool at capture, listed for sizing):
    ``verify_hidden_out`` ``[rows, hidden]``, ``verify_features_out`` ``[rows, feature_size]``
    (EAGLE-3; EAGLE-1 features are the hidden states), ``verify_logits_out`` ``[rows, vocab]``
    float32, ``draft_tokens_out`` ``[max_bs, max_steps]`` (target ids, also for a drafter with
    a reduced vocabulary). Raises ``ValueError`` for sizes < 1 or ``max_steps < 0``.
    """
    feat = hidden_size if feature_size is None else feature_size
    if min(max_bs, hidden_size, vocab_size, kv_capacity, feat) < 1 or max_steps < 0:
        raise ValueError("static_buffer_shapes: sizes must be >= 1 and max_steps >= 0")
    rows = max_bs * (max_steps + 1)
    return {
        "verify_input_ids": (rows,), "verify_positions": (rows,), "verify_out_loc": (rows,),
        "draft_input_ids": (max_steps, max_bs), "draft_positions": (max_steps, max_bs),
        "draft_out_loc": (max_steps, max_bs), "draft_first_hidden": (max_bs, feat),
        "extend_input_ids": (rows,), "extend_positions": (rows,), "extend_out_loc": (rows,),
        "extend_hidden": (rows, feat), "attention_slots": (max_bs, kv_capacity),
        "verify_hidden_out": (rows, hidden_size), "verify_features_out": (rows, feat),
        "verify_logits_out": (rows, vocab_size), "draft_tokens_out": (max_bs, max_steps),
    }


_OUTPUTS = ("verify_hidden_out", "verify_features_out", "verify_logits_out", "draft_tokens_out",
            "attention_slots")
_FLOAT_BUFFERS = ("draft_first_hidden", "extend_hidden")


class StaticBuffers:
    """The one buffer set of an engine: the fixed-address inputs of every pass, eager or
    replayed, shared by all step runners (one steps value runs at a time).

    Sized by :func:`static_buffer_shapes` from ``max_bs`` and ``max_steps`` (the largest
    candidate steps, never the initial one) and the drafter's ``feature_size``; int64 on
    ``device`` except the feature buffers, which are ``dtype``. :meth:`check` validates a
    :class:`CapturePlan` against them. Besides the graph inputs of
    :func:`static_buffer_shapes`: ``ragged_positions`` / ``ragged_token_rows`` ``[rows]`` (a
    ragged pass's positions and per-token rows) and ``batch_rows`` / ``ragged_rows`` /
    ``kv_lens`` ``[max_bs]``, int64; ``draft_conf`` ``[max_bs, max_steps]`` float32 (the
    drafts' confidences a captured draft graph writes).
    """

    def __init__(self, *, max_bs: int, max_steps: int, hidden_size: int, vocab_size: int,
                 kv_capacity: int, dtype: torch.dtype, device: torch.device | str,
                 feature_size: int | None = None) -> None:
        self.max_bs, self.max_steps, self.kv_capacity = max_bs, max_steps, kv_capacity
        self.rows = max_bs * (max_steps + 1)
        self.device = torch.device(device)
        self.shapes = static_buffer_shapes(max_bs=max_bs, max_steps=max_steps,
                                           hidden_size=hidden_size, vocab_size=vocab_size,
                                           kv_capacity=kv_capacity, feature_size=feature_size)
        for name, shape in self.shapes.items():
            if name in _OUTPUTS:
                continue
            dt = dtype if name in _FLOAT_BUFFERS else I64
            setattr(self, name, torch.zeros(shape, dtype=dt, device=self.device))
        # eager-only inputs: ragged passes (prefill chunks, catch-up extends; longer ones
        # allocate) and the batch's rows / KV lengths
        z = lambda *shape: torch.zeros(*shape, dtype=I64, device=self.device)  # noqa: E731
        self.ragged_positions, self.ragged_token_rows = z(self.rows), z(self.rows)
        self.batch_rows, self.ragged_rows, self.kv_lens = z(max_bs), z(max_bs), z(max_bs)
        #: the draft pass's confidence of each draft (float32 ``[max_bs, max(max_steps, 1)]``,
        #: written by the captured draft graph)
        self.draft_conf = torch.zeros(max_bs, max(max_steps, 1), dtype=torch.float32,
                                      device=self.device)

    verify_input_ids: torch.Tensor
    verify_positions: torch.Tensor
    verify_out_loc: torch.Tensor
    draft_input_ids: torch.Tensor
    draft_positions: torch.Tensor
    draft_out_loc: torch.Tensor
    draft_first_hidden: torch.Tensor
    extend_input_ids: torch.Tensor
    extend_positions: torch.Tensor
    extend_out_loc: torch.Tensor
    extend_hidden: torch.Tensor

    def check(self, plan: CapturePlan) -> None:
        """Raise ``ValueError`` unless every graph of ``plan`` fits (``bs <= max_bs`` and
        ``bs * (steps + 1) <= rows``): the SGLang #30549 crash caught at start-up."""
        for steps, bs in plan.order():
            need = bs * (steps + 1)
            if bs > self.max_bs or steps > self.max_steps or need > self.rows:
                raise ValueError(
                    f"graph (steps={steps}, bs={bs}) needs {need} verify rows and {bs} requests;"
                    f" the static buffers hold {self.rows} rows / {self.max_bs} requests (sized "
                    f"for max_steps={self.max_steps}): size them from the largest candidate "
                    "steps and the largest graph batch (SGLang #30549)")


# --------------------------------------------------------------------------- attention
@dataclass
class KVLayout:
    """KV slots of positions ``0 .. lens[b] - 1`` of each request, request after request.

    ``indices`` ``[sum(lens)]`` int64 on the device; ``lens`` ``[B]`` host int64.
    """

    indices: torch.Tensor
    lens: np.ndarray

    def __post_init__(self) -> None:
        self.lens = np.asarray(self.lens, np.int64)
        if self.indices.dim() != 1 or int(self.lens.sum()) != self.indices.numel():
            raise ValueError(f"KVLayout: {self.indices.numel()} indices for lens summing to "
                             f"{int(self.lens.sum())}")

    @property
    def batch_size(self) -> int:
        return len(self.lens)

    @classmethod
    def from_host(cls, indices: Any, lens: Any, device: torch.device | str) -> "KVLayout":
        """From host arrays (numpy, a buffer such as ``SchedulePlan.kv_indices``)."""
        idx = torch.from_numpy(np.ascontiguousarray(np.asarray(indices, np.int64)))
        return cls(idx.to(device), np.asarray(lens, np.int64))


@dataclass
class VerifyOutput:
    """Verify pass results for ``B`` requests x ``n = steps + 1`` tokens.

    ``hidden`` ``[B * n, H]`` (model dtype, after the final norm); ``logits`` ``[B * n, V]``
    float32, or None when the runner does not compute logits; ``features`` ``[B * n, F]``: the
    drafter's target features (:func:`~specdial.worker.drafters.run_target`; None without an
    EAGLE drafter). Graph-pool tensors after a replay.
    """

    hidden: torch.Tensor
    logits: torch.Tensor | None
    features: torch.Tensor | None = None


@dataclass
class RunnerStats:
    """Counters: replays per pass, eager fallbacks with their reasons."""

    replays: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PASSES, 0))
    eager: dict[str, int] = field(default_factory=dict)

    def fallback(self, reason: str) -> None:
        self.eager[reason] = self.eager.get(reason, 0) + 1
