"""Log-probabilities of the target model for the tokens a step emits, computed in batch.

What is reported (vLLM's default ``logprobs_mode="raw_logprobs"``): ``log_softmax`` of the
target's raw logits, before temperature, top-k and top-p, at the position that emitted each
token, so the numbers do not depend on the sampling options or on the drafter. For a decode
step those are the verify logits (position ``i`` of the verify predicts emitted token ``i``:
the accepted drafts, then the correction or bonus token); for the first token, the prefill
logits at the prompt's last position; for prompt tokens (``echo`` / SGLang's
``logprob_start_len``), the prefill logits at the position before each token.

Under a grammar (structured outputs) the emitted tokens' log-probabilities are those of the
**constrained** target distribution: the raw logits with the grammar's mask of that position
applied (disallowed tokens ``-inf``), then ``log_softmax``, so they sum to 1 over the allowed
tokens. That is what vLLM reports in the same mode: its worker applies the grammar bitmask to
the logits before its sampler computes ``raw_logprobs`` from them (``apply_grammar_bitmask``
in ``gpu_model_runner.py``); SGLang likewise masks (``vocab_mask``) before its sampler's
log-softmax. A disallowed token's log-probability is :data:`DISALLOWED_LOGPROB` (vLLM's floor
in its OpenAI responses; JSON has no ``-inf``), and a disallowed token never appears among the
top alternatives: its entry gets id ``-1`` (:data:`NOT_ALLOWED_ID`), which the engine drops
(:meth:`~specdial.engine.live.LiveRequest.chunk`), so a position with fewer allowed tokens than
``top_n`` lists fewer alternatives. Prompt logprobs are never masked (the prompt is not
constrained). The masks come from :mod:`specdial.worker.grammar_masks` (``allowed`` below).

Pieces:

- :class:`LogprobRows`: which rows of a batch want log-probabilities and how many top
  alternatives (``top_n``), built once per batch composition beside the
  :class:`~specdial.worker.sampling.BatchSampling`.
- :func:`token_logprobs`: ``[B, n, V]`` logits and ``[B, n]`` tokens -> device tensors for the
  selected rows, then :meth:`DeviceLogprobs.to_host` starts their copy to the host without
  waiting (``non_blocking``); the worker's existing blocking copy of the step's tokens, issued
  afterwards on the same stream, completes it, so no extra host synchronization happens.
- :class:`PromptLogprobPlan` / :func:`prompt_logprobs`: the same over selected positions of a
  ragged prefill batch (targets are the next prompt tokens), in blocks of at most
  :data:`PROMPT_BLOCK` positions to bound the ``[N, V]`` float32 temporaries.

No per-request Python loop over tensors; shapes only decide the branches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["DISALLOWED_LOGPROB", "MAX_TOP_LOGPROBS", "NOT_ALLOWED_ID", "DeviceLogprobs",
           "HostLogprobs", "LogprobRows", "PromptLogprobPlan", "masked_log_softmax",
           "prompt_logprobs", "token_logprobs"]

#: Most alternatives per token (vLLM's default ``max_logprobs``).
MAX_TOP_LOGPROBS = 20
#: Prompt positions per ``compute_logits`` block.
PROMPT_BLOCK = 1024
#: The log-probability reported for a token the grammar does not allow (vLLM's floor).
DISALLOWED_LOGPROB = -9999.0
#: ``top_ids`` entry of an alternative the grammar does not allow (dropped by the engine).
NOT_ALLOWED_ID = -1


@dataclass(frozen=True)
class LogprobRows:
    """Rows of a batch (plan order) whose tokens get log-probabilities.

    ``rows`` ``[R]`` int64 on the device and ``rows_np`` the same on the host (increasing);
    ``top_n``: alternatives per token (the largest any of the rows asked for, 0..20).
    """

    rows: torch.Tensor
    rows_np: np.ndarray
    top_n: int

    @classmethod
    def build(cls, top_ns: list[int | None], device: torch.device | str) -> LogprobRows | None:
        """From one entry per row (None: no log-probabilities; else the top-n asked for);
        None when no row asks."""
        rows = [i for i, t in enumerate(top_ns) if t is not None]
        if not rows:
            return None
        top = max(int(top_ns[i] or 0) for i in rows)
        rows_np = np.asarray(rows, dtype=np.int64)
        return cls(torch.from_numpy(rows_np).to(device), rows_np, top)


@dataclass
class HostLogprobs:
    """Host arrays of one step for the rows of a :class:`LogprobRows`.

    ``rows`` ``[R]``: batch rows; ``logprob`` ``[R, n]`` float32: log p of each row's token at
    each position; ``top_ids`` ``[R, n, K]`` int64 and ``top_logprob`` ``[R, n, K]`` float32:
    the ``K = top_n`` most likely tokens per position, most likely first.
    Entries past what a row emitted are meaningless.
    """

    rows: np.ndarray
    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprob: np.ndarray


@dataclass
class DeviceLogprobs:
    """Device tensors of :class:`HostLogprobs` whose copy to the host may be in flight."""

    rows: np.ndarray
    logprob: torch.Tensor
    top_ids: torch.Tensor
    top_logprob: torch.Tensor

    def to_host(self) -> Callable[[], HostLogprobs]:
        """Start the copies (``non_blocking``: pinned host memory, no wait on CUDA); returns a
        function to call after the step's blocking copy, which then reads finished arrays."""
        parts = [t.to("cpu", non_blocking=True)
                 for t in (self.logprob, self.top_ids, self.top_logprob)]

        def done() -> HostLogprobs:
            lp, ids, top = (p.numpy() for p in parts)
            return HostLogprobs(self.rows, lp, ids.astype(np.int64, copy=False), top)

        return done


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def masked_log_softmax(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """float32 ``log_softmax`` of ``logits`` ``[..., V]`` over the tokens ``allowed`` (bool,
    the same shape, or broadcastable; None: every token): disallowed tokens get ``-inf``, the
    allowed ones sum to 1 in probability. A row with no allowed token is not expected (a
    grammar's mask always allows a stop token) and would give NaN."""
    if allowed is None:
        return _log_softmax(logits)
    return torch.log_softmax(logits.float().masked_fill(~allowed, -torch.inf), dim=-1)


def _top(logp: torch.Tensor, top_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    if top_n == 0:
        shape = (*logp.shape[:-1], 0)
        return (torch.empty(shape, dtype=torch.int64, device=logp.device),
                torch.empty(shape, dtype=torch.float32, device=logp.device))
    values, ids = logp.topk(top_n, dim=-1, sorted=True)
    return ids, values


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, spec: LogprobRows,
                   allowed: torch.Tensor | None = None) -> DeviceLogprobs:
    """Log-probabilities of ``tokens`` under ``logits`` for the rows of ``spec``.

    ``logits``: ``[B, n, V]`` (any float dtype; raw, before sampling processors);
    ``tokens``: ``[B, n]`` int64 (negative entries, i.e. positions a row did not emit, are read
    as token 0 and must be ignored by the caller); ``allowed``: bool ``[B, n, V]``, the grammar
    masks of a batch with constrained rows (all True in the unconstrained rows), or None: the
    log-probabilities are then those of the constrained distribution (module docstring),
    a disallowed token's is :data:`DISALLOWED_LOGPROB` and a disallowed alternative has id
    :data:`NOT_ALLOWED_ID` (and that value). This is the helper every path that emits tokens
    under a grammar calls (chains here and in the prefill; a tree passes its nodes' masks).
    Returns ``[R, n]`` and ``[R, n, top_n]`` tensors on the logits' device. Raises
    ``ValueError`` for mismatched shapes.
    """
    if logits.dim() != 3 or tuple(tokens.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"token_logprobs: logits [B, n, V] and tokens [B, n] expected, got "
                         f"{list(logits.shape)} and {list(tokens.shape)}")
    if allowed is not None and tuple(allowed.shape) != tuple(logits.shape):
        raise ValueError(f"token_logprobs: allowed must be bool {list(logits.shape)} like the "
                         f"logits, got {list(allowed.shape)}")
    rows = spec.rows
    logp = masked_log_softmax(logits.index_select(0, rows),
                              None if allowed is None else allowed.index_select(0, rows))
    tok = tokens.index_select(0, rows).clamp_min(0)
    chosen = logp.gather(-1, tok[..., None]).squeeze(-1)
    ids, values = _top(logp, spec.top_n)
    if allowed is not None:
        chosen = chosen.clamp_min(DISALLOWED_LOGPROB)
        out = torch.isneginf(values)
        ids = ids.masked_fill(out, NOT_ALLOWED_ID)
        values = values.masked_fill(out, DISALLOWED_LOGPROB)
    return DeviceLogprobs(spec.rows_np, chosen, ids, values)


@dataclass(frozen=True)
class PromptLogprobPlan:
    """Prompt positions of one prefill batch whose next token gets a log-probability.

    ``index`` ``[N]`` int64: positions in the ragged batch (the rows of the target's hidden
    states); ``targets`` ``[N]`` int64: the prompt token each position predicts; ``top_n``:
    alternatives per position. Built by the engine loop, which owns the prompts.
    """

    index: np.ndarray
    targets: np.ndarray
    top_n: int


def prompt_logprobs(hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], Any],
                    plan: PromptLogprobPlan) -> DeviceLogprobs:
    """Log-probabilities of ``plan.targets`` from the final hidden states ``hidden``
    (``[T, H]``, one row per token of the ragged batch) through ``compute_logits`` (the
    target's LM head: ``[N, H] -> [N, V]``). Returns ``[1, N]`` / ``[1, N, top_n]`` tensors
    (``rows`` = ``[0]``; one pseudo-row so the result shares :class:`HostLogprobs`)."""
    device = hidden.device
    index = torch.from_numpy(plan.index).to(device)
    targets = torch.from_numpy(plan.targets).to(device)
    chosen, ids, values = [], [], []
    for start in range(0, len(plan.index), PROMPT_BLOCK):
        sel = slice(start, start + PROMPT_BLOCK)
        logp = _log_softmax(compute_logits(hidden.index_select(0, index[sel])))
        chosen.append(logp.gather(-1, targets[sel, None]).squeeze(-1))
        i, v = _top(logp, plan.top_n)
        ids.append(i)
        values.append(v)
    return DeviceLogprobs(np.zeros(1, np.int64), torch.cat(chosen)[None],
                          torch.cat(ids)[None], torch.cat(values)[None])
