"""The speculative worker: runs one scheduler plan (a prefill chunk, or draft + verify + extend).

One :class:`SpecWorker` serves every drafter (and target-only decoding, ``drafter=None``). The
Rust :class:`specdial._core.Scheduler` owns the KV pages, the requests and every per-request
length and KV position: each plan says them, and the worker keeps no host copy of them. The
worker owns the tensors: the target's and the drafter's KV buffers (``num_kv_slots`` KV slots
plus the pad sentinel, same KV slot indices for both), the per-row device tables (mirrors of
what the plans said, written incrementally: the new positions only), the runtime states, and
the drafter's own state (:class:`~specdial.worker.drafter_state.DrafterState`: its valid length
per row, ``draft_len``, with its rules, and the target features EAGLE reads).

- :meth:`SpecWorker.prefill` runs a prefill plan: the chunk of every request in one ragged
  target forward (EAGLE keeps its hidden states), the drafter over the same positions, and the
  first token sampled where ``sample_first`` (a request resuming after preemption re-prefills
  ``prompt + output[:-1]`` and samples nothing).
- :meth:`SpecWorker.decode` runs a decode plan with ``steps = k`` as stage calls with typed
  values (:mod:`specdial.worker.stages`): :meth:`~SpecWorker.prepare` (tables and buffers),
  :meth:`~SpecWorker.draft` (drafter catch-up over ``[draft_len, L)``, only after skipped
  zero-step extends, then ``k`` draft forwards), :meth:`~SpecWorker.verify` (one target forward
  over ``[x_L, d_1..d_k]`` per request), :meth:`~SpecWorker.accept`
  (:func:`~specdial.worker.sampling.speculative_accept` and the one host copy), then
  :meth:`~SpecWorker.extend` (the draft extend). Each request has its own verify budget
  ``steps_per_request[b] = v in 0..k`` (issue 28; near its end, or chosen by the policy) and
  KV slots only for ``L..L+v``: eagerly the target verifies only its ``v + 1`` tokens and it
  drafts only levels ``1..v`` (:mod:`specdial.worker.verify_budgets`); a replayed graph pads
  it to ``k`` (its extra positions write the pad KV slot). It never accepts more than ``v``
  drafts (capped on the device), and its drafts' confidences come back as
  :attr:`StepOutput.draft_probs`.

Passes: one :class:`~specdial.worker.step_runner.StepRunner` per steps value (the runtime
state), all over one buffer set. CUDA graphs (``cuda_graph_bs`` given): at start the worker
builds a :class:`~specdial.worker.graph_tables.CapturePlan` over its steps values (pruned by
the adaptive config when there is one) and captures every runner's graphs in one
:class:`~specdial.worker.graph_pool.GraphPool`; decode iterations then replay the graphs of the
plan's ``graph_bs`` (draft, verify with its logits, draft extend and catch-up), falling back to
the same pass bodies run eagerly (counted in :meth:`SpecWorker.graph_stats`) above the largest
size, for uncaptured keys, sampling drafts and long catch-ups. Prefill stays eager.

Rows (``0..max_running_requests-1``) belong to the scheduler: it assigns each request its row at
admission, frees it at finish, abort or preemption; every plan carries them (``plan.rows``). A
prefill chunk at position 0 (re)starts its row (drafter length and token counts reset); the
worker keeps no request -> row map. Host arrays are numpy int64; no ``.item()`` per request.

Penalties and ``min_tokens`` (``BatchSampling.processors``): the worker keeps each penalized
row's token counts on the device (:class:`~specdial.worker.processors.TokenCounts`, reset when
a row (re)starts), brings them up to the row's target length (the plan's) before sampling, and
processes the logits per position (:class:`~specdial.worker.processors.StepProcessing`): the
prefill's first tokens, every draft step and every verify column, each with the history plain
decoding has at that position. Reported log-probabilities stay the raw ones.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np
import torch

from specdial.attention.base import AttentionBackend
from specdial.attention.select import select_backend
from specdial.models.llama import LlamaForCausalLM
from specdial.worker.batch_sampling import BatchSampling
from specdial.worker.confidence_stop import cut_lengths, repack_verify, stop_confidence
from specdial.worker.cpu_malloc import keep_freed_memory
from specdial.worker.drafter_state import DrafterState
from specdial.worker.drafters import Drafter, run_target
from specdial.worker.graph_pool import CaptureReport, GraphPool, capture_all
from specdial.worker.graph_tables import CapturePlan
from specdial.worker.host_accept import greedy_accept_host
from specdial.worker.inputs import DecodeInput, PrefillInput, worker_input
from specdial.worker.logprobs import LogprobRows, PromptLogprobPlan, prompt_logprobs, token_logprobs
from specdial.worker.processors import StepProcessing, TokenCounts
from specdial.worker.runtime import RequestTables
from specdial.worker.sampling import sample, speculative_accept
from specdial.worker.stages import (Accepted, DecodeStep, Drafts, StepOutput, Verified,
                                    float_bits, packed_draft_probs)
from specdial.worker.step_runner import StepRunner, build_runners
from specdial.worker.tree_graphs import capture_tree_graphs
from specdial.worker.tree_step import TreePlan, is_tree_plan, run_tree_iteration

__all__ = ["SpecWorker", "StepOutput"]


class SpecWorker:
    """Owns the target and drafter KV buffers, the request tables and the runtime states.

    - ``target``: a :class:`LlamaForCausalLM`; ``drafter``: a :class:`Drafter` or None
      (target-only, ``steps`` must be 0).
    - ``num_kv_slots``: KV slots (the scheduler's ``num_slots``, Rust's ``num_kv_slots``); both
      KV pools get them plus the pad sentinel (:attr:`pad_kv_slot`).
    - ``max_running_requests``: rows of the request tables and batch capacity of the runtime
      states; ``context_length``: longest request (prompt + output) in tokens.
    - ``step_values``: the ``steps`` values to build runtime states for (each in
      ``0..drafter.max_steps``; ``Scheduler.candidate_steps``); a plan with any other value
      raises ``ValueError``.
    - ``backend``: the attention backend (default :func:`select_backend` for the device and
      the target's dtype).
    - ``cuda_graph_bs``: batch sizes to capture CUDA graphs for (None: no graphs, eager
      passes); ``cuda_graph_mode``: the :class:`GraphPool` mode (None: ``"cuda"`` on a CUDA
      device, ``"eager"`` otherwise; ``"emulate"`` exercises the runner path on the CPU);
      ``adaptive_config``: the adaptive policy's config (prunes the capture plan; None for
      fixed steps or a steps schedule: every size for every steps value).
    - ``max_extend_tokens``: most tokens of one drafter catch-up forward (the engine passes
      ``max_prefill_tokens``); a longer catch-up runs in several (``ValueError`` if < 1).
    - ``tree_max_num_draft_tokens``: with graphs and a drafter, the tree bound whose verify
      graphs are captured (:mod:`specdial.worker.tree_graphs`); None: tree verifies run eagerly.

    Raises ``ValueError`` for steps above the drafter's ``max_steps`` or positive steps
    without a drafter.
    """

    #: how rank 0 shares a batch's packed grammar masks with the other tensor-parallel ranks
    #: (the group's broadcast; set on rank 0's wrapper, :mod:`specdial.launch.tp_engine`);
    #: None with one rank (:mod:`specdial.worker.grammar_masks`)
    grammar_share: Any = None

    def __init__(self, target: LlamaForCausalLM, drafter: Drafter | None, num_kv_slots: int, *,
                 max_running_requests: int, context_length: int, step_values: Iterable[int],
                 backend: AttentionBackend | None = None,
                 cuda_graph_bs: Sequence[int] | None = None, cuda_graph_mode: str | None = None,
                 adaptive_config: Any = None, max_extend_tokens: int = 4096,
                 tree_max_num_draft_tokens: int | None = None) -> None:
        self.target, self.drafter = target, drafter
        if max_extend_tokens < 1:
            raise ValueError(f"max_extend_tokens must be >= 1, got {max_extend_tokens}")
        self.device = device = target.embed_tokens.weight.device
        if device.type == "cpu":
            keep_freed_memory()  # page-fault-free temporaries (cpu_malloc.py)
        dtype = target.embed_tokens.weight.dtype
        self.backend = backend or select_backend(device, dtype=dtype)
        steps = sorted(set(int(s) for s in step_values)) or [0]
        max_steps = drafter.max_steps if drafter is not None else 0
        if steps[0] < 0 or steps[-1] > max_steps:
            raise ValueError(f"steps {steps} outside 0..{max_steps} "
                             f"({'drafter max_steps' if drafter else 'no drafter'})")
        self.num_kv_slots = num_kv_slots = int(num_kv_slots)
        self.kv = target.make_kv_pool(num_kv_slots)
        self.pad_kv_slot = self.kv.pad_slot
        self.max_bs = max_running_requests
        self.tables = RequestTables(max_running_requests, context_length + steps[-1] + 2, device)
        #: the drafter's valid lengths and the target features it reads (None: no drafter)
        self.drafter_state: DrafterState | None = None
        if drafter is not None:
            drafter.init_kv(num_kv_slots)
            self.drafter_state = DrafterState(
                drafter, self.backend, max_bs=max_running_requests, num_kv_slots=num_kv_slots,
                dtype=dtype, device=device, max_extend_tokens=max_extend_tokens)
        #: penalized rows' token counts (device tensors allocated on the first penalty)
        self.token_counts = TokenCounts(max_running_requests, target.config.vocab_size, device)
        self._build_runners(steps, cuda_graph_bs, cuda_graph_mode, adaptive_config)
        #: the draft-tree verify graphs (None: tree verifies run eagerly)
        self.tree_graphs = capture_tree_graphs(self, tree_max_num_draft_tokens, steps[-1])

    def _build_runners(self, steps: list[int], cuda_graph_bs: Sequence[int] | None,
                       cuda_graph_mode: str | None, adaptive_config: Any) -> None:
        """One runner per steps value over one buffer set; with ``cuda_graph_bs`` the capture
        plan and every graph of it."""
        #: the capture plan and report (None: eager passes)
        self.capture_plan: CapturePlan | None = None
        self.capture_report: CaptureReport | None = None
        pool = None
        if cuda_graph_bs is not None:
            self.capture_plan = CapturePlan.build(steps, cuda_graph_bs, adaptive_config or None,
                                                  has_drafter=self.drafter is not None)
            pool = GraphPool(self.device, cuda_graph_mode)
        #: steps -> its runner (the runtime state), all over one buffer set
        self.states: dict[int, StepRunner] = build_runners(
            self.capture_plan, target=self.target, target_kv=self.kv, drafter=self.drafter,
            backend=self.backend, kv_capacity=self.tables.width, pool=pool, steps=steps,
            tables=self.tables, max_bs=self.max_bs)
        if self.capture_plan is not None:
            self.capture_report = capture_all(self.states, self.capture_plan)

    @property
    def draft_len(self) -> np.ndarray:
        """The drafter's valid length per row (host ``[max_running_requests]``; zeros without
        a drafter): :class:`~specdial.worker.drafter_state.DrafterState`."""
        ds = self.drafter_state
        return ds.draft_len if ds is not None else np.zeros(self.max_bs, np.int64)

    @property
    def hidden(self) -> torch.Tensor | None:
        """Target features per KV slot (EAGLE's input), or None."""
        return None if self.drafter_state is None else self.drafter_state.features

    @property
    def graph_runners(self) -> dict[int, StepRunner]:
        """The runners that replay graphs (all of them with ``cuda_graph_bs``, else none)."""
        return self.states if self.capture_plan is not None else {}

    def graph_stats(self) -> dict[str, Any]:
        """CUDA-graph counters summed over the runners: ``replays`` per pass (draft, verify,
        extend; ``tree_verify`` for draft trees), ``eager`` fallbacks per reason, ``captured``
        graphs (all zero without graphs)."""
        replays: dict[str, int] = {}
        eager: dict[str, int] = {}
        trees = [] if self.tree_graphs is None else [self.tree_graphs]
        for r in [*self.graph_runners.values(), *trees]:
            for k, v in r.stats.replays.items():
                replays[k] = replays.get(k, 0) + v
            for k, v in r.stats.eager.items():
                eager[k] = eager.get(k, 0) + v
        captured = self.capture_report.num_graphs if self.capture_report else 0
        captured += sum(len(t.graphs) for t in trees)
        return {"replays": replays, "eager": eager, "captured": captured}

    # ----------------------------------------------------------------- rows
    def _start_rows(self, rows: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """The plan's rows (``[B]`` int64, assigned by the scheduler), first positions
        ``starts``. Rows whose chunk starts at position 0 start afresh (drafter length and
        token counts reset). Raises ``RuntimeError`` for rows outside the tables (a
        scheduler/worker mismatch: a bug)."""
        if len(rows) != len(starts) or (len(rows) and rows.max() >= self.max_bs):
            raise RuntimeError(f"plan rows {rows.tolist()} do not fit {self.max_bs} rows")
        fresh = rows[starts == 0]
        if len(fresh):
            if self.drafter_state is not None:
                self.drafter_state.restart(fresh)
            self.token_counts.reset(fresh)
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

    # ----------------------------------------------------------------- prefill
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
        kept per KV slot), so a prefill while the policy runs steps 0 costs what the target's
        does. Raises ``ValueError`` for a decode plan or ``sampling`` not covering the
        ``sample_first`` requests.
        """
        inp = plan if isinstance(plan, PrefillInput) else worker_input(plan, self.pad_kv_slot)
        if not isinstance(inp, PrefillInput):
            raise ValueError("prefill: got a decode plan")
        starts = inp.kv_lens - inp.qo_lens
        rows = self._start_rows(inp.rows, np.where(inp.restarts(), 0, starts))
        if inp.cached_lens is not None and inp.cached_lens.any():
            self._fill_cached(rows, inp)
        self.tables.write(rows, starts, inp.qo_lens, kv_slots=inp.out_loc, ids=inp.input_ids)
        runner = self.states[min(self.states)]
        batch, _ = runner.prepare_ragged(rows, starts, inp.kv_lens)
        hidden, feats = run_target(self.target, self.drafter, batch, self.kv, self.backend)
        if self.drafter_state is not None:
            self.drafter_state.store_features(batch.out_loc, feats)
        pending = []  # host copies in flight (logprobs), completed by the blocking copy
        if prompt_plan is not None and len(prompt_plan.index):
            pending.append(("prompt", prompt_logprobs(hidden, self.target.compute_logits,
                                                      prompt_plan).to_host()))
        tokens = self._sample_first(inp, hidden, sampling, generator, logprobs, pending)
        if pending and not inp.sample_first.any() and self.device.type == "cuda":
            # a middle chunk of an echo prompt: no token copy to complete the logprob copies
            torch.cuda.current_stream(self.device).synchronize()
        done = {name: finish() for name, finish in pending}
        if self.drafter_state is not None and draft_prefill:
            # the drafter prefill: a catch-up over the chunk
            self.drafter_state.catch_up(rows, inp.kv_lens, runner)
        offsets = np.concatenate([[0], np.cumsum(inp.sample_first)]).astype(np.int64)
        return StepOutput(0, tokens, offsets, None, done.get("first"), done.get("prompt"))

    def _fill_cached(self, rows: np.ndarray, inp: PrefillInput) -> None:
        """Positions ``0 .. cached_lens[b]`` of the admitted rows from the prefix cache's pages
        (KV slots, token ids, EAGLE features); the drafter's KV up to ``cached_draft_lens`` (all
        when None), where its valid length starts (its catch-up runs over the rest)."""
        assert inp.cached_lens is not None and inp.cached_kv is not None
        hit = inp.cached_lens > 0
        self.tables.write(rows[hit], np.zeros(int(hit.sum()), np.int64), inp.cached_lens[hit],
                          kv_slots=inp.cached_kv, ids=inp.cached_ids)
        if self.drafter_state is not None:
            drafted = inp.cached_lens if inp.cached_draft_lens is None else inp.cached_draft_lens
            self.drafter_state.draft_len[rows[hit]] = drafted[hit]

    def _sample_first(self, inp: PrefillInput, hidden: torch.Tensor,
                      sampling: BatchSampling | None, generator: torch.Generator | None,
                      logprobs: LogprobRows | None, pending: list) -> np.ndarray:
        """The first tokens of the ``sample_first`` requests (host int64; empty when none),
        their log-probabilities' host copy appended to ``pending``."""
        sample_first = inp.sample_first
        if not sample_first.any():
            return np.zeros(0, np.int64)
        if sampling is None or sampling.batch_size != int(sample_first.sum()):
            raise ValueError("prefill: sampling must cover the sample_first requests")
        idx = torch.from_numpy(inp.logits_indices).to(self.device)
        positions = None  # of the first tokens: the prompt lengths (seeded rows' keys)
        firsts = sample_first != 0
        ends = inp.kv_lens[firsts]
        if sampling.any_seeded or sampling.processors is not None:
            positions = torch.from_numpy(ends).to(self.device)
        first_logits = self.target.compute_logits(hidden[idx])
        processing = (None if positions is None
                      else self._processing(sampling, inp.rows[firsts], ends, positions))
        if sampling.grammar is not None:  # structured outputs: the first token's mask
            processing = sampling.grammar.step(processing)
        first = sample(first_logits if processing is None else processing.first(first_logits),
                       sampling, generator, positions)
        if logprobs is not None:  # under a grammar: the constrained distribution's
            allowed = None if sampling.grammar is None else processing.allowed
            pending.append(("first", token_logprobs(first_logits[:, None], first[:, None],
                                                    logprobs, allowed).to_host()))
        host = first.cpu().numpy().astype(np.int64)
        if sampling.grammar is not None:
            sampling.grammar.advance(np.ones(len(host), np.int64), host[:, None])
        return host

    # ----------------------------------------------------------------- decode
    @torch.inference_mode()
    def decode(self, plan: Any, sampling: BatchSampling,
               generator: torch.Generator | None,
               logprobs: LogprobRows | None = None) -> StepOutput:
        """Run a decode plan (a :class:`specdial._core.SchedulePlan`, or its
        :class:`~specdial.worker.inputs.DecodeInput`): ``steps`` drafts per request, verify,
        accept, draft extend, as the stage calls of :mod:`specdial.worker.stages`.

        ``sampling``: the requests' options in plan order; seeded rows key their draws by the
        sequence index of the token decided (draft ``i`` and verify position ``i`` decide
        ``L + i``; see :func:`speculative_accept`). ``logprobs``: rows wanting the target's
        log-probabilities of their emitted tokens (from the verify logits, in batch; their
        host copy rides on the step's one synchronization). Raises ``ValueError`` for a
        prefill plan or a steps value without a runtime state.
        """
        if is_tree_plan(plan):  # draft trees (issue 29): worker/tree_step.py
            return run_tree_iteration(self, TreePlan.from_plan(plan), sampling, generator,
                                      logprobs)
        step = self.prepare(plan, sampling)
        drafts = self.draft(step, sampling, generator)
        verified = self.verify(step)
        accepted = self.accept(step, drafts, verified, sampling, generator, logprobs)
        self.extend(step, accepted)
        return accepted.output(step.steps)

    def prepare(self, plan: Any, sampling: BatchSampling) -> DecodeStep:
        """Write the plan's new KV slots (positions ``L ..= L + steps``; the pad KV slot beyond
        a capped request's own steps) and input tokens ``x_L`` into the tables, and the
        iteration's inputs into the runner's buffers."""
        inp = plan if isinstance(plan, DecodeInput) else worker_input(plan, self.pad_kv_slot)
        if not isinstance(inp, DecodeInput):
            raise ValueError("decode: got a prefill plan")
        runner = self.states.get(inp.steps)
        if runner is None:
            raise ValueError(f"no runtime state for steps={inp.steps}; built: "
                             f"{sorted(self.states)}")
        target_len = inp.positions
        rows = self._start_rows(inp.rows, target_len)
        b, n = len(rows), inp.steps + 1
        self.tables.write(rows, target_len, np.full(b, n, np.int64), kv_slots=inp.out_loc)
        self.tables.write(rows, target_len, np.ones(b, np.int64), ids=inp.input_ids)
        batches = runner.prepare_decode(rows, target_len, inp.graph_bs,
                                        budgets=inp.steps_per_request)
        # sequence index of draft 1 (L + 1): the seeded rows' keys (sampling.py), the first
        # position the processors decide
        first_pos = (batches.verify_positions[:, 0] + 1
                     if sampling.any_seeded or sampling.processors is not None else None)
        processing = (None if first_pos is None
                      else self._processing(sampling, rows, target_len, first_pos))
        if sampling.grammar is not None:  # structured outputs: per-position masks
            processing = sampling.grammar.step(processing)
        return DecodeStep(inp, runner, rows, batches, first_pos, processing)

    def draft(self, step: DecodeStep, sampling: BatchSampling,
              generator: torch.Generator | None) -> Drafts:
        """The drafter's catch-up (after skipped zero-step extends or deferred prefills), then
        ``steps`` draft forwards; the drafts land in the verify inputs. Nothing at steps 0."""
        batches = step.batches
        if not step.steps:
            no_conf = torch.zeros(len(step.rows), 0, dtype=torch.float32, device=self.device)
            return Drafts(batches.verify_ids[:, 1:], None, no_conf)  # [B, 0]
        ds = self.drafter_state
        assert ds is not None
        # a request at budget 0 drafts nothing now: it needs no catch-up (issue 28)
        budgets = step.inp.steps_per_request
        lagging = np.minimum(ds.draft_len[step.rows], step.target_len)
        ds.catch_up(step.rows, np.where(budgets > 0, step.target_len, lagging), step.runner,
                    batches)
        conf = torch.zeros(len(step.rows), step.steps, dtype=torch.float32, device=self.device)
        tokens, probs = step.runner.run_draft(
            batches, first_hidden=ds.first_hidden(self.tables, batches), sampling=sampling,
            generator=generator, sample_positions=step.first_pos, processing=step.processing,
            conf_out=conf)
        batches.verify_ids[:, 1:] = tokens
        # the copy: a replayed draft graph's output is only valid until the next replay
        return Drafts(batches.verify_ids[:, 1:], probs, conf,
                      self._confidence_stop(step, conf, probs, sampling))

    def _confidence_stop(self, step: DecodeStep, conf: torch.Tensor, probs: torch.Tensor | None,
                         sampling: BatchSampling) -> torch.Tensor | None:
        """The plan's confidence stop (:mod:`specdial.worker.confidence_stop`): ``[B]`` device
        verify lengths, None without a rule. On a CPU device an eager batch's verify is
        re-packed over them (reading them there is no sync)."""
        ms = step.inp.min_survival
        if not ms:
            return None
        budgets = torch.from_numpy(step.inp.steps_per_request).to(self.device)
        unseeded = None
        if sampling.any_unseeded and not sampling.all_greedy:
            unseeded = ~sampling.greedy_mask
            if sampling.seeded_mask is not None:
                unseeded = unseeded & ~sampling.seeded_mask
        lens = cut_lengths(stop_confidence(conf, probs, unseeded), budgets, ms)
        if self.device.type == "cpu" and step.batches.layout is None:
            step.batches = repack_verify(step.runner, step.batches, step.target_len,
                                         lens.numpy())
        return lens

    def verify(self, step: DecodeStep) -> Verified:
        """One target forward over ``[x_L, d_1..d_k]`` per request; keeps the drafter's target
        features of those KV slots."""
        verified = step.runner.run_verify(step.batches)
        if self.drafter_state is not None:
            self.drafter_state.store_features(step.batches.verify.out_loc, verified.features)
        logits = (verified.logits if verified.logits is not None
                  else self.target.compute_logits(verified.hidden))
        logits = logits.view(len(step.rows), step.steps + 1, -1)
        # the target's distribution at column i: processed with the history up to d_i
        target = (logits if step.processing is None
                  else step.processing.verify(logits, step.batches.verify_ids))
        return Verified(logits, target)

    def accept(self, step: DecodeStep, drafts: Drafts, verified: Verified,
               sampling: BatchSampling, generator: torch.Generator | None,
               logprobs: LogprobRows | None) -> Accepted:
        """Acceptance (:func:`speculative_accept`; all-greedy CPU batches: :mod:`~specdial.
        worker.host_accept`), emitted tokens into the token table, the one host copy."""
        if (cpu := greedy_accept_host(step, drafts, verified, sampling, self.tables.req_to_ids,
                                      logprobs)) is not None:
            return cpu
        budgets = step.inp.steps_per_request
        limits = (torch.from_numpy(budgets).to(self.device)
                  if step.steps and bool((budgets < step.steps).any()) else None)
        if drafts.verify_lens is not None:  # the confidence stop's cut, at most the budgets
            limits = drafts.verify_lens
        accepted, out = speculative_accept(drafts.tokens, drafts.probs, verified.target,
                                           sampling, generator, step.first_pos, limits)
        batches = step.batches
        # emitted tokens go to positions L+1..L+a+1 (later columns are stale, never read)
        self.tables.req_to_ids[batches.rows[:, None], batches.verify_positions + 1] = out
        allowed = None if sampling.grammar is None else step.processing.allowed  # [B, n, V]
        lp_pending = (None if logprobs is None
                      else token_logprobs(verified.logits, out, logprobs, allowed).to_host())
        parts = [accepted[:, None], out, float_bits(drafts.conf)]
        if drafts.verify_lens is not None:
            parts.append(drafts.verify_lens[:, None])
        host = torch.cat(parts, 1).cpu().numpy()  # the one sync
        lp_host = None if lp_pending is None else lp_pending()
        n = step.steps + 1
        if sampling.grammar is not None:  # the emitted tokens advance the matchers once
            sampling.grammar.advance(host[:, 0] + 1, host[:, 1:n + 1])
        verified = None if drafts.verify_lens is None else host[:, -1].astype(np.int64)
        return Accepted(host[:, 0].astype(np.int64), host[:, 1:n + 1],
                        lp_host, packed_draft_probs(host[:, n + 1:n + 1 + step.steps], budgets),
                        verified)

    def extend(self, step: DecodeStep, accepted: Accepted) -> None:
        """The draft extend over the newly accepted tokens, up to the new target length
        ``L + accepted + 1`` (skipped for the requests the plan's ``skip_extend`` marks: the
        scheduler, the one owner of ``skip_zero_step_draft_extend``, marks every request of a
        steps-0 plan, and budget-0 requests of a drafting one)."""
        ds = self.drafter_state
        if ds is None:
            return
        skip = step.inp.skip_extend
        if skip is not None and skip.all():  # nothing drafted, nothing extends (a steps-0 plan)
            return
        budgets = step.inp.steps_per_request
        drafted = budgets > 0
        if step.steps:  # each request drafted (and wrote true drafter KV for) its own budget;
            # one at budget 0 drafted nothing and keeps its drafter length (it may lag)
            rows = step.rows[drafted]
            ds.after_verify(rows, step.target_len[drafted], budgets[drafted],
                            accepted.accepted[drafted])
        ends = step.target_len + accepted.accepted + 1
        if skip is not None and skip.any():  # the plan's budget-0 requests skip (issue 28)
            ends = np.where(skip != 0, np.minimum(ds.draft_len[step.rows], ends), ends)
        ds.catch_up(step.rows, ends, step.runner, step.batches)
