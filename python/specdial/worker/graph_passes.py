"""The graph half of a step runner: capture, padded replay and eager fallback of passes
described by a KV layout.

:class:`GraphPasses` is built by :class:`~specdial.worker.step_runner.StepRunner` with
explicit inputs (composition): the :class:`~specdial.worker.pass_bodies.PassBodies` of its
steps value, which it captures over the static buffers padded to a graph size or runs eagerly
with metadata planned from the layout, the buffers, the :class:`GraphPool` and the pad KV
KV slot. The public passes :meth:`GraphPasses.verify`, :meth:`GraphPasses.draft` and
:meth:`GraphPasses.draft_extend` take device tensors and a
:class:`~specdial.worker.step_buffers.KVLayout`; ``start`` arrays are host int64 ``[B]``.
"""

from __future__ import annotations

import bisect
from typing import Any, Callable, Iterable

import numpy as np
import torch

from specdial.attention.base import expand_kv_indices
from specdial.attention.select import make_static_attention
from specdial.models.batch import ForwardBatch
from specdial.worker.batch_sampling import BatchSampling
from specdial.worker.graph_pool import CapturedGraph, GraphPool
from specdial.worker.pass_bodies import PassBodies
from specdial.worker.sampling_params import SamplingParams
from specdial.worker.step_buffers import KVLayout, RunnerStats, StaticBuffers, VerifyOutput

I64 = torch.int64


def _pad(a: np.ndarray, g: int, value: int) -> np.ndarray:
    out = np.full(g, value, np.int64)
    out[: len(a)] = a
    return out


def _load_into(dst: torch.Tensor, src: torch.Tensor | None) -> None:
    """Copy ``src`` into the prefix of ``dst`` unless it already is that prefix (the worker's
    inputs are prepared in place: the graph path then copies nothing)."""
    if src is None or src.numel() == 0:
        return
    if src.data_ptr() == dst.data_ptr() and src.shape == dst.shape \
            and src.stride() == dst.stride():
        return
    dst.copy_(src.reshape(dst.shape))


class GraphPasses:
    """Capture, padded replay and eager fallback of one steps value's passes.

    - ``bodies``: the :class:`PassBodies` (steps, models, backend) it captures or runs.
    - ``buffers``: the engine's one :class:`StaticBuffers`; ``pool``: the shared
      :class:`GraphPool`, or None (every pass eager, nothing captured).
    - ``max_graph_bs``: largest capture size (sizes the static attention metadata);
      ``kv_capacity``: most KV positions of one request.
    - ``pad_kv_slot``: the KV pools' pad sentinel (padded requests write and read it);
      ``dummy_token_id``: token of padded requests (any valid id).

    :attr:`enabled` False runs every pass eagerly (``disable_cuda_graph`` comparisons).
    """

    def __init__(self, bodies: PassBodies, *, buffers: StaticBuffers, pool: GraphPool | None,
                 max_graph_bs: int, kv_capacity: int, pad_kv_slot: int,
                 dummy_token_id: int = 0) -> None:
        self.bodies, self.buffers, self.pool = bodies, buffers, pool
        self.steps, self.n = bodies.steps, bodies.steps + 1
        self.backend, self.device = bodies.backend, buffers.device
        self.has_drafter = bodies.has_drafter
        self.needs_hidden = bodies.needs_hidden
        self.extend_uses_attention = bodies.extend_uses_attention
        self.max_graph_bs, self.pad_kv_slot = max_graph_bs, pad_kv_slot
        self.dummy_token_id = dummy_token_id
        self.verify_attn: Any = None
        self.extend_attn: Any = None
        self.draft_attn: list[Any] = []
        if pool is not None:
            dev, mg = self.device, max_graph_bs
            self.verify_attn = make_static_attention(self.backend, mg, self.n, kv_capacity, dev)
            self.draft_attn = [make_static_attention(self.backend, mg, 1, kv_capacity, dev)
                               for _ in range(self.steps)]
            if self.has_drafter:
                self.extend_attn = make_static_attention(self.backend, mg, self.n, kv_capacity,
                                                         dev)
        self.graphs: dict[tuple[str, int], CapturedGraph] = {}
        self.sizes: list[int] = []  # captured batch sizes, ascending
        self.stats = RunnerStats()
        #: False: every pass runs eagerly with dynamic metadata (``disable_cuda_graph``)
        self.enabled = pool is not None
        self._greedy: dict[int, BatchSampling] = {}

    # ------------------------------------------------------------------ sizes
    def passes(self) -> tuple[str, ...]:
        if not self.has_drafter:
            return ("verify",)
        return (("draft",) if self.steps else ()) + ("verify", "extend")

    def padded_bs(self, batch_size: int, graph_bs: int | None = None) -> int | None:
        """The captured size serving ``batch_size``: ``graph_bs`` if captured and large enough,
        None if ``graph_bs`` names an uncaptured size, else the smallest captured size
        ``>= batch_size`` (None above the largest)."""
        if graph_bs is not None:
            return graph_bs if graph_bs >= batch_size and ("verify", graph_bs) in self.graphs \
                else None
        i = bisect.bisect_left(self.sizes, batch_size)
        return self.sizes[i] if i < len(self.sizes) else None

    def _serving_size(self, kind: str, batch_size: int, graph_bs: int | None) -> int | None:
        """Padded size for a pass, or None (eager) with the reason counted in :attr:`stats`."""
        if not self.enabled:
            self.stats.fallback(f"{kind}:disabled")
            return None
        g = self.padded_bs(batch_size, graph_bs)
        if g is None:
            self.stats.fallback(f"{kind}:batch_not_captured")
        return g

    def _greedy_sampling(self, g: int) -> BatchSampling:
        s = self._greedy.get(g)
        if s is None:
            s = self._greedy[g] = BatchSampling.from_params([SamplingParams()] * g, self.device)
        return s

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture(self, sizes: Iterable[int]) -> None:
        """Capture every pass for each batch size (largest first). Raises ``ValueError`` for a
        size above the static buffers' ``max_bs``."""
        for g in sorted(set(int(s) for s in sizes), reverse=True):
            self.capture_one(g)

    @torch.inference_mode()
    def capture_one(self, g: int) -> None:
        """Capture the passes of padded batch size ``g`` (inputs: ``g`` padded requests)."""
        if self.pool is None:
            raise ValueError("capture needs a GraphPool (the runner was built without one)")
        if not 1 <= g <= self.max_graph_bs:
            raise ValueError(f"graph batch size {g} outside 1..{self.max_graph_bs} (the "
                             "static buffers' max_bs)")
        if ("verify", g) in self.graphs:
            return
        empty = torch.zeros(0, dtype=I64, device=self.device)
        none = np.zeros(0, np.int64)
        layout = KVLayout(empty, none)
        if "draft" in self.passes():
            self._fill_draft(g, None, None, None, layout, none, None)
            self.graphs[("draft", g)] = self.pool.capture(self._draft_body(g))
        self._fill_verify(g, None, None, None, layout, none)
        self.graphs[("verify", g)] = self.pool.capture(self._verify_body(g))
        if "extend" in self.passes():
            self._fill_extend(g, None, None, None, None, layout, none, none, plan=True)
            self.graphs[("extend", g)] = self.pool.capture(self._extend_body(g))
        bisect.insort(self.sizes, g)

    # ------------------------------------------------------------------ pass bodies
    def _verify_body(self, g: int) -> Callable[[], Any]:
        b, m = self.buffers, g * self.n
        batch = ForwardBatch(b.verify_input_ids[:m], b.verify_positions[:m], b.verify_out_loc[:m],
                             self._verify_meta)

        return lambda: self.bodies.verify(batch)

    def _draft_body(self, g: int) -> Callable[[], Any]:
        b, k = self.buffers, self.steps
        batches = [ForwardBatch(b.draft_input_ids[i, :g], b.draft_positions[i, :g],
                                b.draft_out_loc[i, :g], self._draft_metas[i]) for i in range(k)]
        first = b.draft_first_hidden[:g] if self.needs_hidden else None
        sampling = self._greedy_sampling(g)
        conf = b.draft_conf[:g, :k]

        return lambda: self.bodies.draft(batches, first, sampling, None, conf_out=conf)[0]

    def _extend_body(self, g: int) -> Callable[[], Any]:
        b, m = self.buffers, g * self.n
        batch = ForwardBatch(b.extend_input_ids[:m], b.extend_positions[:m], b.extend_out_loc[:m],
                             self._extend_meta)
        hidden = b.extend_hidden[:m] if self.needs_hidden else None

        return lambda: self.bodies.extend(batch, hidden)

    # ------------------------------------------------------------------ input filling
    def _fill_verify(self, g, input_ids, positions, out_loc, kv: KVLayout, start) -> None:
        """Static verify inputs for ``b = len(start)`` real requests padded to ``g``."""
        buf, n, b = self.buffers, self.n, len(start)
        m, mb = g * n, b * n
        for dst, src, pad in ((buf.verify_input_ids, input_ids, self.dummy_token_id),
                              (buf.verify_positions, positions, 0),
                              (buf.verify_out_loc, out_loc, self.pad_kv_slot)):
            if mb:
                _load_into(dst[:mb], src)
            dst[mb:m].fill_(pad)
        kv_lens = _pad(start + n, g, n)
        valid = _pad(np.minimum(kv.lens, start + n), g, 0)
        self._verify_meta = self.verify_attn.plan(
            g, kv.indices, _pad(kv.lens, g, 0), kv_lens, valid, self.pad_kv_slot)

    def _fill_draft(self, g, input_ids, positions, out_loc, kv: KVLayout, start,
                    first_hidden) -> None:
        buf, k, b = self.buffers, self.steps, len(start)
        ids, pos, loc = buf.draft_input_ids, buf.draft_positions, buf.draft_out_loc
        if b:
            _load_into(ids[0, :b], input_ids)
            _load_into(pos[:k, :b], positions)
            _load_into(loc[:k, :b], out_loc)
        ids[:k, b:g].fill_(self.dummy_token_id)
        pos[:k, b:g].fill_(0)
        loc[:k, b:g].fill_(self.pad_kv_slot)
        if self.needs_hidden:
            if b:
                buf.draft_first_hidden[:b].copy_(first_hidden)
            buf.draft_first_hidden[b:g].zero_()
        flat_lens = _pad(kv.lens, g, 0)
        self._draft_metas = []
        for i, attn in enumerate(self.draft_attn):
            lens = start + 1 + i
            self._draft_metas.append(attn.plan(
                g, kv.indices, flat_lens, _pad(lens, g, 1),
                _pad(np.minimum(kv.lens, lens), g, 0), self.pad_kv_slot))

    def _fill_extend(self, g, input_ids, positions, out_loc, hidden_states, kv: KVLayout,
                     start, counts, plan: bool) -> None:
        buf, n, b = self.buffers, self.n, len(start)
        m, total = g * n, int(np.sum(counts))
        # packed token t of request r, j-th -> padded row r * n + j
        dst = None
        if total:
            c = torch.from_numpy(np.asarray(counts, np.int64)).to(self.device, non_blocking=True)
            req = torch.repeat_interleave(torch.arange(b, device=self.device), c,
                                          output_size=total)
            j = torch.arange(total, device=self.device) - (torch.cumsum(c, 0) - c)[req]
            dst = req * n + j
        for t, src, pad in ((buf.extend_input_ids, input_ids, self.dummy_token_id),
                            (buf.extend_positions, positions, 0),
                            (buf.extend_out_loc, out_loc, self.pad_kv_slot)):
            t[:m].fill_(pad)
            if dst is not None:
                t[dst] = src
        if self.needs_hidden:
            buf.extend_hidden[:m].zero_()
            if dst is not None:
                buf.extend_hidden[dst] = hidden_states.to(buf.extend_hidden.dtype)
        if self.extend_attn is not None and plan:
            self._extend_meta = self.extend_attn.plan(
                g, kv.indices, _pad(kv.lens, g, 0), _pad(start + n, g, n),
                _pad(start + counts, g, 0), self.pad_kv_slot)

    # ------------------------------------------------------------------ passes
    @torch.inference_mode()
    def verify(self, input_ids: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor,
               kv: KVLayout, start: np.ndarray, graph_bs: int | None = None) -> VerifyOutput:
        """Target forward over ``B * n`` tokens (``[x_L, d_1..d_k]`` per request at positions
        ``start[b] .. start[b] + k``; ``out_loc`` their KV slots, the pad KV slot allowed).

        Keys of request ``b``: positions ``0 .. start[b] + k`` from ``kv`` (entries past
        ``kv.lens[b]`` read the pad KV slot, for requests verifying fewer than ``k`` drafts).
        Returns :class:`VerifyOutput` of ``B * n`` rows."""
        start = np.asarray(start, np.int64)
        b, n = len(start), self.n
        self._check(kv, b, input_ids.numel() == positions.numel() == out_loc.numel() == b * n,
                    f"verify: {b} requests x {n} tokens")
        g = self._serving_size("verify", b, graph_bs)
        if g is None:
            return self._verify_eager(input_ids, positions, out_loc, kv, start)
        self._fill_verify(g, input_ids, positions, out_loc, kv, start)
        hidden, logits, feats = self.graphs[("verify", g)].replay()
        self.stats.replays["verify"] += 1
        m = b * n
        return VerifyOutput(hidden[:m], None if logits is None else logits[:m],
                            None if feats is None else feats[:m])

    @torch.inference_mode()
    def draft(self, input_ids: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor,
              kv: KVLayout, start: np.ndarray, first_hidden: torch.Tensor | None = None,
              sampling: BatchSampling | None = None, generator: torch.Generator | None = None,
              graph_bs: int | None = None, sample_positions: torch.Tensor | None = None,
              processing: Any = None,
              conf_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``k`` draft forwards: ``input_ids`` ``[B]`` (``x_L``), ``positions`` / ``out_loc``
        ``[k, B]`` (``L + i`` and its KV slot), ``start`` = ``L``; step ``i`` attends to positions
        ``0 .. L + i``. ``first_hidden`` ``[B, H]``: EAGLE's ``h_{L-1}``. Greedy batches replay
        the graph; sampling batches (``sampling.all_greedy`` false) run eagerly, with
        ``sample_positions`` (``[B]``, draft 1's sequence index, for seeded rows) passed to
        :meth:`Drafter.draft`; so do batches with penalties or ``min_tokens`` (``processing``,
        a :class:`~specdial.worker.processors.StepProcessing`: the graph drafts unprocessed).
        ``conf_out`` ``[B, k]`` float32: filled with the drafts' confidences (a replay writes
        them into the buffers' ``draft_conf`` and copies them out).
        Returns ``(tokens [B, k] int64, probs [B, k, V] or None)``."""
        if self.steps == 0 or not self.has_drafter:
            raise ValueError("draft needs steps >= 1 and a drafter")
        start = np.asarray(start, np.int64)
        b, k = len(start), self.steps
        self._check(kv, b, input_ids.numel() == b and tuple(positions.shape) == (k, b)
                    and tuple(out_loc.shape) == (k, b), f"draft: {b} requests x {k} steps")
        if self.needs_hidden and first_hidden is None:
            raise ValueError("draft: an EAGLE drafter needs first_hidden [B, H] (h_{L-1})")
        if sampling is not None and not sampling.all_greedy:
            self.stats.fallback("draft:sampling")
            g = None
        elif processing is not None:
            self.stats.fallback("draft:processors")
            g = None
        else:
            g = self._serving_size("draft", b, graph_bs)
        if g is None:
            return self._draft_eager(input_ids, positions, out_loc, kv, start, first_hidden,
                                     sampling, generator, sample_positions, processing,
                                     conf_out)
        self._fill_draft(g, input_ids, positions, out_loc, kv, start, first_hidden)
        tokens = self.graphs[("draft", g)].replay()
        self.stats.replays["draft"] += 1
        if conf_out is not None:
            conf_out.copy_(self.buffers.draft_conf[:b, :k])
        return tokens[:b], None

    @torch.inference_mode()
    def draft_extend(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     out_loc: torch.Tensor, kv: KVLayout, start: np.ndarray, counts: np.ndarray,
                     hidden_states: torch.Tensor | None = None,
                     graph_bs: int | None = None) -> None:
        """Drafter KV-only extend over ``counts[b]`` tokens of request ``b`` at positions
        ``start[b] ..`` (packed ragged ``[sum(counts)]`` inputs; ``hidden_states``
        ``[sum(counts), H]`` for EAGLE). The graph holds ``n`` tokens per request; a request with
        more (a catch-up) runs eagerly."""
        if not self.has_drafter:
            raise ValueError("draft_extend needs a drafter")
        start, counts = np.asarray(start, np.int64), np.asarray(counts, np.int64)
        b, m = len(start), int(np.sum(counts))
        self._check(kv, b, len(counts) == b and input_ids.numel() == positions.numel()
                    == out_loc.numel() == m, f"draft_extend: {m} tokens of {b} requests")
        if self.needs_hidden and (hidden_states is None or hidden_states.shape[0] != m):
            raise ValueError("draft_extend: an EAGLE drafter needs hidden_states [sum(counts), H]")
        if b and int(counts.max()) > self.n:
            self.stats.fallback("extend:long")
            g = None
        else:
            g = self._serving_size("extend", b, graph_bs)
        if g is None:
            self._extend_eager(input_ids, positions, out_loc, kv, start, counts, hidden_states)
            return
        self._fill_extend(g, input_ids, positions, out_loc, hidden_states, kv, start, counts,
                          plan=self.extend_uses_attention)
        self.graphs[("extend", g)].replay()
        self.stats.replays["extend"] += 1

    @staticmethod
    def _check(kv: KVLayout, b: int, ok: bool, what: str) -> None:
        if not ok or kv.batch_size != b:
            raise ValueError(f"{what}: inputs of mismatched sizes (KV layout of "
                             f"{kv.batch_size} requests)")

    # ------------------------------------------------------------------ eager fallbacks
    def _plan_eager(self, kv: KVLayout, qo: np.ndarray, kv_lens: np.ndarray, valid: np.ndarray):
        idx, _, _ = expand_kv_indices(kv.indices, kv.lens, kv_lens, valid, self.pad_kv_slot)
        return self.backend.plan(torch.from_numpy(qo), torch.from_numpy(kv_lens), idx)

    def _verify_eager(self, input_ids, positions, out_loc, kv, start) -> VerifyOutput:
        n, b = self.n, len(start)
        meta = self._plan_eager(kv, np.full(b, n, np.int64), start + n,
                                np.minimum(kv.lens, start + n))
        batch = ForwardBatch(input_ids.reshape(-1), positions.reshape(-1), out_loc.reshape(-1),
                             meta)
        return VerifyOutput(*self.bodies.verify(batch))

    def _draft_eager(self, input_ids, positions, out_loc, kv, start, first_hidden, sampling,
                     generator, sample_positions=None, processing=None, conf_out=None):
        k, b = self.steps, len(start)
        ids = torch.empty(k, b, dtype=I64, device=self.device)
        ids[0].copy_(input_ids)
        ones = np.ones(b, np.int64)
        batches = []
        for i in range(k):
            lens = start + 1 + i
            meta = self._plan_eager(kv, ones, lens, np.minimum(kv.lens, lens))
            batches.append(ForwardBatch(ids[i], positions[i], out_loc[i], meta))
        if sampling is None:
            sampling = BatchSampling.from_params([SamplingParams()] * b, self.device)
        return self.bodies.draft(batches, first_hidden, sampling, generator, sample_positions,
                                processing, conf_out)

    def _extend_eager(self, input_ids, positions, out_loc, kv, start, counts, hidden_states):
        keep = counts > 0
        if not keep.any():
            return
        if not keep.all():  # drop requests with nothing to extend (their tokens are absent)
            kv_keep = np.repeat(keep, kv.lens)
            kv = KVLayout(kv.indices[torch.from_numpy(kv_keep).to(self.device)], kv.lens[keep])
            start, counts = start[keep], counts[keep]
        meta = self._plan_eager(kv, counts, start + counts, start + counts)
        self.bodies.extend(ForwardBatch(input_ids, positions, out_loc, meta), hidden_states)
