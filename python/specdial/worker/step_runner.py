"""One runner per steps value: one buffer set, one body per pass, eager or captured.

A :class:`StepRunner` is everything bound to one ``steps`` value ``k`` (docs/design.md "runtime
state"), built once at engine start and swapped as a unit when the chosen steps change. It
prepares a decode batch's inputs in the engine's one
:class:`~specdial.worker.step_buffers.StaticBuffers` and runs the draft, verify and
draft-extend passes. Each pass has **one body**
(:class:`~specdial.worker.pass_bodies.PassBodies`) that runs eagerly over the buffers' prefix
with dynamic attention metadata, or is captured over the prefix padded to a graph size with
fixed-shape metadata and replayed (gpt-fast style) by the runner's graph half, a
:class:`~specdial.worker.graph_passes.GraphPasses` it owns. Inputs are written into the buffers once: the graph
path only pads the tail.

With a :class:`~specdial.worker.graph_pool.GraphPool` (``pool``) a batch of ``b`` requests
replays the graph of ``graph_bs`` (the Rust ``graph_key``'s padded size) or of the smallest
captured size ``g >= b``; the ``g - b`` padded requests get a valid dummy token id, position 0,
the pool's pad KV slot as KV write target and only pad KV slots as keys, and their outputs are
ignored. Batches above the largest captured size, uncaptured keys, sampling or processed drafts
and long catch-up extends run the same bodies eagerly (counted in :attr:`StepRunner.stats`).
Without a pool every pass runs eagerly, its metadata planned from the request tables.

Attention under a graph uses fixed-shape metadata
(:func:`~specdial.attention.select.make_static_attention`: the torch backend's
:class:`~specdial.attention.torch_backend.TorchStaticAttention`, flashinfer's
:class:`~specdial.attention.flashinfer_backend.FlashInferStaticAttention`). Outputs of a replay
are graph-pool tensors: valid until the next replay of any graph of the same pool.

Host arrays are numpy int64 (``start`` arrays ``[B]``: the position of each request's first
query token of the pass); device tensors int64 unless noted. The passes do host work (input
copies, attention plans) but never sync. Shape mismatches raise ``ValueError``.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from specdial.attention.base import AttentionBackend
from specdial.kv_pool import KVPool
from specdial.models.batch import ForwardBatch
from specdial.worker.graph_passes import GraphPasses
from specdial.worker.graph_pool import CapturedGraph, GraphPool
from specdial.worker.graph_tables import CapturePlan
from specdial.worker.pass_bodies import PassBodies
from specdial.worker.runtime import DecodeBatches, RequestTables, load, ragged_positions
from specdial.worker.step_buffers import KVLayout, RunnerStats, StaticBuffers, VerifyOutput
from specdial.worker.verify_budgets import DraftLevels, PackedVerify

I64 = torch.int64


class StepRunner:
    """Buffers, metadata and passes of one ``steps`` value, eager or replayed.

    Arguments:

    - ``steps``: ``k`` (``n = k + 1`` verify tokens per request).
    - ``target`` (a ``LlamaForCausalLM``) and ``target_kv`` (its :class:`KVPool`); ``drafter``
      (a :class:`~specdial.worker.drafters.Drafter` with its ``kv``) or None (plain decoding).
    - ``backend``: the attention backend; ``buffers``: the engine's one
      :class:`StaticBuffers` (shared by all runners); ``tables``: the worker's
      :class:`~specdial.worker.runtime.RequestTables` (None for a runner driven through
      :meth:`verify` / :meth:`draft` / :meth:`draft_extend` only, as tests do).
    - ``pool``: the shared :class:`GraphPool`, or None (eager passes, no capture);
      ``max_graph_bs``: largest capture size (sizes the static attention metadata; default
      the buffers' ``max_bs``); ``kv_capacity``: most KV positions of one request (context
      length + steps + 1).
    - ``logits_in_graph``: the verify pass also computes ``target.compute_logits``;
      ``dummy_token_id``: token of padded requests (any valid id).

    Capture with :meth:`capture` (or :func:`~specdial.worker.graph_pool.capture_all`). With
    :attr:`enabled` False every pass runs eagerly (``disable_cuda_graph`` comparisons).
    """

    def __init__(self, steps: int, *, target, target_kv: KVPool, drafter=None,
                 backend: AttentionBackend, buffers: StaticBuffers, kv_capacity: int,
                 tables: RequestTables | None = None, pool: GraphPool | None = None,
                 max_graph_bs: int | None = None, logits_in_graph: bool = True,
                 dummy_token_id: int = 0) -> None:
        if steps < 0 or steps > buffers.max_steps:
            raise ValueError(f"steps {steps} outside the static buffers' 0..{buffers.max_steps}")
        if steps > 0 and drafter is None:
            raise ValueError("steps > 0 needs a drafter")
        if drafter is not None and steps > drafter.max_steps:
            raise ValueError(f"steps {steps} above the drafter's max_steps {drafter.max_steps}")
        self.steps, self.n = steps, steps + 1
        self.buffers, self.tables, self.pool = buffers, tables, pool
        self.backend, self.max_bs, self.device = backend, buffers.max_bs, buffers.device
        self.pad_kv_slot = target_kv.pad_slot
        #: the pass bodies, run eagerly here and captured / replayed by :attr:`graph`
        self.bodies = PassBodies(steps, target=target, target_kv=target_kv, drafter=drafter,
                                 backend=backend, logits_in_graph=logits_in_graph)
        #: the graph half (composition: explicit inputs, no shared attributes)
        self.graph = GraphPasses(self.bodies, buffers=buffers, pool=pool,
                                 max_graph_bs=max_graph_bs or buffers.max_bs,
                                 kv_capacity=kv_capacity, pad_kv_slot=self.pad_kv_slot,
                                 dummy_token_id=dummy_token_id)
        # the graph half's public face, on the runner
        self.verify, self.draft = self.graph.verify, self.graph.draft
        self.draft_extend, self.padded_bs = self.graph.draft_extend, self.graph.padded_bs
        self.capture, self.capture_one = self.graph.capture, self.graph.capture_one
        self.passes = self.graph.passes

    @property
    def enabled(self) -> bool:
        """False: every pass runs eagerly with dynamic metadata (``disable_cuda_graph``)."""
        return self.graph.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.graph.enabled = value

    @property
    def stats(self) -> RunnerStats:
        """Replays and eager fallbacks of :attr:`graph`."""
        return self.graph.stats

    @property
    def graphs(self) -> dict[tuple[str, int], CapturedGraph]:
        return self.graph.graphs

    @property
    def sizes(self) -> list[int]:
        """Captured batch sizes, ascending."""
        return self.graph.sizes

    # ------------------------------------------------------------------ decode preparation
    def _plan(self, rows: torch.Tensor, qo_lens: np.ndarray, kv_lens: np.ndarray,
              host_rows: np.ndarray | None = None):
        """Eager metadata from the request tables (no pool); ``host_rows``: ``rows`` as a
        host array, which lets CPU tables gather the slot lists in numpy."""
        assert self.tables is not None
        kv_indices = (None if host_rows is None
                      else self.tables.kv_indices_host(host_rows, kv_lens))
        if kv_indices is None:
            kv_d = load(self.buffers.kv_lens, kv_lens)
            kv_indices = self.tables.kv_indices(rows, kv_d, int(kv_lens.sum()))
        return self.backend.plan(torch.from_numpy(qo_lens), torch.from_numpy(kv_lens),
                                 kv_indices)

    def prepare_decode(self, rows: np.ndarray, target_len: np.ndarray,
                       graph_bs: int | None = None,
                       budgets: np.ndarray | None = None) -> DecodeBatches:
        """Write the inputs of requests ``rows`` at ``target_len`` ``L`` (``[B]`` host) into
        the buffers.

        The KV slots of positions ``L..L+steps`` must already be in the tables. Verify input
        column 0 gets ``x_L``; draft step 1 input gets ``x_L``; later columns are filled by the
        draft pass. With a pool no eager metadata is planned here (``attn`` None): the batches
        carry the KV layout and ``graph_bs`` (the plan's) for the passes, which replay or plan
        their own eager metadata when they fall back. ``budgets``: each request's verify
        budget ``v_r`` (``[B]`` host in ``0..steps``; None: all ``steps``); budgets below
        ``steps`` give a packed verify and per-level drafting
        (:mod:`specdial.worker.verify_budgets`) unless a captured graph serves the batch,
        which then replays padded (counted as ``decode:budgets_eager`` when none does)."""
        b, n, k = len(rows), self.n, self.steps
        if b > self.max_bs:
            raise ValueError(f"batch of {b} requests exceeds max_running_requests {self.max_bs}")
        t, buf, graphs = self.tables, self.buffers, self.pool is not None
        assert t is not None, "prepare_decode needs the request tables"
        rows_d = load(buf.batch_rows, rows)
        pos2d = target_len[:, None] + np.arange(n, dtype=np.int64)[None, :]
        positions = load(buf.verify_positions, pos2d.reshape(-1)).view(b, n)
        out_loc = buf.verify_out_loc[: b * n].view(b, n)
        ids = buf.verify_input_ids[: b * n].view(b, n)
        host = t.host_token is not None and t.host_ids is not None and buf.device.type == "cpu"
        if host:  # CPU tables and buffers: numpy on views of the same memory, no torch op
            loc_h, x_h = t.host_token[rows[:, None], pos2d], t.host_ids[rows, target_len]
            buf.verify_out_loc.numpy()[: b * n] = loc_h.reshape(-1)
            buf.verify_input_ids.numpy()[: b * n: n] = x_h
        else:
            out_loc.copy_(t.req_to_token[rows_d[:, None], positions])
            ids[:, 0] = t.req_to_ids[rows_d, positions[:, 0]]
        if budgets is not None and k and bool((budgets < k).any()) and (
                not graphs or not self.enabled or self.padded_bs(b, graph_bs) is None):
            if graphs:  # no graph serves this batch: the eager passes, packed
                self.stats.fallback("decode:budgets_eager")
            return self._prepare_budgets(rows_d, target_len, positions, out_loc, ids,
                                         np.asarray(budgets, np.int64))
        layout = None
        if graphs:
            lens = target_len + n
            layout = KVLayout(t.kv_indices(rows_d, load(buf.kv_lens, lens), int(lens.sum())),
                              lens)
        meta: Any = None if graphs else self._plan(rows_d, np.full(b, n, np.int64),
                                                   target_len + n, rows)
        verify = ForwardBatch(ids.view(-1), positions.view(-1), out_loc.view(-1), meta)
        draft = []
        if k and host:
            buf.draft_positions.numpy()[:k, :b] = pos2d[:, :k].T
            buf.draft_out_loc.numpy()[:k, :b] = loc_h[:, :k].T
            buf.draft_input_ids.numpy()[0, :b] = x_h
        elif k:
            buf.draft_positions[:k, :b].copy_(positions[:, :k].T)
            buf.draft_out_loc[:k, :b].copy_(out_loc[:, :k].T)
            buf.draft_input_ids[0, :b].copy_(ids[:, 0])
        if k:
            ones = np.ones(b, np.int64)
            # at batch size 1 the torch backend derives the steps' metadata from the verify's
            derive = None if graphs else getattr(self.backend, "draft_step_plans", None)
            metas = None if derive is None else derive(meta, k)
            for i in range(k):
                draft.append(ForwardBatch(
                    buf.draft_input_ids[i, :b], buf.draft_positions[i, :b],
                    buf.draft_out_loc[i, :b],
                    None if graphs else metas[i] if metas is not None
                    else self._plan(rows_d, ones, target_len + i + 1, rows)))
        if not graphs:
            return DecodeBatches(verify, draft, rows_d, positions, ids)
        return DecodeBatches(verify, draft, rows_d, positions, ids,
                             np.asarray(target_len, np.int64), layout, graph_bs)

    def _prepare_budgets(self, rows_d: torch.Tensor, target_len: np.ndarray,
                         positions: torch.Tensor, out_loc: torch.Tensor, ids: torch.Tensor,
                         budgets: np.ndarray) -> DecodeBatches:
        """The eager batches of per-request verify budgets: a packed verify over each
        request's ``v_r + 1`` tokens and level ``i + 1`` drafted by the requests with
        ``v_r > i`` only."""
        buf, n, dev = self.buffers, self.n, self.device
        index, unpack = PackedVerify.indices(budgets, n)
        packed = PackedVerify(torch.from_numpy(index).to(dev), torch.from_numpy(unpack).to(dev),
                              self._plan(rows_d, budgets + 1, target_len + budgets + 1))
        verify = ForwardBatch(ids.view(-1), positions.view(-1), out_loc.view(-1), None)
        draft, active = [], []
        for i, members in enumerate(DraftLevels.members(budgets, self.steps)):
            m, c = torch.from_numpy(members).to(dev), len(members)
            buf.draft_positions[i, :c].copy_(positions[m, i])
            buf.draft_out_loc[i, :c].copy_(out_loc[m, i])
            if i == 0:
                buf.draft_input_ids[0, :c].copy_(ids[m, 0])
            draft.append(ForwardBatch(
                buf.draft_input_ids[i, :c], buf.draft_positions[i, :c], buf.draft_out_loc[i, :c],
                self._plan(rows_d[m], np.ones(c, np.int64), target_len[members] + i + 1)))
            active.append(m)
        levels = DraftLevels(active, len(active), ids[:, 0])
        return DecodeBatches(verify, draft, rows_d, positions, ids, packed=packed,
                             levels=levels)

    def prepare_ragged(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                       hidden_rows: int | None = None
                       ) -> tuple[ForwardBatch, torch.Tensor | None]:
        """Forward batch over positions ``[starts[b], ends[b])`` of ``rows[b]`` (all
        ``ends > starts``), token ids and KV slots read from the tables; used for prefill and
        eager draft extends. With ``hidden_rows`` (the zero row of the target-hidden buffer)
        also returns, per token at position ``p``, the hidden-buffer row of position ``p - 1``
        (``hidden_rows`` for ``p = 0``): EAGLE's input feature index."""
        ids, pos_d, loc, hidx = self.ragged_inputs(rows, starts, ends, hidden_rows)
        meta = self._plan(load(self.buffers.ragged_rows, rows), ends - starts, ends, rows)
        return ForwardBatch(ids, pos_d, loc, meta), hidx

    def ragged_inputs(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                      hidden_rows: int | None = None):
        """Like :meth:`prepare_ragged` without planning metadata (``starts <= ends``; empty
        ranges allowed): ``(input_ids, positions, out_loc, hidden index or None)``, packed
        request after request."""
        t, buf = self.tables, self.buffers
        assert t is not None, "ragged passes need the request tables"
        row_rep, pos = ragged_positions(rows, starts, ends)
        pos_d = load(buf.ragged_positions, pos)
        if t.host_token is not None and t.host_ids is not None:  # CPU tables: numpy gathers
            ids_h, loc_h = t.host_ids[row_rep, pos], t.host_token[row_rep, pos]
            hidx = None
            if hidden_rows is not None:
                prev = t.host_token[row_rep, np.maximum(pos - 1, 0)]
                hidx = torch.from_numpy(np.where(pos > 0, prev, hidden_rows))
            return torch.from_numpy(ids_h), pos_d, torch.from_numpy(loc_h), hidx
        rows_d = load(buf.ragged_token_rows, row_rep)
        ids, loc = t.req_to_ids[rows_d, pos_d], t.req_to_token[rows_d, pos_d]
        if hidden_rows is None:
            return ids, pos_d, loc, None
        prev = t.req_to_token[rows_d, (pos_d - 1).clamp_min(0)]
        return ids, pos_d, loc, torch.where(pos_d > 0, prev, hidden_rows)

    # ------------------------------------------------------------------ the worker's passes
    def run_verify(self, batches: DecodeBatches) -> VerifyOutput:
        """The verify pass of a prepared batch -> final hidden ``[B * n, H]``, logits
        ``[B * n, V]`` float32 (None with ``logits_in_graph`` False) and the drafter's
        features (graph-pool tensors after a replay: consume them before the next one)."""
        if batches.layout is not None:
            assert batches.target_len is not None
            v = batches.verify
            return self.verify(v.input_ids, v.positions, v.out_loc, batches.layout,
                               batches.target_len, graph_bs=batches.graph_bs)
        if batches.packed is not None:
            p = batches.packed
            out = self.bodies.verify(p.batch(batches.verify))
            return VerifyOutput(*(p.expand(x) for x in out))
        return VerifyOutput(*self.bodies.verify(batches.verify))

    def run_draft(self, batches: DecodeBatches, **kwargs):
        """All ``steps`` draft forwards of a prepared batch -> ``(tokens [B, k], probs
        [B, k, V] | None)``; ``kwargs``: ``first_hidden``, ``sampling``, ``generator``,
        ``sample_positions``, ``processing`` (see :meth:`draft`)."""
        if batches.layout is not None:
            assert batches.target_len is not None
            b, k, buf = len(batches.target_len), self.steps, self.buffers
            return self.draft(buf.draft_input_ids[0, :b], buf.draft_positions[:k, :b],
                              buf.draft_out_loc[:k, :b], batches.layout, batches.target_len,
                              graph_bs=batches.graph_bs, **kwargs)
        return self.bodies.draft(batches.draft, levels=batches.levels, **kwargs)

    def run_extend(self, batches: DecodeBatches, rows: np.ndarray, starts: np.ndarray,
                   ends: np.ndarray, hidden: torch.Tensor | None,
                   zero_row: int | None) -> None:
        """Drafter KV-only extend over ``[starts[b], ends[b])`` of the decode batch's requests
        (``rows`` all of them, in plan order; empty ranges allowed) through :meth:`draft_extend`
        (``batches`` prepared with a pool). ``hidden``: the worker's target-hidden buffer
        (EAGLE) with ``zero_row``, else None."""
        assert batches.layout is not None
        counts = np.maximum(ends - starts, 0)
        ends = starts + counts
        ids, pos, loc, hidx = self.ragged_inputs(rows, starts, ends,
                                                 None if hidden is None else zero_row)
        feats = None if hidden is None or hidx is None else hidden[hidx]
        self.draft_extend(ids, pos, loc, batches.layout, starts, counts, feats,
                          graph_bs=batches.graph_bs)


def build_runners(plan: CapturePlan | None, *, target, target_kv: KVPool, drafter, backend,
                  kv_capacity: int, pool: GraphPool | None = None,
                  steps: Iterable[int] | None = None, tables: RequestTables | None = None,
                  max_bs: int | None = None, logits_in_graph: bool = True,
                  dummy_token_id: int = 0) -> dict[int, StepRunner]:
    """One :class:`StepRunner` per steps value over one shared :class:`StaticBuffers`.

    ``plan``: the capture plan (its steps values and largest size; with ``pool``), or None
    for eager runners of ``steps``. The buffers hold ``max(max_bs, plan.max_bs)`` requests
    (``max_bs``: the worker's ``max_running_requests``) and the largest steps value. Not
    captured yet: call :func:`~specdial.worker.graph_pool.capture_all`. Raises ``ValueError``
    when neither ``plan`` nor ``steps`` names a steps value, or ``pool`` comes without a plan.
    """
    if pool is not None and plan is None:
        raise ValueError("build_runners: a GraphPool needs a CapturePlan")
    values = sorted(plan.sizes) if plan is not None else sorted(set(int(s) for s in steps or ()))
    if not values:
        raise ValueError("build_runners: no steps values (give a plan or steps)")
    graph_bs = plan.max_bs if plan is not None else None
    w = target.embed_tokens.weight
    buffers = StaticBuffers(max_bs=max(max_bs or 0, graph_bs or 0), max_steps=values[-1],
                            hidden_size=target.config.hidden_size,
                            vocab_size=target.config.vocab_size, kv_capacity=kv_capacity,
                            dtype=w.dtype, device=w.device,
                            feature_size=None if drafter is None else drafter.feature_size)
    return {s: StepRunner(s, target=target, target_kv=target_kv, drafter=drafter,
                          backend=backend, buffers=buffers, kv_capacity=kv_capacity,
                          tables=tables, pool=pool, max_graph_bs=graph_bs,
                          logits_in_graph=logits_in_graph, dummy_token_id=dummy_token_id)
            for s in values}
