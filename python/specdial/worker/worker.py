"""The speculative worker: runs one scheduler plan (a prefill chunk, or draft + verify + extend).

One :class:`SpecWorker` serves every drafter (and target-only decoding, ``drafter=None``). The
Rust :class:`specdial._core.Scheduler` owns the KV pages and the requests; the worker owns the
tensors: the target's and the drafter's KV buffers (``scheduler.num_slots`` slots plus the pad
sentinel, same slot indices for both), the per-row tables, the runtime states, and the drafter's
validity per request (``draft_len``). Conventions in :mod:`specdial.worker.drafters`.

- :meth:`SpecWorker.prefill` runs a prefill plan: the chunk of every request in one ragged
  target forward (EAGLE keeps its hidden states), the drafter over the same positions, and the
  first token sampled where ``sample_first`` (a request resuming after preemption re-prefills
  ``prompt + output[:-1]`` and samples nothing).
- :meth:`SpecWorker.decode` runs a decode plan with ``steps = k``: drafter catch-up over
  ``[draft_len, L)`` (only after skipped zero-step extends), ``k`` draft forwards, one verify
  over ``[x_L, d_1..d_k]`` per request, acceptance (:func:`speculative_accept`), then the draft
  extend. A request capped below ``k`` (``steps_per_request[b] = s < k``, near its end) has
  slots only for ``L..L+s``: its later drafts and verify tokens write the pad slot and it never
  accepts more than ``s`` drafts.

Passes: one :class:`~specdial.worker.step_runner.StepRunner` per steps value (the runtime
state), all over one buffer set. CUDA graphs (``cuda_graph_bs`` given): at start the worker
builds a :class:`~specdial.worker.graph_tables.CapturePlan` over its steps values (pruned by
the adaptive config when there is one) and captures every runner's graphs in one
:class:`~specdial.worker.graph_pool.GraphPool`; decode iterations then replay the graphs of the
plan's ``graph_bs`` (draft, verify with its logits, draft extend and catch-up), falling back to
the same pass bodies run eagerly (counted in :meth:`SpecWorker.graph_stats`) above the largest
size, for uncaptured keys, sampling drafts and long catch-ups. Prefill stays eager.

Rows (``0..max_running_requests-1``) belong to the scheduler: it assigns each request its row at
admission and frees it at finish, abort or preemption, and every plan carries them
(``plan.rows``). A prefill chunk starting at position 0 (re)starts its row: the worker resets the
row's lengths and token counts there, and keeps no request -> row map of its own. Host arrays
are numpy int64. No per-request ``.item()`` and no Python loop over tensors.

Penalties and ``min_tokens`` (``BatchSampling.processors``): the worker keeps each penalized
row's token counts on the device (:class:`~specdial.worker.processors.TokenCounts`, reset when
a row (re)starts), brings them up to the row's target length before sampling, and
processes the logits per position (:class:`~specdial.worker.processors.StepProcessing`): the
prefill's first tokens, every draft step and every verify column, each with the history plain
decoding has at that position. Reported log-probabilities stay the raw ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from specdial.attention.base import AttentionBackend
from specdial.attention.select import select_backend
from specdial.models.llama import LlamaForCausalLM
from specdial.worker.cpu_malloc import keep_freed_memory
from specdial.worker.drafters import Drafter, run_target
from specdial.worker.inputs import DecodeInput, PrefillInput, worker_input
from specdial.worker.logprobs import (HostLogprobs, LogprobRows, PromptLogprobPlan,
                                      prompt_logprobs, token_logprobs)
from specdial.worker.processors import StepProcessing, TokenCounts
from specdial.worker.graph_pool import CaptureReport, GraphPool, capture_all
from specdial.worker.graph_tables import CapturePlan
from specdial.worker.runtime import DecodeBatches, RequestTables
from specdial.worker.sampling import BatchSampling, sample, speculative_accept
from specdial.worker.step_runner import StepRunner, build_runners


@dataclass
class StepOutput:
    """Result of one plan over ``B`` requests (host numpy, int64), what
    :meth:`specdial._core.Scheduler.report` takes.

    ``tokens``: emitted tokens, request after request (decode: accepted drafts then the bonus
    token; prefill: the first token of the ``sample_first`` requests); ``offsets`` ``[B + 1]``:
    request ``b`` emitted ``tokens[offsets[b]:offsets[b + 1]]``; ``accepted`` ``[B]``
    (decode; None for prefill): accepted drafts, ``0..steps_per_request[b]``.
    ``logprobs``: the target's log-probabilities of the emitted tokens for the rows that asked
    (:mod:`specdial.worker.logprobs`; decode: ``[R, steps + 1]``, row ``r`` emitted its first
    ``offsets`` count; prefill: ``[R, 1]`` over the ``sample_first`` requests); None when no
    row asked. ``prompt_logprobs``: the prefill's prompt positions of a
    :class:`~specdial.worker.logprobs.PromptLogprobPlan` (``[1, N]``), or None.
    """

    steps: int
    tokens: np.ndarray
    offsets: np.ndarray
    accepted: np.ndarray | None
    logprobs: HostLogprobs | None = None
    prompt_logprobs: HostLogprobs | None = None

    def tokens_of(self, b: int) -> np.ndarray:
        return self.tokens[self.offsets[b]:self.offsets[b + 1]]


#: Kept for readers of the previous name.
DecodeOutput = StepOutput


class SpecWorker:
    """Owns the target and drafter KV buffers, the request tables and the runtime states.

    - ``target``: a :class:`LlamaForCausalLM`; ``drafter``: a :class:`Drafter` or None
      (target-only, ``steps`` must be 0).
    - ``num_slots``: KV slots (``Scheduler.num_slots``); both KV pools get them plus the pad
      sentinel (:attr:`pad_slot`).
    - ``max_running_requests``: rows of the request tables and batch capacity of the runtime
      states; ``context_length``: longest request (prompt + output) in tokens.
    - ``step_values``: the ``steps`` values to build runtime states for (each in
      ``0..drafter.max_steps``; ``Scheduler.candidate_steps``); a plan with any other value
      raises ``ValueError``.
    - ``skip_zero_step_draft_extend``: skip the drafter extend at ``steps = 0``.
    - ``backend``: the attention backend (default :func:`select_backend` for the device and
      the target's dtype).
    - ``cuda_graph_bs``: batch sizes to capture CUDA graphs for (None: no graphs, eager
      passes); ``cuda_graph_mode``: the :class:`GraphPool` mode (None: ``"cuda"`` on a CUDA
      device, ``"eager"`` otherwise; ``"emulate"`` exercises the runner path on the CPU);
      ``adaptive_config``: the adaptive policy's config (prunes the capture plan; None for
      fixed steps or a steps schedule: every size for every steps value).
    - ``max_extend_tokens``: most tokens of one drafter catch-up forward (the engine passes
      ``max_prefill_tokens``); a longer catch-up runs in several (``ValueError`` if < 1).

    Raises ``ValueError`` for steps above the drafter's ``max_steps`` or positive steps
    without a drafter.
    """

    def __init__(self, target: LlamaForCausalLM, drafter: Drafter | None, num_slots: int, *,
                 max_running_requests: int, context_length: int, step_values: Iterable[int],
                 skip_zero_step_draft_extend: bool = False,
                 backend: AttentionBackend | None = None,
                 cuda_graph_bs: Sequence[int] | None = None, cuda_graph_mode: str | None = None,
                 adaptive_config: Any = None, max_extend_tokens: int = 4096) -> None:
        self.target, self.drafter = target, drafter
        if max_extend_tokens < 1:
            raise ValueError(f"max_extend_tokens must be >= 1, got {max_extend_tokens}")
        self.max_extend_tokens = max_extend_tokens
        self.skip_zero_step_draft_extend = skip_zero_step_draft_extend
        self.device = device = target.embed_tokens.weight.device
        if device.type == "cpu":
            keep_freed_memory()  # page-fault-free temporaries (cpu_malloc.py)
        self.backend = backend or select_backend(device, dtype=target.embed_tokens.weight.dtype)
        steps = sorted(set(int(s) for s in step_values)) or [0]
        max_steps = drafter.max_steps if drafter is not None else 0
        if steps[0] < 0 or steps[-1] > max_steps:
            raise ValueError(f"steps {steps} outside 0..{max_steps} "
                             f"({'drafter max_steps' if drafter else 'no drafter'})")
        self.num_slots = num_slots = int(num_slots)
        self.kv = target.make_kv_pool(num_slots)
        self.pad_slot = self.kv.pad_slot
        if drafter is not None:
            drafter.init_kv(num_slots)
        self.max_bs = max_running_requests
        self.tables = RequestTables(max_running_requests, context_length + steps[-1] + 2, device)
        # Target features per KV slot (EAGLE input: the final hidden state, or EAGLE-3's fused
        # aux states); row num_slots is the pad sentinel, row num_slots + 1 stays zero (h_{-1}).
        self.hidden: torch.Tensor | None = None
        self.zero_row = num_slots + 1
        if drafter is not None and drafter.feature_size is not None:
            self.hidden = torch.zeros(num_slots + 2, drafter.feature_size,
                                      dtype=target.embed_tokens.weight.dtype, device=device)
        self.target_len = np.zeros(max_running_requests, np.int64)
        self.draft_len = np.zeros(max_running_requests, np.int64)
        #: penalized rows' token counts (device tensors allocated on the first penalty)
        self.token_counts = TokenCounts(max_running_requests, target.config.vocab_size, device)
        #: the capture plan and report (None: eager passes)
        self.capture_plan: CapturePlan | None = None
        self.capture_report: CaptureReport | None = None
        pool = None
        if cuda_graph_bs is not None:
            self.capture_plan = CapturePlan.build(steps, cuda_graph_bs, adaptive_config or None,
                                                  has_drafter=drafter is not None)
            pool = GraphPool(self.device, cuda_graph_mode)
        #: steps -> its runner (the runtime state), all over one buffer set
        self.states: dict[int, StepRunner] = build_runners(
            self.capture_plan, target=target, target_kv=self.kv, drafter=drafter,
            backend=self.backend, kv_capacity=self.tables.width, pool=pool, steps=steps,
            tables=self.tables, max_bs=max_running_requests)
        if self.capture_plan is not None:
            self.capture_report = capture_all(self.states, self.capture_plan)

    @property
    def graph_runners(self) -> dict[int, StepRunner]:
        """The runners that replay graphs (all of them with ``cuda_graph_bs``, else none)."""
        return self.states if self.capture_plan is not None else {}

    def graph_stats(self) -> dict[str, Any]:
        """CUDA-graph counters summed over the runners: ``replays`` per pass (draft, verify,
        extend), ``eager`` fallbacks per reason, ``captured`` graphs (all zero without
        graphs)."""
        replays: dict[str, int] = {}
        eager: dict[str, int] = {}
        for r in self.graph_runners.values():
            for k, v in r.stats.replays.items():
                replays[k] = replays.get(k, 0) + v
            for k, v in r.stats.eager.items():
                eager[k] = eager.get(k, 0) + v
        captured = self.capture_report.num_graphs if self.capture_report else 0
        return {"replays": replays, "eager": eager, "captured": captured}

    # ----------------------------------------------------------------- rows
    def _rows(self, inp: PrefillInput | DecodeInput, starts: np.ndarray) -> np.ndarray:
        """The input's rows (``[B]`` int64, assigned by the scheduler). Rows whose chunk starts
        at position 0 start afresh (lengths and token counts reset). Raises ``RuntimeError``
        when the positions do not match the rows' lengths (a scheduler/worker mismatch: a
        bug)."""
        rows = inp.rows
        if len(rows) != len(starts) or (len(rows) and rows.max() >= self.max_bs):
            raise RuntimeError(f"plan rows {rows.tolist()} do not fit {self.max_bs} rows")
        fresh = rows[starts == 0]
        if len(fresh):
            self.target_len[fresh] = 0
            self.draft_len[fresh] = 0
            self.token_counts.reset(fresh)
        if not np.array_equal(self.target_len[rows], starts):
            raise RuntimeError(f"plan positions {starts.tolist()} do not match the worker's "
                               f"target lengths {self.target_len[rows].tolist()}")
        return rows

    def _processing(self, sampling: BatchSampling, rows: np.ndarray, ends: np.ndarray,
                    positions: torch.Tensor) -> StepProcessing | None:
        """The penalties / ``min_tokens`` of a sampling step over ``rows`` (plan order, host)
        at target lengths ``ends``, deciding ``positions`` (``[B]`` device) first; None when
        the batch has none. Penalized rows' counts are brought up to ``ends`` first."""
        proc = sampling.processors
        if proc is None:
            return None
        base = seen = None
        if proc.any_penalty:
            pen = proc.penalized
            self.token_counts.catch_up(rows[pen], ends[pen], proc.prompt_lens_host[pen],
                                       self.tables.req_to_ids)
            base, seen = self.token_counts.gather(torch.from_numpy(rows).to(self.device))
        return StepProcessing(proc, positions, base, seen)

    # ----------------------------------------------------------------- passes
    @torch.inference_mode()
    def prefill(self, plan: Any, sampling: BatchSampling | None,
                generator: torch.Generator | None, logprobs: LogprobRows | None = None,
                prompt_plan: PromptLogprobPlan | None = None, *,
                draft_prefill: bool = True) -> StepOutput:
        """Run a prefill plan (a :class:`specdial._core.SchedulePlan`, or its
        :class:`~specdial.worker.inputs.PrefillInput`).

        Target forward over every chunk in one ragged batch, then the drafter over the same
        positions (KV only; EAGLE reads the target hidden states just written). ``sampling``:
        the options of the ``sample_first`` requests only, in plan order (None when none); each
        of them samples its first token from the logits at ``logits_indices`` (a seeded one
        with keys at position ``P``, its prompt length). ``logprobs``: rows of those
        ``sample_first`` requests that want the first token's log-probability;
        ``prompt_plan``: prompt positions whose next token's log-probability is wanted.
        ``draft_prefill=False`` leaves the drafter's pass over these positions to the catch-up
        extend that runs before the next drafting iteration (the target features it needs are
        kept per slot), so a prefill while the policy runs steps 0 costs what the target's does.
        """
        inp = plan if isinstance(plan, PrefillInput) else worker_input(plan, self.pad_slot)
        if not isinstance(inp, PrefillInput):
            raise ValueError("prefill: got a decode plan")
        qo, ends = inp.qo_lens, inp.kv_lens
        starts = ends - qo
        rows = self._rows(inp, starts)
        self.tables.write(rows, starts, qo, slots=inp.out_loc, ids=inp.input_ids)
        state = self.states[min(self.states)]
        batch, _ = state.prepare_ragged(rows, starts, ends)
        hidden, feats = run_target(self.target, self.drafter, batch, self.kv, self.backend)
        if self.hidden is not None and feats is not None:
            self.hidden.index_copy_(0, batch.out_loc, feats)
        self.target_len[rows] = ends
        sample_first = inp.sample_first
        tokens = np.zeros(0, np.int64)
        pending = []  # host copies in flight (logprobs), completed by the blocking copy
        if prompt_plan is not None and len(prompt_plan.index):
            pending.append(("prompt", prompt_logprobs(hidden, self.target.compute_logits,
                                                      prompt_plan).to_host()))
        if sample_first.any():
            if sampling is None or sampling.batch_size != int(sample_first.sum()):
                raise ValueError("prefill: sampling must cover the sample_first requests")
            idx = torch.from_numpy(inp.logits_indices).to(self.device)
            positions = None  # of the first tokens: the prompt lengths (seeded rows' keys)
            firsts = sample_first != 0
            if sampling.any_seeded or sampling.processors is not None:
                positions = torch.from_numpy(ends[firsts]).to(self.device)
            first_logits = self.target.compute_logits(hidden[idx])
            processing = (None if positions is None
                          else self._processing(sampling, rows[firsts], ends[firsts], positions))
            first = sample(first_logits if processing is None else processing.first(first_logits),
                           sampling, generator, positions)
            if logprobs is not None:
                pending.append(("first", token_logprobs(first_logits[:, None], first[:, None],
                                                        logprobs).to_host()))
            tokens = first.cpu().numpy().astype(np.int64)
        if pending and not sample_first.any() and self.device.type == "cuda":
            # a middle chunk of an echo prompt: no token copy to complete the logprob copies
            torch.cuda.current_stream(self.device).synchronize()
        done = {name: finish() for name, finish in pending}
        if self.drafter is not None and draft_prefill:
            self._draft_extend(rows, state)  # the drafter prefill: an extend over the chunk
        offsets = np.concatenate([[0], np.cumsum(sample_first)]).astype(np.int64)
        return StepOutput(0, tokens, offsets, None, done.get("first"), done.get("prompt"))

    def _draft_extend(self, rows: np.ndarray, state: StepRunner,
                      batches: DecodeBatches | None = None) -> None:
        """Drafter over ``[draft_len, target_len)`` of every request, KV only: one forward
        (through the runner's graph path when ``batches`` carry a KV layout), or, for a catch-up
        longer than ``max_extend_tokens`` (after a long steps-0 stretch or deferred prefills),
        eager forwards of at most that many tokens each, so its activations stay bounded like a
        prefill chunk's."""
        assert self.drafter is not None
        start, end = self.draft_len[rows], self.target_len[rows]
        todo = end > start
        if not todo.any():
            return
        short = int((end - start)[todo].sum()) <= self.max_extend_tokens
        if short and batches is not None and batches.layout is not None:
            state.run_extend(batches, rows, start, end, self.hidden, self.zero_row)
            self.draft_len[rows] = np.maximum(start, end)
            return
        rows, start, end = rows[todo], start[todo], end[todo]
        while len(rows):
            stop = np.minimum(end, start + max(1, self.max_extend_tokens // len(rows)))
            self._extend_eager(rows, start, stop, state)
            left = stop < end
            rows, start, end = rows[left], stop[left], end[left]

    def _extend_eager(self, rows: np.ndarray, start: np.ndarray, end: np.ndarray,
                      state: StepRunner) -> None:
        """One ragged drafter forward over ``[start, end)`` of ``rows`` (all non-empty)."""
        assert self.drafter is not None
        zero = None if self.hidden is None else self.zero_row
        batch, hidden_rows = state.prepare_ragged(rows, start, end, zero)
        feats = None if hidden_rows is None or self.hidden is None else self.hidden[hidden_rows]
        if int(start.max()) == 0:
            self.drafter.prefill(batch, self.backend, hidden_states=feats)
        else:
            self.drafter.extend(batch, self.backend, hidden_states=feats, kv_only=True)
        self.draft_len[rows] = end

    @torch.inference_mode()
    def decode(self, plan: Any, sampling: BatchSampling,
               generator: torch.Generator | None,
               logprobs: LogprobRows | None = None) -> StepOutput:
        """Run a decode plan (a :class:`specdial._core.SchedulePlan`, or its
        :class:`~specdial.worker.inputs.DecodeInput`): ``steps`` drafts per request, verify,
        accept, draft extend.

        ``sampling``: the requests' options in plan order; seeded rows key their draws by the
        sequence index of the token decided (draft ``i`` and verify position ``i`` decide
        ``L + i``; see :func:`speculative_accept`). ``logprobs``: rows wanting the target's
        log-probabilities of their emitted tokens (from the verify logits, in batch; their
        host copy rides on the step's one synchronization). Raises ``ValueError`` for a steps
        value without a runtime state.
        """
        inp = plan if isinstance(plan, DecodeInput) else worker_input(plan, self.pad_slot)
        if not isinstance(inp, DecodeInput):
            raise ValueError("decode: got a prefill plan")
        steps = inp.steps
        state = self.states.get(steps)
        if state is None:
            raise ValueError(f"no runtime state for steps={steps}; built: {sorted(self.states)}")
        target_len = inp.positions
        rows = self._rows(inp, target_len)
        b, n = len(rows), steps + 1
        # slots of L..L+steps (the pad slot beyond a capped request's own steps), and x_L
        self.tables.write(rows, target_len, np.full(b, n, np.int64), slots=inp.out_loc)
        self.tables.write(rows, target_len, np.ones(b, np.int64), ids=inp.input_ids)
        batches = state.prepare_decode(rows, target_len, inp.graph_bs)
        # sequence index of draft 1 (L + 1): the seeded rows' keys (sampling.py), the first
        # position the processors decide
        first_pos = (batches.verify_positions[:, 0] + 1
                     if sampling.any_seeded or sampling.processors is not None else None)
        processing = (None if first_pos is None
                      else self._processing(sampling, rows, target_len, first_pos))

        probs = None
        if steps:
            assert self.drafter is not None
            # catch-up after skipped zero-step extends
            self._draft_extend(rows, state, batches)
            first_hidden = None
            if self.hidden is not None:
                prev = self.tables.req_to_token[batches.rows, batches.verify_positions[:, 0] - 1]
                first_hidden = self.hidden[prev]
            drafts, probs = state.run_draft(batches, first_hidden=first_hidden,
                                            sampling=sampling, generator=generator,
                                            sample_positions=first_pos, processing=processing)
            batches.verify_ids[:, 1:] = drafts
            # the copy: a replayed draft graph's output is only valid until the next replay
            drafts = batches.verify_ids[:, 1:]
        else:
            drafts = batches.verify_ids[:, 1:]  # [B, 0]
        verified = state.run_verify(batches)
        hidden = verified.hidden
        if self.hidden is not None and verified.features is not None:
            self.hidden.index_copy_(0, batches.verify.out_loc, verified.features)
        logits = (verified.logits if verified.logits is not None
                  else self.target.compute_logits(hidden)).view(b, n, -1)
        # the target's distribution at column i: processed with the history up to d_i
        target = logits if processing is None else processing.verify(logits, batches.verify_ids)
        accepted, out = speculative_accept(drafts, probs, target, sampling, generator, first_pos)
        # emitted tokens go to positions L+1..L+a+1 (later columns are stale, never read)
        self.tables.req_to_ids[batches.rows[:, None], batches.verify_positions + 1] = out
        lp_pending = (None if logprobs is None
                      else token_logprobs(logits, out, logprobs).to_host())
        host = torch.cat([accepted[:, None], out], 1).cpu().numpy()  # the one sync
        lp_host = None if lp_pending is None else lp_pending()
        out_np = host[:, 1:]
        # a capped request keeps at most its own steps; the token at column s is then the
        # target's (an accepted draft equals the target's choice there), so nothing changes
        acc = np.minimum(host[:, 0], inp.steps_per_request) if steps else host[:, 0]

        new_len = target_len + acc + 1
        if steps and self.drafter is not None:
            self.draft_len[rows] = self.drafter.draft_len_after_verify(target_len, steps, acc)
        self.target_len[rows] = new_len
        if self.drafter is not None and not (steps == 0 and self.skip_zero_step_draft_extend):
            self._draft_extend(rows, state, batches)
        emitted = np.arange(n)[None, :] <= acc[:, None]
        offsets = np.concatenate([[0], np.cumsum(acc + 1)]).astype(np.int64)
        return StepOutput(steps, out_np[emitted].astype(np.int64), offsets,
                          acc.astype(np.int64), lp_host)
