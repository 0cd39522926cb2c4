"""Grammar masks under speculation: per-position allowed-token masks for drafts and verify.

A batch's constrained rows (:class:`BatchGrammar`, each with its request's xgrammar matcher,
:mod:`specdial.worker.grammar`) and one decode iteration's masks (:class:`GrammarStep`), after
SGLang's and vLLM's structured outputs with speculative decoding, with the drafts masked too:

- column ``j`` of the verify (the target's distribution of the token after ``x_L, d_1..d_j``)
  and draft level ``j`` (which proposes ``d_{j+1}`` from the same prefix) share one mask: the
  matcher's state after accepting ``d_1..d_j``. Level 0's mask is the request's current state;
  before level ``j >= 1`` the matcher accepts ``d_j`` and fills mask ``j``; the verify adds mask
  ``k`` (after ``d_k``) and rolls every drafted token back. So the drafter proposes only allowed
  tokens (acceptance stays high) and the target's masked distribution is exactly the
  constrained one at each position.
- after the iteration's host copy, :meth:`BatchGrammar.advance` accepts each row's emitted
  tokens (accepted drafts and the bonus token) once.
- a draft the matcher refuses (a level a request did not draft under a per-request budget, a
  filler draw) ends that row's chain: its later columns are unreachable (the refused draft has
  target probability 0 and is rejected) and get an all-allowed mask; a matcher that reached its
  end (a stop token accepted) allows only the stop tokens.

Masks: int32 bitmasks ``[B, ceil(V / 32)]`` filled on the host (rows without a grammar stay
all ones), copied to the device and unpacked to bool ``[B, V]`` with one vectorised shift
(:func:`unpack_bitmask`); logits are masked with one ``masked_fill`` per pass
(``-inf`` where not allowed). Host syncs: one per draft level ``>= 1`` and one for the verify's
last column (the matcher runs on the host and needs the drafted ids), only in batches with a
constrained row; a batch without one never builds any of this (``BatchSampling.grammar`` is
None). One sync per iteration, as an unconstrained batch has, is not possible here: the mask of
draft level ``j + 1`` depends on the draft ``d_j`` the device sampled at level ``j`` under mask
``j``, so the host must read ``d_j`` before the drafter's next level
(:meth:`BatchGrammar.level_mask`).

Tensor parallelism: the matchers stay on rank 0 (they do not pickle; rank 0 owns the
requests). Rank 0's :class:`BatchGrammar` shares each packed mask with the other ranks
(``share``: the group's broadcast) as it makes it; a worker rank gets :class:`GrammarOnWire`
with its inputs and masks with rank 0's masks (:class:`MirroredGrammar`), so its passes, and
the tokens every rank samples, are the same as rank 0's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
import xgrammar as xgr

from specdial.worker.grammar import dead_end

__all__ = ["BatchGrammar", "GrammarOnWire", "GrammarStep", "MirroredGrammar", "fill_row",
           "unpack_bitmask"]

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 ``[R, W]`` (bit ``j`` of word ``w``: token ``32 w + j``) -> bool ``[R, V]``."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32,
                                                         device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def fill_row(matcher: Any, bitmask: torch.Tensor, row: int) -> None:
    """Row ``row`` of an int32 ``bitmask`` ``[B, W]``: ``matcher``'s allowed next tokens; a
    matcher past its end (a stop token accepted: only reachable with ``ignore_eos``) allows
    its stop tokens only, and so does a dead end (a grammar with no continuation here, e.g.
    an empty character class after some text: :func:`~specdial.worker.grammar.dead_end`),
    so that no row's distribution is all ``-inf`` (NaN); the engine fails such a request when
    it ends (:func:`~specdial.engine.grammar_gate.grammar_end_error`)."""
    if not matcher.is_terminated():
        matcher.fill_next_token_bitmask(bitmask, row)
        if bool(bitmask[row].any()):
            return
    words = np.zeros(bitmask.shape[1], np.uint32)
    for t in matcher.stop_token_ids:
        words[t // 32] |= np.uint32(1 << (t % 32))
    bitmask[row] = torch.from_numpy(words.view(np.int32))


class BatchGrammar:
    """The constrained rows of one batch: ``matchers`` (one per row in batch order, None for
    a row without a constraint; at least one not None), ``vocab_size`` ``V``, ``device``.
    Built once per batch composition (``BatchSampling.grammar``); the matchers are the
    requests' own, so their state carries over between iterations and batches."""

    def __init__(self, matchers: Sequence[Any], vocab_size: int, device: torch.device,
                 share: Callable[[torch.Tensor], Any] | None = None) -> None:
        self.share = share
        self.rows = [b for b, m in enumerate(matchers) if m is not None]
        if not self.rows:
            raise ValueError("BatchGrammar: no row has a grammar (pass None instead)")
        self.matchers = [matchers[b] for b in self.rows]
        self.batch_size, self.vocab_size, self.device = len(matchers), vocab_size, device
        self.words = math.ceil(vocab_size / 32)
        self.rows_dev = torch.tensor(self.rows, dtype=torch.int64, device=device)

    @classmethod
    def build(cls, matchers: Sequence[Any], vocab_size: int, device: torch.device | str
              ) -> BatchGrammar | None:
        """A :class:`BatchGrammar`, or None when no row has a matcher."""
        if all(m is None for m in matchers):
            return None
        return cls(matchers, vocab_size, torch.device(device))

    def current_mask(self) -> torch.Tensor:
        """bool ``[B, V]`` on the device: each row's allowed next tokens now."""
        bm = xgr.allocate_token_bitmask(self.batch_size, self.vocab_size)
        for b, m in zip(self.rows, self.matchers):
            fill_row(m, bm, b)
        return self._publish(bm)

    def _publish(self, bm: torch.Tensor) -> torch.Tensor:
        """The packed host ``bm`` ``[B, W]`` on the device (shared with the other
        tensor-parallel ranks when :attr:`share` is set), unpacked to bool ``[B, V]``."""
        packed = bm.to(self.device)
        if self.share is not None:
            self.share(packed)
        return unpack_bitmask(packed, self.vocab_size)

    def level_mask(self, step: GrammarStep, tokens: torch.Tensor) -> torch.Tensor:
        """bool ``[B, V]``: mask ``j`` of ``step`` after ``tokens`` ``[B]`` (device; ``d_j``
        of every row): each matcher accepts its row's draft (counted in ``step.drafted``,
        rolled back by :meth:`GrammarStep.rollback`) and fills its row; a refused draft ends
        the row (``step.ended``: all-allowed from then on, unreachable columns).

        The level's one host sync is here: the matchers run on the host and need ``d_j``,
        which the device sampled from the masked drafter distribution of level ``j - 1``. So a
        constrained batch syncs once per draft level (and once for the verify's last column),
        not once per iteration: mask ``j + 1`` cannot be known before ``d_j`` is sampled, and
        the drafter's level ``j + 1`` needs it."""
        host = tokens.index_select(0, self.rows_dev).cpu().numpy()  # the level's one sync
        bm = xgr.allocate_token_bitmask(self.batch_size, self.vocab_size)
        for i, (b, m) in enumerate(zip(self.rows, self.matchers)):
            if step.ended[i]:
                continue  # row stays all-allowed: unreachable columns
            if not m.is_terminated() and m.accept_token(int(host[i])):
                step.drafted[i] += 1
                fill_row(m, bm, b)
            elif m.is_terminated() or dead_end(m, self.vocab_size):
                # the stop tokens only: past the end, or at a dead end, whose fallback mask
                # allowed the stop token drafted (with ignore_eos it does not end the request)
                fill_row(m, bm, b)
            else:
                step.ended[i] = True  # row stays all-allowed: unreachable columns
        return self._publish(bm)

    def wire(self) -> GrammarOnWire:
        """What the other tensor-parallel ranks get in place of this object (the matchers do
        not pickle): the batch's shape, :class:`GrammarOnWire`."""
        return GrammarOnWire(self.batch_size, self.vocab_size)

    def advance(self, counts: np.ndarray, tokens: np.ndarray) -> None:
        """After the host copy: row ``b`` emitted ``tokens[b, :counts[b]]`` (host int64);
        each matcher accepts them (tokens after its end are ignored: the scheduler ends the
        request at a stop token)."""
        for b, m in zip(self.rows, self.matchers):
            for t in tokens[b, :int(counts[b])].tolist():
                if m.is_terminated() or not m.accept_token(int(t)):
                    break

    def step(self, inner: Any) -> GrammarStep:
        """This batch's masks for one sampling step, around ``inner`` (the step's
        :class:`~specdial.worker.processors.StepProcessing`, or None)."""
        return GrammarStep(self, inner)


class GrammarStep:
    """One sampling step's processing with grammar masks, the interface of
    :class:`~specdial.worker.processors.StepProcessing` (:meth:`first`, :meth:`draft_step`,
    :meth:`verify`): ``inner``'s processing (penalties, ``min_tokens``; None: none) first, then
    the masks (see the module docstring). Logits float32; ``[B, V]`` or ``[B, n, V]``."""

    def __init__(self, grammar: BatchGrammar, inner: Any) -> None:
        self.grammar, self.inner = grammar, inner
        g = len(grammar.rows)
        self.drafted = np.zeros(g, np.int64)  # drafted tokens each matcher accepted
        self.ended = np.zeros(g, bool)  # a refused draft: later columns unreachable
        self.masks: list[torch.Tensor] = [grammar.current_mask()]
        #: bool ``[B, n, V]``: the masks the last :meth:`first` (``n = 1``) or :meth:`verify`
        #: applied, for the constrained log-probabilities
        #: (:func:`~specdial.worker.logprobs.token_logprobs`'s ``allowed``)
        self.allowed: torch.Tensor | None = None

    def _push(self, tokens: torch.Tensor) -> None:
        """Append mask ``j`` after ``tokens`` ``[B]`` (device; ``d_j`` of every row)."""
        self.masks.append(self.grammar.level_mask(self, tokens))

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        """A prefill's first tokens: ``[B, V]`` -> masked ``[B, V]`` (current state)."""
        if self.inner is not None:
            logits = self.inner.first(logits)
        self.allowed = self.masks[0][:, None]
        return logits.masked_fill(~self.masks[0], -math.inf)

    def draft_step(self, logits: torch.Tensor, i: int, input_ids: torch.Tensor) -> torch.Tensor:
        """Draft level ``i``: drafter logits ``[B, V]`` (target vocabulary) whose input is
        ``input_ids`` ``[B]`` (``x_L``, then ``d_i``) -> masked ``[B, V]``."""
        if self.inner is not None:
            logits = self.inner.draft_step(logits, i, input_ids)
        if i >= len(self.masks):
            self._push(input_ids)
        allowed = self.masks[i]
        masked = logits.masked_fill(~allowed, -math.inf)
        # a drafter that gives every allowed token -inf (an EAGLE-3 draft vocabulary without
        # them) proposes uniformly among the allowed ones instead of a NaN distribution
        none = torch.isneginf(masked).all(-1, keepdim=True)
        return torch.where(none & allowed, 0.0, masked)

    def verify(self, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Verify logits ``[B, n, V]`` over ``input_ids`` ``[B, n]`` (``x_L, d_1..d_k``) ->
        masked ``[B, n, V]``; then every drafted token is rolled back (the accepted ones are
        accepted once by :meth:`BatchGrammar.advance`)."""
        if self.inner is not None:
            logits = self.inner.verify(logits, input_ids)
        n = logits.shape[1]
        while len(self.masks) < n:
            self._push(input_ids[:, len(self.masks)])
        self.rollback()
        self.allowed = torch.stack(self.masks[:n], 1)
        return logits.masked_fill(~self.allowed, -math.inf)

    def rollback(self) -> None:
        """Undo the drafted tokens the matchers accepted (idempotent)."""
        for i, m in enumerate(self.grammar.matchers):
            if self.drafted[i]:
                m.rollback(int(self.drafted[i]))
                self.drafted[i] = 0


@dataclass(frozen=True)
class GrammarOnWire:
    """What a tensor-parallel worker rank receives in place of rank 0's :class:`BatchGrammar`
    (xgrammar's matchers do not pickle, and they stay on rank 0, which owns the scheduler and
    the requests): the batch size ``B`` and the vocabulary ``V``. :meth:`follower` makes the
    rank's :class:`MirroredGrammar`."""

    batch_size: int
    vocab_size: int

    def follower(self, receive: Callable[[torch.Tensor], Any], device: torch.device
                 ) -> MirroredGrammar:
        """The worker rank's grammar of this batch (``receive``: see :class:`MirroredGrammar`)."""
        return MirroredGrammar(self.batch_size, self.vocab_size, device, receive)


class MirroredGrammar:
    """A tensor-parallel worker rank's :class:`BatchGrammar`: no matchers; each mask is rank
    0's, received as the packed int32 bitmask ``[B, ceil(V / 32)]`` at the same point of the
    step where rank 0 computes and shares it (the step's first mask, then one per draft level
    and the verify's last column: the points depend only on the plan, identical on every
    rank). ``receive(t)`` overwrites the device tensor ``t`` with rank 0's (the group's
    ``broadcast`` from rank 0). So every rank masks its logits identically and samples the
    same tokens (checked after every pass), as with tp 1."""

    rows: list[int] = []
    matchers: list[Any] = []

    def __init__(self, batch_size: int, vocab_size: int, device: torch.device,
                 receive: Callable[[torch.Tensor], Any]) -> None:
        self.batch_size, self.vocab_size, self.device = batch_size, vocab_size, device
        self.words = math.ceil(vocab_size / 32)
        self.receive = receive

    def current_mask(self) -> torch.Tensor:
        """bool ``[B, V]``: the next mask rank 0 shares."""
        packed = torch.empty(self.batch_size, self.words, dtype=torch.int32, device=self.device)
        self.receive(packed)
        return unpack_bitmask(packed, self.vocab_size)

    def level_mask(self, step: GrammarStep, tokens: torch.Tensor) -> torch.Tensor:
        """Mask ``j`` of ``step``: rank 0's (its matchers advanced over the same drafts)."""
        return self.current_mask()

    def advance(self, counts: np.ndarray, tokens: np.ndarray) -> None:
        """Nothing: the matchers live on rank 0."""

    def step(self, inner: Any) -> GrammarStep:
        """This batch's masks for one sampling step (as :meth:`BatchGrammar.step`)."""
        return GrammarStep(self, inner)  # type: ignore[arg-type]
