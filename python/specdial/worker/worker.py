"""The speculative worker: prefill, and one decode iteration (draft, verify, accept, draft extend).

One :class:`SpecWorker` serves every drafter (and target-only decoding, ``drafter=None``). Per
decode iteration with ``steps = k`` (conventions in :mod:`specdial.worker.drafters`):

1. reserve ``k + 1`` KV slots per request (positions ``L..L+k``) from the Rust
   :class:`specdial._core.KvPagePool`;
2. ``k >= 1``: drafter catch-up over ``[draft_len, L)`` (only after skipped zero-step extends),
   then ``k`` draft forwards;
3. verify: one target forward over ``[x_L, d_1..d_k]`` per request;
4. accept (:func:`specdial.worker.sampling.speculative_accept`: greedy prefix match, or the
   rejection rule of Leviathan et al. 2023); one host transfer of the small results;
5. truncate each request's KV to ``L + a + 1`` (rejected slots back to the allocator);
6. draft extend over ``[draft_len, L + a + 1)``, KV only (skipped at ``k = 0`` with
   ``skip_zero_step_draft_extend``; SGLang PR #23994 keeps it warm instead).

``k = 0`` is the trivial verify: plain decoding through the same path. Per-request state is
host numpy indexed by *row* (``0..max_running_requests-1``); slots and token ids of every
position live in :class:`~specdial.worker.runtime.RequestTables` on the device. No per-request
``.item()`` and no Python loop over tensors; the only per-request Python is the allocator calls
(``pages_needed`` / ``reserve`` / ``truncate``, one each per request per iteration).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from specdial.attention import TorchAttentionBackend
from specdial.attention.base import AttentionBackend
from specdial.models.llama import LlamaForCausalLM
from specdial.worker.drafters import Drafter
from specdial.worker.runtime import RequestTables, RuntimeState
from specdial.worker.sampling import BatchSampling, sample, speculative_accept


class KVCacheFullError(RuntimeError):
    """Not enough free KV pages for the requested work (preemption comes in a later issue)."""


@dataclass
class DecodeOutput:
    """Result of one decode iteration over ``B`` requests (host numpy, int64).

    ``tokens`` ``[sum(accepted + 1)]``: emitted tokens, request after request (accepted
    drafts, then the bonus/correction token); ``offsets`` ``[B + 1]``: request ``b`` emitted
    ``tokens[offsets[b]:offsets[b + 1]]``; ``accepted`` ``[B]``: accepted drafts (0..steps),
    what :meth:`AdaptiveSpeculativeParams.on_verify_complete` takes.
    """

    steps: int
    tokens: np.ndarray
    offsets: np.ndarray
    accepted: np.ndarray

    def tokens_of(self, b: int) -> np.ndarray:
        return self.tokens[self.offsets[b]:self.offsets[b + 1]]


class SpecWorker:
    """Owns the target and drafter KV pools, the request tables and the runtime states.

    - ``target``: a :class:`LlamaForCausalLM`; ``drafter``: a :class:`Drafter` or None
      (target-only, ``steps`` must be 0).
    - ``kv_alloc``: a :class:`specdial._core.KvPagePool`; both KV pools get its
      ``num_slots`` slots (plus the pad sentinel).
    - ``max_running_requests``: rows of the request tables and batch capacity of the runtime
      states; ``context_length``: longest request (prompt + output) in tokens.
    - ``step_values``: the ``steps`` values to build runtime states for (each in
      ``0..drafter.max_steps``); decoding with any other value raises ``ValueError``.
    - ``skip_zero_step_draft_extend``: skip the drafter extend at ``steps = 0``.

    Raises ``ValueError`` for steps above the drafter's ``max_steps`` or positive steps
    without a drafter.
    """

    def __init__(self, target: LlamaForCausalLM, drafter: Drafter | None, kv_alloc, *,
                 max_running_requests: int, context_length: int, step_values: Iterable[int],
                 skip_zero_step_draft_extend: bool = False,
                 backend: AttentionBackend | None = None) -> None:
        self.target, self.drafter, self.kv_alloc = target, drafter, kv_alloc
        self.skip_zero_step_draft_extend = skip_zero_step_draft_extend
        self.device = device = target.embed_tokens.weight.device
        self.backend = backend or TorchAttentionBackend(device)
        steps = sorted(set(int(s) for s in step_values)) or [0]
        max_steps = drafter.max_steps if drafter is not None else 0
        if steps[0] < 0 or steps[-1] > max_steps:
            raise ValueError(f"steps {steps} outside 0..{max_steps} "
                             f"({'drafter max_steps' if drafter else 'no drafter'})")
        num_slots = int(kv_alloc.num_slots)
        self.kv = target.make_kv_pool(num_slots)
        if drafter is not None:
            drafter.init_kv(num_slots)
        self.max_bs = max_running_requests
        self.tables = RequestTables(max_running_requests, context_length + steps[-1] + 2, device)
        self.states = {s: RuntimeState(s, max_running_requests, self.tables, self.backend)
                       for s in steps}
        # Target final hidden per KV slot (EAGLE input); row num_slots is the pad sentinel,
        # row num_slots + 1 stays zero (h_{-1}).
        self.hidden: torch.Tensor | None = None
        self.zero_row = num_slots + 1
        if drafter is not None and drafter.needs_target_hidden:
            self.hidden = torch.zeros(num_slots + 2, target.config.hidden_size,
                                      dtype=target.embed_tokens.weight.dtype, device=device)
        self.target_len = np.zeros(max_running_requests, np.int64)
        self.draft_len = np.zeros(max_running_requests, np.int64)
        self.rid = np.full(max_running_requests, -1, np.int64)
        self._free_rows = list(range(max_running_requests - 1, -1, -1))

    # ----------------------------------------------------------------- admission
    def can_prefill(self, prompt_lens: Sequence[int]) -> bool:
        """Whether :meth:`prefill` of prompts with these lengths fits (rows and pages)."""
        ps = int(self.kv_alloc.page_size)
        pages = sum(-(-int(n) // ps) for n in prompt_lens)
        return len(prompt_lens) <= len(self._free_rows) and pages <= self.kv_alloc.num_free_pages()

    def can_decode(self, rows: np.ndarray, steps: int) -> bool:
        """Whether every request in ``rows`` can reserve ``steps + 1`` more slots at once."""
        need = sum(int(self.kv_alloc.pages_needed(int(r), steps + 1)) for r in self.rid[rows])
        return need <= self.kv_alloc.num_free_pages()

    @torch.inference_mode()
    def prefill(self, rids: Sequence[int], prompts: Sequence[Sequence[int]],
                sampling: BatchSampling,
                generator: torch.Generator | None) -> tuple[np.ndarray, np.ndarray]:
        """Register and prefill requests; returns ``(rows [B], first tokens [B])`` (int64).

        Target prefill over every prompt in one ragged forward, the first token sampled from
        the last position's logits, then the drafter prefill (KV only). ``rids``: fresh
        allocator request ids. Raises :class:`KVCacheFullError` when rows or pages run out.
        """
        lens = np.array([len(p) for p in prompts], np.int64)
        if not self.can_prefill(lens.tolist()):
            raise KVCacheFullError(
                f"cannot admit {len(prompts)} prompts ({int(lens.sum())} tokens): "
                f"{len(self._free_rows)} free rows, {self.kv_alloc.num_free_pages()} free pages "
                f"of {self.kv_alloc.page_size} tokens")
        rows = np.array([self._free_rows.pop() for _ in prompts], np.int64)
        slots = []
        for rid, n in zip(rids, lens.tolist()):
            self.kv_alloc.add_request(int(rid))
            slots.append(np.asarray(self.kv_alloc.reserve(int(rid), n)))
        self.rid[rows] = rids
        zeros = np.zeros(len(rows), np.int64)
        self.tables.write(rows, zeros, lens, np.concatenate(slots),
                          np.concatenate([np.asarray(p, np.int64) for p in prompts]))
        state = self.states[min(self.states)]
        batch, _ = state.prepare_ragged(rows, zeros, lens)
        hidden = self.target(batch, self.kv, self.backend)
        if self.hidden is not None:
            self.hidden.index_copy_(0, batch.out_loc, hidden)
        last = torch.from_numpy(np.cumsum(lens) - 1).to(self.device)
        first = sample(self.target.compute_logits(hidden[last]), sampling, generator)
        rows_d = torch.from_numpy(rows).to(self.device)
        self.tables.req_to_ids[rows_d, torch.from_numpy(lens).to(self.device)] = first
        self.target_len[rows], self.draft_len[rows] = lens, 0
        if self.drafter is not None:
            self._draft_extend(rows, state)  # the drafter prefill: an extend from position 0
        return rows, first.cpu().numpy()

    def release(self, rows: np.ndarray) -> None:
        """Free the requests in ``rows``: every KV page back to the allocator, rows reusable."""
        for row in np.asarray(rows, np.int64).tolist():
            self.kv_alloc.free_request(int(self.rid[row]))
            self.rid[row] = -1
            self._free_rows.append(row)

    # ----------------------------------------------------------------- passes
    def _draft_extend(self, rows: np.ndarray, state: RuntimeState) -> None:
        """Drafter over ``[draft_len, target_len)`` of every request in one KV-only forward."""
        assert self.drafter is not None
        start, end = self.draft_len[rows], self.target_len[rows]
        todo = end > start
        if not todo.any():
            return
        rows, start, end = rows[todo], start[todo], end[todo]
        zero = None if self.hidden is None else self.zero_row
        batch, hidden_rows = state.prepare_ragged(rows, start, end, zero)
        feats = None if hidden_rows is None or self.hidden is None else self.hidden[hidden_rows]
        if int(start.max()) == 0:
            self.drafter.prefill(batch, self.backend, hidden_states=feats)
        else:
            self.drafter.extend(batch, self.backend, hidden_states=feats, kv_only=True)
        self.draft_len[rows] = end

    @torch.inference_mode()
    def decode(self, steps: int, rows: np.ndarray, sampling: BatchSampling,
               generator: torch.Generator | None) -> DecodeOutput:
        """One decode iteration with ``steps`` drafts for the requests in ``rows`` (``[B]``).

        ``sampling``: the rows' options in the same order. Raises ``ValueError`` for a steps
        value without a runtime state, :class:`KVCacheFullError` when the ``B * (steps + 1)``
        slots do not fit (nothing is reserved then).
        """
        state = self.states.get(steps)
        if state is None:
            raise ValueError(f"no runtime state for steps={steps}; built: {sorted(self.states)}")
        rows = np.asarray(rows, np.int64)
        b, n = len(rows), steps + 1
        if not self.can_decode(rows, steps):
            raise KVCacheFullError(f"KV cache exhausted: {b} requests x {n} tokens do not fit "
                                   f"in {self.kv_alloc.num_free_pages()} free pages")
        rids = self.rid[rows].tolist()
        target_len = self.target_len[rows].copy()
        slots = np.concatenate([np.asarray(self.kv_alloc.reserve(r, n)) for r in rids])
        self.tables.write(rows, target_len, np.full(b, n, np.int64), slots=slots)
        batches = state.prepare_decode(rows, target_len)

        probs = None
        if steps:
            assert self.drafter is not None
            self._draft_extend(rows, state)  # catch-up after skipped zero-step extends
            first_hidden = None
            if self.hidden is not None:
                prev = self.tables.req_to_token[batches.rows, batches.verify_positions[:, 0] - 1]
                first_hidden = self.hidden[prev]
            drafts, probs = state.run_draft(self.drafter, batches, first_hidden=first_hidden,
                                            sampling=sampling, generator=generator)
            batches.verify_ids[:, 1:] = drafts
        else:
            drafts = batches.verify_ids[:, 1:]  # [B, 0]
        hidden = state.run_verify(self.target, self.kv, batches.verify)
        if self.hidden is not None:
            self.hidden.index_copy_(0, batches.verify.out_loc, hidden)
        logits = self.target.compute_logits(hidden).view(b, n, -1)
        accepted, out = speculative_accept(drafts, probs, logits, sampling, generator)
        # emitted tokens go to positions L+1..L+a+1 (later columns are -1: stale, never read)
        self.tables.req_to_ids[batches.rows[:, None], batches.verify_positions + 1] = out
        host = torch.cat([accepted[:, None], out], 1).cpu().numpy()  # the one sync
        acc, out_np = host[:, 0], host[:, 1:]

        new_len = target_len + acc + 1
        for rid, length in zip(rids, new_len.tolist()):
            self.kv_alloc.truncate(rid, length)
        if steps and self.drafter is not None:
            self.draft_len[rows] = self.drafter.draft_len_after_verify(target_len, steps, acc)
        self.target_len[rows] = new_len
        if self.drafter is not None and not (steps == 0 and self.skip_zero_step_draft_extend):
            self._draft_extend(rows, state)
        emitted = np.arange(n)[None, :] <= acc[:, None]
        offsets = np.concatenate([[0], np.cumsum(acc + 1)]).astype(np.int64)
        return DecodeOutput(steps, out_np[emitted], offsets, acc.astype(np.int64))
