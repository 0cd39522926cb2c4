"""Logits processors that depend on a request's own tokens, exact under speculative decoding.

Controls (one value per request, from :class:`~specdial.worker.sampling.SamplingParams`):

- ``repetition_penalty`` ``r`` (vLLM's rule, from the CTRL paper, Keskar et al. 2019, as in HF
  transformers' ``RepetitionPenaltyLogitsProcessor``): for every token that occurs in the
  prompt *or* among the generated tokens, a positive logit is divided by ``r`` and a
  non-positive one multiplied by ``r``; ``r = 1`` is off.
- ``frequency_penalty`` ``f`` and ``presence_penalty`` ``a`` (OpenAI's API reference, "Parameter
  details"; vLLM applies the same formula): ``logit -= f * c + a * [c > 0]`` where ``c`` counts
  the token among the generated tokens only (not the prompt); ``0`` is off.
- ``min_tokens`` ``m`` (vLLM's ``MinTokensLogitsProcessor``): while the output holds fewer
  than ``m`` tokens, the EOS token ids and the request's ``stop_token_ids`` get logit ``-inf``
  (vLLM masks EOS here even with ``ignore_eos``).

- ``logit_bias`` (OpenAI's and vLLM's; :mod:`specdial.worker.logit_bias`): ``logit[id] +=
  bias`` for each of the request's ``(id, bias)`` entries, at every position. It does not depend
  on the history; applying it at every draft step and verify column keeps speculation exact.

Order, as vLLM's sampler: ``min_tokens`` masking, then ``logit_bias``, then the repetition,
frequency and presence penalties, on the raw logits; then :func:`~specdial.worker.sampling.target_probs` (temperature,
top-k, min-p, top-p). Greedy requests take the argmax of the processed logits (vLLM applies
penalties and ``min_tokens`` before its greedy argmax too). Log-probabilities reported to users
stay the raw ones (vLLM's default ``raw_logprobs``).

The history at a position. The token decided at sequence position ``t`` of a request with a
``P``-token prompt sees, in plain decoding, the generated tokens at positions ``P..t-1``. In one
verify over ``[x_L, d_1..d_k]`` (positions ``L..L+k``), column ``i`` decides position
``L + 1 + i`` and its history is the committed sequence ``[0, L]`` plus the drafts
``d_1..d_i``: its counts are the row's committed counts over ``[0, L)`` plus a cumulative sum
of one-hot rows over the verify's input tokens ``0..i`` (:meth:`StepProcessing.verify`). Draft
step ``i`` decides the same position with the same history (its input tokens ``x_L,
d_1..d_i``: :meth:`StepProcessing.draft_step`). So the processed target distribution at every
column is exactly the one plain decoding samples from at that position, and the acceptance
rules of :func:`~specdial.worker.sampling.speculative_accept` (greedy, coupled seeded draws,
rejection sampling) stay exact. Everything is batched: index and scatter operations over the
rows and the ``k + 1`` columns, no per-request Python loop and no host sync.

State (:class:`TokenCounts`, one per worker): per worker row, on the device,
``output_counts [rows, V]`` int32 (occurrences among positions ``[P, valid_len)``) and
``prompt_seen [rows, V]`` bool (tokens at positions ``[0, min(P, valid_len))``), allocated on
the first penalized request; on the host ``valid_len [rows]``. Before a sampling step a
penalized row is brought up to its target length ``L`` from the worker's token table over
``[valid_len, L)`` (after a verify: the accepted tokens; after a prefill: the prompt). A row
assigned to a request (a new one, or a preempted one resuming, which re-prefills from 0) or
given back (finished, aborted, preempted) is reset to ``valid_len = 0``; its device rows are
zeroed at its next catch-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from specdial.worker.runtime import ragged_positions
from specdial.worker.sampling_params import SamplingParams

__all__ = ["BatchProcessors", "StepProcessing", "TokenCounts", "apply_processors",
           "column_counts"]


@dataclass
class BatchProcessors:
    """The history-dependent processors of one batch, per row (built once per composition).

    - ``repetition`` / ``frequency`` / ``presence`` ``[B]`` float32 (``1`` / ``0`` / ``0`` on
      rows without that penalty, which leaves their logits bit-for-bit unchanged).
    - ``min_tokens`` ``[B]`` int64 and ``prompt_lens`` ``[B]`` int64 (tokens).
    - ``stop_rows`` / ``stop_ids`` ``[M]`` int64: the ``(row, token)`` pairs masked while that
      row's output is shorter than its ``min_tokens`` (rows with ``min_tokens > 0`` only).
    - ``any_penalty`` / ``any_min_tokens``: Python flags (no device sync in the passes).
    - ``penalized`` ``[B]`` bool and ``prompt_lens_host`` ``[B]`` int64 (numpy): the rows whose
      token counts are kept (:class:`TokenCounts`), and their prompt lengths.
    - ``bias_rows`` / ``bias_ids`` ``[N]`` int64 and ``bias_values`` ``[N]`` float32: the
      ``logit_bias`` entries as ``(row, token, bias)``; ``any_bias`` a Python flag.
    """

    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    min_tokens: torch.Tensor
    prompt_lens: torch.Tensor
    stop_rows: torch.Tensor
    stop_ids: torch.Tensor
    any_penalty: bool
    any_min_tokens: bool
    penalized: np.ndarray
    prompt_lens_host: np.ndarray
    bias_rows: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    any_bias: bool = False

    @classmethod
    def build(cls, params: Sequence[SamplingParams], prompt_lens: Sequence[int] | None,
              min_tokens_ids: Sequence[Sequence[int]] | None,
              device: torch.device | str) -> BatchProcessors | None:
        """The processors of rows ``params`` (batch order), or None when no row uses one.

        ``prompt_lens``: each row's prompt length in tokens; ``min_tokens_ids``: per row, the
        token ids masked under ``min_tokens`` (EOS and ``stop_token_ids``, ids ``< V``). Raises
        ``ValueError`` when a row uses a processor and either is missing or has the wrong
        length."""
        penalized = np.array([p.has_penalty for p in params], bool)
        minned = [p.min_tokens > 0 for p in params]
        bias = [(r, t, v) for r, p in enumerate(params) for t, v in p.logit_bias]
        if not penalized.any() and not any(minned) and not bias:
            return None
        b = len(params)
        if not penalized.any() and not any(minned):  # logit_bias only: no history needed
            prompt_lens = [0] * b
        if prompt_lens is None or len(prompt_lens) != b:
            raise ValueError(f"BatchProcessors: penalties and min_tokens need the prompt length "
                             f"of each of the {b} rows")
        if any(minned) and (min_tokens_ids is None or len(min_tokens_ids) != b):
            raise ValueError(f"BatchProcessors: min_tokens needs the masked token ids of each "
                             f"of the {b} rows")
        pairs = [(r, t) for r, m in enumerate(minned) if m
                 for t in sorted(set(min_tokens_ids[r]))] if any(minned) else []  # type: ignore[index]
        if not penalized.any() and not pairs and not bias:  # min_tokens without an id to mask
            return None
        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def i64(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        lens = np.asarray(prompt_lens, np.int64)
        return cls(
            repetition=f32([p.repetition_penalty for p in params]),
            frequency=f32([p.frequency_penalty for p in params]),
            presence=f32([p.presence_penalty for p in params]),
            min_tokens=i64([p.min_tokens for p in params]),
            prompt_lens=torch.from_numpy(lens).to(device),
            stop_rows=i64([r for r, _ in pairs]), stop_ids=i64([t for _, t in pairs]),
            any_penalty=bool(penalized.any()), any_min_tokens=bool(pairs),
            penalized=penalized, prompt_lens_host=lens,
            bias_rows=i64([r for r, _, _ in bias]), bias_ids=i64([t for _, t, _ in bias]),
            bias_values=f32([v for _, _, v in bias]), any_bias=bool(bias))

    def select(self, index: torch.Tensor) -> BatchProcessors | None:
        """The rows ``index`` (``[B']`` int64, new batch order); None when none of them uses a
        processor. Reads ``index`` back to the host (call when the composition changes)."""
        idx = index.cpu().numpy()
        penalized = self.penalized[idx]
        dev = self.repetition.device
        index = index.to(dev)
        min_tokens = self.min_tokens.index_select(0, index)
        # pairs of the kept rows, renumbered to their new positions
        new_row = torch.full((self.penalized.shape[0],), -1, dtype=torch.int64, device=dev)
        new_row[index] = torch.arange(index.numel(), device=dev)
        mapped = new_row[self.stop_rows]
        keep = mapped >= 0
        any_min = bool(keep.any())
        bias_rows = bias_ids = bias_values = None
        any_bias = False
        if self.any_bias:
            assert self.bias_rows is not None and self.bias_ids is not None
            mapped_bias = new_row[self.bias_rows]
            kept = mapped_bias >= 0
            any_bias = bool(kept.any())
            bias_rows, bias_ids = mapped_bias[kept], self.bias_ids[kept]
            bias_values = self.bias_values[kept]  # type: ignore[index]
        if not penalized.any() and not any_min and not any_bias:
            return None
        return BatchProcessors(
            self.repetition.index_select(0, index), self.frequency.index_select(0, index),
            self.presence.index_select(0, index), min_tokens,
            self.prompt_lens.index_select(0, index), mapped[keep], self.stop_ids[keep],
            bool(penalized.any()), any_min, penalized, self.prompt_lens_host[idx],
            bias_rows, bias_ids, bias_values, any_bias)


def column_counts(base: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-column history counts: ``base`` ``[B, V]`` (any numeric dtype) plus, at column ``i``,
    one occurrence of each of ``tokens[:, 0..i]`` (``[B, n]`` int64 in ``[0, V)``) ->
    ``[B, n, V]`` float32 (a scatter of ones and a cumulative sum over the columns)."""
    b, n = tokens.shape
    inc = torch.zeros(b, n, base.shape[1], dtype=torch.float32, device=base.device)
    inc.scatter_(2, tokens[..., None], 1.0)
    return base[:, None, :].float() + inc.cumsum(1)


def apply_processors(logits: torch.Tensor, proc: BatchProcessors, positions: torch.Tensor,
                     counts: torch.Tensor | None = None,
                     prompt_seen: torch.Tensor | None = None) -> torch.Tensor:
    """Processed logits ``[B, n, V]`` float32 (a new tensor; ``logits`` is not modified).

    ``positions`` ``[B]`` int64: the sequence position decided by column 0 (column ``i``
    decides ``positions + i``; its output length is ``positions + i - prompt_len``).
    ``counts`` ``[B, n, V]`` float32 (or ``[B, 1, V]``, broadcast): occurrences of each token
    among the generated tokens of each column's history; ``prompt_seen`` ``[B, V]`` bool: the
    prompt's tokens. Both are required when ``proc.any_penalty``, else ignored. Rules and order
    in the module docstring; rows at neutral values are returned unchanged, bit for bit.
    Raises ``ValueError`` on a missing history or a batch-size mismatch.
    """
    b, n, _ = logits.shape
    if proc.repetition.shape[0] != b or positions.shape[0] != b:
        raise ValueError(f"apply_processors: logits have {b} rows, the processors "
                         f"{proc.repetition.shape[0]} and positions {positions.shape[0]}")
    x = logits.float()
    if proc.any_min_tokens:
        x = x.clone()
        cols = torch.arange(n, device=x.device)
        out_len = positions.to(x.device)[:, None] + cols - proc.prompt_lens[:, None]  # [B, n]
        active = out_len < proc.min_tokens[:, None]
        r, t = proc.stop_rows, proc.stop_ids
        x[r, :, t] = x[r, :, t].masked_fill(active[r], -math.inf)
    if proc.any_bias:
        if not proc.any_min_tokens:
            x = x.clone()
        r, t = proc.bias_rows, proc.bias_ids
        x[r, :, t] = x[r, :, t] + proc.bias_values[:, None].to(x.device)  # type: ignore[index]
    if proc.any_penalty:
        if counts is None or prompt_seen is None:
            raise ValueError("apply_processors: penalties need counts and prompt_seen")
        present = counts > 0
        rep = torch.where(prompt_seen[:, None, :] | present, proc.repetition.view(b, 1, 1), 1.0)
        x = torch.where(x > 0, x / rep, x * rep)  # a new tensor: the input is never modified
        x.sub_(counts * proc.frequency.view(b, 1, 1)).sub_(present * proc.presence.view(b, 1, 1))
    elif not proc.any_min_tokens and not proc.any_bias:
        x = x.clone()
    return x


class StepProcessing:
    """The processing of one sampling step of a batch whose :class:`BatchProcessors` is
    ``proc``: a prefill's first tokens, or a decode iteration's drafts and verify.

    ``positions`` ``[B]`` int64 (device): the position decided first (a prefill: the prompt
    length; a decode at target length ``L``: ``L + 1``). ``base`` ``[B, V]`` int32 and
    ``prompt_seen`` ``[B, V]`` bool: the rows' counts over ``[0, L)`` (:meth:`TokenCounts.gather`;
    None without penalties). Use :meth:`first`, or :meth:`draft_step` for ``i = 0..k-1`` in
    order and :meth:`verify`.
    """

    def __init__(self, proc: BatchProcessors, positions: torch.Tensor,
                 base: torch.Tensor | None, prompt_seen: torch.Tensor | None) -> None:
        self.proc, self.positions = proc, positions
        self.base, self.prompt_seen = base, prompt_seen
        self._running: torch.Tensor | None = None

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` logits of the token at ``positions`` (history: ``[0, positions)``, the
        counts as they are) -> processed ``[B, V]``."""
        counts = None if self.base is None else self.base[:, None, :].float()
        return apply_processors(logits[:, None], self.proc, self.positions, counts,
                                self.prompt_seen)[:, 0]

    def draft_step(self, logits: torch.Tensor, i: int, input_ids: torch.Tensor) -> torch.Tensor:
        """Draft step ``i`` (0-based): ``[B, V]`` drafter logits over the target vocabulary for
        position ``positions + i``, whose input token ``input_ids`` ``[B]`` (``x_L``, then
        ``d_i``) joins the history -> processed ``[B, V]``. Steps must come in order."""
        if self.base is not None:
            if i == 0:
                self._running = self.base.float()
            assert self._running is not None
            self._running.scatter_add_(1, input_ids.view(-1, 1),
                                       torch.ones_like(self._running[:, :1]))
        counts = None if self._running is None else self._running[:, None, :]
        return apply_processors(logits[:, None], self.proc, self.positions + i, counts,
                                self.prompt_seen)[:, 0]

    def verify(self, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Verify logits ``[B, n, V]`` over the input tokens ``input_ids`` ``[B, n]``
        (``[x_L, d_1..d_k]``): column ``i`` is processed with the history ``[0, L)`` plus
        ``input_ids[:, 0..i]`` -> processed ``[B, n, V]``."""
        counts = None if self.base is None else column_counts(self.base, input_ids)
        return apply_processors(logits, self.proc, self.positions, counts, self.prompt_seen)


class TokenCounts:
    """Per worker row token counts on the device (see the module docstring).

    ``rows``: the worker's rows (``max_running_requests``); ``vocab_size`` ``V``. The tensors
    (``output_counts`` ``[rows, V]`` int32, ``prompt_seen`` ``[rows, V]`` bool) are allocated on
    the first :meth:`catch_up`; ``valid_len`` ``[rows]`` (numpy int64) is the length up to which
    each row's counts are valid.
    """

    def __init__(self, rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.valid_len = np.zeros(rows, np.int64)
        self.output_counts: torch.Tensor | None = None
        self.prompt_seen: torch.Tensor | None = None

    def reset(self, rows: Iterable[int] | np.ndarray) -> None:
        """Rows given to a new request or given back: their history restarts at position 0."""
        self.valid_len[np.asarray(list(rows) if not isinstance(rows, np.ndarray) else rows,
                                  np.int64)] = 0

    def catch_up(self, rows: np.ndarray, ends: np.ndarray, prompt_lens: np.ndarray,
                 token_table: torch.Tensor) -> None:
        """Count positions ``[valid_len[r], ends[r])`` of each row ``r`` of ``rows`` (``[R]``
        int64, numpy, like ``ends`` and ``prompt_lens``) from ``token_table`` ``[rows, W]``
        int64 (the worker's ``req_to_ids``): positions below the row's prompt length mark
        ``prompt_seen``, later ones add to ``output_counts``. Device scatters only (host index
        arrays, no sync). Raises ``RuntimeError`` when a row's ``ends`` is below its valid
        length (a row reused without :meth:`reset`: a bug)."""
        if not len(rows):
            return
        if self.output_counts is None:
            n = self.valid_len.shape[0]
            self.output_counts = torch.zeros(n, self.vocab_size, dtype=torch.int32,
                                             device=self.device)
            self.prompt_seen = torch.zeros(n, self.vocab_size, dtype=torch.bool,
                                           device=self.device)
        assert self.prompt_seen is not None
        start = self.valid_len[rows]
        if (ends < start).any():
            raise RuntimeError(f"token counts of rows {rows.tolist()} are valid up to "
                               f"{start.tolist()}, past the requested {ends.tolist()}")
        fresh = rows[start == 0]
        if len(fresh):
            fresh_d = torch.from_numpy(fresh).to(self.device)
            self.output_counts[fresh_d] = 0
            self.prompt_seen[fresh_d] = False
        row_rep, pos = ragged_positions(rows, start, ends)
        in_prompt = pos < np.repeat(prompt_lens, ends - start)
        for mask, target in ((in_prompt, self.prompt_seen), (~in_prompt, self.output_counts)):
            if mask.any():
                r = torch.from_numpy(row_rep[mask]).to(self.device)
                ids = token_table[r, torch.from_numpy(pos[mask]).to(self.device)]
                if target.dtype == torch.bool:
                    target[r, ids] = True
                else:
                    target.index_put_((r, ids), torch.ones_like(ids, dtype=torch.int32),
                                      accumulate=True)
        self.valid_len[rows] = ends

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output counts [B, V] int32, prompt_seen [B, V] bool)`` of ``rows`` (``[B]`` int64,
        device). Rows never caught up read zeros (or another request's stale counts, which
        only rows at neutral penalties may do: their values leave the logits unchanged)."""
        if self.output_counts is None or self.prompt_seen is None:
            v = self.vocab_size
            return (torch.zeros(rows.numel(), v, dtype=torch.int32, device=self.device),
                    torch.zeros(rows.numel(), v, dtype=torch.bool, device=self.device))
        return self.output_counts[rows], self.prompt_seen[rows]
