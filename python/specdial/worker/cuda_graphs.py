"""CUDA graphs per graph key ``(steps, padded batch size)``: capture plans, static buffers, runner.

On a GPU the launch overhead of a decode iteration (hundreds of small kernels) decides whether
speculation pays, so serving engines replay CUDA graphs. The adaptive design adds two rules
(SGLang PR #24055): every steps value the policy can choose needs its graphs ready, and graphs
that no batch-size slot can reach are not captured (:class:`CapturePlan`, pruned with
``AdaptiveSpeculativeParams.cuda_graph_bs_for_step``). Switching steps swaps the runtime state
(one :class:`CudaGraphRunner` per steps value); nothing is captured then.

Pieces:

- :func:`default_cuda_graph_bs`: SGLang's default capture sizes, capped at
  ``max_running_requests``.
- :class:`CapturePlan`: per candidate steps value, the batch sizes to capture (largest first)
  and the passes per size: ``draft`` (``steps >= 1``), ``verify``, ``extend`` (draft extend,
  KV only; only with a drafter).
- :func:`static_buffer_shapes` / :class:`StaticBuffers`: every fixed-address input buffer,
  sized from the **largest** steps value and the largest batch: verify rows
  ``max_bs * (max_steps + 1)``. SGLang #30549 / #35275: with adaptive steps, a shared buffer
  sized from the initial steps (128 rows) crashed when 32 requests x 8 draft tokens = 256 rows
  were replayed.
- :class:`GraphPool`: one memory pool (``torch.cuda.graph_pool_handle()``) and one capture stream
  for all graphs (a fresh stream per capture partitions the pool's segments by stream; SGLang
  #35275), or the eager / emulated modes used on the CPU.
- :class:`CudaGraphRunner`: the draft, verify and draft-extend passes of one steps value.
  A batch of ``b`` requests replays the graph of the smallest captured size ``g >= b``; the
  ``g - b`` padded requests get a valid dummy token id, position 0, the pool's pad slot as KV
  write target and only pad slots as keys, and their outputs are ignored. Batches above the
  largest captured size (or uncaptured keys, non-greedy drafting, long catch-up extends) run
  eagerly with the backend's dynamic metadata.

Attention under a graph uses fixed-shape metadata (:func:`make_static_attention`): for the
torch backend a ``[g, kv_capacity]`` slot table and a ``[g, 1, n, kv_capacity]`` mask
(:class:`TorchStaticAttention`; keys beyond a request's length read the pad slot and are
masked), for flashinfer per-batch-size CUDA-graph wrappers re-planned before each replay
(:class:`~specdial.attention.flashinfer_backend.FlashInferStaticAttention`).

Outputs of a replay are graph-pool tensors: valid until the next replay of any graph of the
same :class:`GraphPool` (consume or copy them first), as in SGLang's runners.

KV layout convention (:class:`KVLayout`): one flat list of slots per request covering positions
``0 .. lens[b] - 1`` (a ``RequestTables.kv_indices`` gather, or a ``SchedulePlan``'s
``kv_indices``/``kv_lens``); each pass attends to a prefix of it. ``start`` arrays are host
int64 ``[B]``: the position of each request's first query token of the pass.

Wiring into a worker (one runner per ``RuntimeState``; benches/gpu_check.py's ``MiniDecoder``
is a complete greedy example): build a :class:`CapturePlan` from the runtime states' steps
values, the engine's ``cuda_graph_bs`` (default :func:`default_cuda_graph_bs`) and the adaptive
config (None for fixed steps); :func:`build_runners` over the worker's target, KV pool, drafter
and backend with ``kv_capacity`` = the request tables' width; :func:`capture_all` once at
start; give the scheduler the same sizes (``Scheduler(..., cuda_graph_bs=sizes)``) so each
plan's ``graph_bs`` names a captured size. Per decode iteration, with ``L`` = target lengths and
``layout = KVLayout(tables.kv_indices(rows, L + n), L + n)``: ``runner.draft(...)`` from
``RuntimeState.run_draft``, ``runner.verify(...)`` from ``run_verify`` (its ``logits`` replace
``compute_logits``), ``runner.draft_extend(...)`` for the drafter extends (same layout), each
with ``graph_bs=plan.graph_bs``; skip the eager ``backend.plan`` calls of ``prepare_decode``
when ``runner.padded_bs(B, graph_bs)`` is not None.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from specdial._core import AdaptiveConfig, AdaptiveSpeculativeParams
from specdial.attention.base import AttentionBackend
from specdial.attention.flashinfer_backend import expand_kv_indices
from specdial.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from specdial.kv_pool import KVPool
from specdial.models.batch import ForwardBatch
from specdial.worker.drafters import run_target
from specdial.worker.sampling import BatchSampling, SamplingParams

I64 = torch.int64
PASSES = ("draft", "verify", "extend")


# --------------------------------------------------------------------------- capture sizes
def default_cuda_graph_bs(max_running_requests: int) -> list[int]:
    """SGLang's default CUDA-graph batch sizes, capped at ``max_running_requests``.

    Rule (SGLang ``ServerArgs._generate_cuda_graph_batch_sizes``, non-speculative branch):
    ``[1, 2, 4, 8, 12] + range(16, 257, 8) + range(272, 512, 16) + range(512, max + 1, 32)``,
    keeping sizes ``<= max_running_requests``. One deviation: ``max_running_requests`` itself is
    appended when the grid misses it, so a full batch still replays a graph (SGLang leaves the
    last sizes above its largest grid point to eager mode). Raises ``ValueError`` below 1.
    """
    if isinstance(max_running_requests, bool) or not isinstance(max_running_requests, int) \
            or max_running_requests < 1:
        raise ValueError(f"max_running_requests must be an int >= 1, got {max_running_requests!r}")
    grid = ([1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16))
            + list(range(512, max_running_requests + 1, 32)))
    sizes = [s for s in grid if s <= max_running_requests]
    if sizes[-1] != max_running_requests:
        sizes.append(max_running_requests)
    return sizes


def normalize_graph_bs(sizes: Iterable[int]) -> tuple[int, ...]:
    """Sorted, deduplicated batch sizes; ``ValueError`` for an empty list or a size < 1."""
    out = []
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1:
            raise ValueError(f"cuda_graph_bs: batch sizes must be ints >= 1, got {s!r}")
        out.append(int(s))
    if not out:
        raise ValueError("cuda_graph_bs is empty")
    return tuple(sorted(set(out)))


def _graph_sizes_of(policy: AdaptiveSpeculativeParams | AdaptiveConfig | Mapping | None,
                    graph_bs: tuple[int, ...], steps: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """Per steps value, the sizes whose batch-size slot can choose it (from the Rust policy)."""
    if isinstance(policy, AdaptiveSpeculativeParams):
        params = policy
    else:
        config = policy if isinstance(policy, AdaptiveConfig) else AdaptiveConfig.from_dict(
            dict(policy))  # type: ignore[arg-type]
        params = AdaptiveSpeculativeParams(config.candidate_steps[0], config)
        params.set_cuda_graph_bs(list(graph_bs))
    out: dict[int, tuple[int, ...]] = {}
    for s in steps:
        sizes = params.cuda_graph_bs_for_step(s)
        if sizes is None:
            raise ValueError("the policy has no CUDA-graph sizes: call "
                             "params.set_cuda_graph_bs(cuda_graph_bs) before building the plan")
        stray = set(sizes) - set(graph_bs)
        if stray:
            raise ValueError(f"the policy's CUDA-graph sizes include {sorted(stray)}, not in "
                             f"cuda_graph_bs {list(graph_bs)}: give both the same list")
        out[s] = tuple(sorted(sizes, reverse=True))
    return out


@dataclass(frozen=True)
class CapturePlan:
    """Which graphs to capture: per steps value the batch sizes, largest first.

    - ``graph_bs``: every capture size (ascending), the list the Rust side pads to.
    - ``sizes``: ``{steps: (bs, ...)}`` descending; with pruning only the sizes whose
      batch-size slot has ``steps`` among its candidates (a padded batch routes to the slot of
      its padded size), without pruning every size for every steps value.
    - ``pruned``, ``has_drafter`` (without a drafter only ``verify`` graphs exist).
    """

    graph_bs: tuple[int, ...]
    sizes: dict[int, tuple[int, ...]]
    pruned: bool
    has_drafter: bool = True

    @classmethod
    def build(cls, step_values: Iterable[int], graph_bs: Iterable[int],
              policy: AdaptiveSpeculativeParams | AdaptiveConfig | Mapping | None = None, *,
              prune: bool = True, has_drafter: bool = True) -> "CapturePlan":
        """Plan for ``step_values`` (the runtime states) and ``graph_bs``.

        ``policy``: the adaptive policy (its ``cuda_graph_bs_for_step`` prunes; an
        ``AdaptiveSpeculativeParams`` must already have ``set_cuda_graph_bs(graph_bs)``), an
        ``AdaptiveConfig`` / config dict (a private policy object is built for the query), or
        None (fixed steps: every size). Raises ``ValueError`` for bad sizes, negative steps,
        positive steps without a drafter, or a policy with other sizes.
        """
        steps = sorted(set(int(s) for s in step_values))
        if not steps or steps[0] < 0:
            raise ValueError(f"step values must be ints >= 0, got {steps}")
        if not has_drafter and steps != [0]:
            raise ValueError(f"without a drafter only steps 0 exists, got {steps}")
        sizes_all = normalize_graph_bs(graph_bs)
        if prune and policy is not None:
            sizes = _graph_sizes_of(policy, sizes_all, steps)
        else:
            sizes = {s: tuple(reversed(sizes_all)) for s in steps}
        return cls(sizes_all, sizes, bool(prune and policy is not None), has_drafter)

    @property
    def max_steps(self) -> int:
        return max(self.sizes)

    @property
    def max_bs(self) -> int:
        return self.graph_bs[-1]

    def passes(self, steps: int) -> tuple[str, ...]:
        """The graphs of one ``(steps, bs)`` key, in replay order."""
        if not self.has_drafter:
            return ("verify",)
        return (("draft",) if steps >= 1 else ()) + ("verify", "extend")

    def order(self) -> list[tuple[int, int]]:
        """Every ``(steps, bs)`` key to capture, largest batch first (then largest steps), so
        later, smaller graphs reuse the shared pool's blocks."""
        keys = [(s, bs) for s, sizes in self.sizes.items() for bs in sizes]
        return sorted(keys, key=lambda k: (-k[1], -k[0]))

    @property
    def num_graphs(self) -> int:
        return sum(len(self.passes(s)) for s, _ in self.order())

    def padded_bs(self, steps: int, batch_size: int) -> int | None:
        """Smallest captured size ``>= batch_size`` for ``steps``, None above (eager)."""
        sizes = sorted(self.sizes.get(steps, ()))
        i = bisect.bisect_left(sizes, batch_size)
        return sizes[i] if i < len(sizes) else None

    def to_dict(self) -> dict[str, Any]:
        return {"graph_bs": list(self.graph_bs), "pruned": self.pruned,
                "sizes": {str(s): list(v) for s, v in sorted(self.sizes.items())},
                "num_graphs": self.num_graphs}


# --------------------------------------------------------------------------- static buffers
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
      metadata: ``[max_bs, kv_capacity]`` slots).

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
    """The fixed-address inputs of every graph, shared by all runners of an engine.

    Sized by :func:`static_buffer_shapes` from ``max_bs`` and ``max_steps`` (the largest
    candidate steps, never the initial one) and the drafter's ``feature_size``; int64 on
    ``device`` except the feature buffers, which are ``dtype``. :meth:`check` validates a
    :class:`CapturePlan` against them.
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
    """Slots of positions ``0 .. lens[b] - 1`` of each request, request after request.

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


class TorchStaticAttention:
    """Fixed-shape metadata for :class:`TorchAttentionBackend` under CUDA graphs.

    One call site (verify, a draft step, extend) with ``n`` query tokens per request. Buffers
    on ``device``: ``kv_gather`` ``[max_bs, kv_capacity]`` int64 (slot of every key position;
    beyond a request's valid length its position-0 slot again, masked or seen by its padded
    queries only, so real rows never touch the pad slot, whose content may be anything;
    padded requests read only the pad slot), ``mask`` ``[max_bs, 1, n, kv_capacity]`` bool
    (key ``j`` visible to query ``i`` iff ``j < kv_len`` and ``j <= kv_len - n + i``),
    ``q_dst`` = ``arange(max_bs * n)``. :meth:`plan` fills the prefix of ``g`` requests in place
    and returns a :class:`TorchAttentionMetadata` of views (``max_kv_len = kv_capacity``), the
    same object for every call with that ``g``. In that metadata ``kv_indices`` is the flattened
    ``[g, kv_capacity]`` slot table and ``kv_indptr`` its row starts (unlike eager metadata).
    Cost: attention over ``kv_capacity`` keys per request, whatever the lengths.
    """

    def __init__(self, max_bs: int, qo_per_request: int, kv_capacity: int,
                 device: torch.device | str) -> None:
        if min(max_bs, qo_per_request, kv_capacity) < 1:
            raise ValueError("max_bs, qo_per_request and kv_capacity must be >= 1")
        dev = torch.device(device)
        self.max_bs, self.n, self.kv_capacity, self.device = max_bs, qo_per_request, kv_capacity, dev
        n, cap = qo_per_request, kv_capacity
        self.kv_gather = torch.zeros(max_bs, cap, dtype=I64, device=dev)
        self.mask = torch.zeros(max_bs, 1, n, cap, dtype=torch.bool, device=dev)
        self.kv_lens = torch.zeros(max_bs, dtype=I64, device=dev)
        self.qo_lens = torch.full((max_bs,), n, dtype=I64, device=dev)
        self.q_dst = torch.arange(max_bs * n, dtype=I64, device=dev)
        self.qo_indptr = torch.arange(0, (max_bs + 1) * n, n, dtype=I64, device=dev)
        self.kv_indptr = torch.arange(0, (max_bs + 1) * cap, cap, dtype=I64, device=dev)
        self._j = torch.arange(cap, dtype=I64, device=dev)
        self._i = torch.arange(n, dtype=I64, device=dev)
        self.metas: dict[int, TorchAttentionMetadata] = {}

    def plan(self, g: int, flat: torch.Tensor, flat_lens: np.ndarray, kv_lens: np.ndarray,
             valid_lens: np.ndarray, pad_slot: int) -> TorchAttentionMetadata:
        """Fill the metadata of ``g`` requests (host ``[g]`` arrays, see
        :func:`~specdial.attention.flashinfer_backend.expand_kv_indices`); no sync."""
        if not 1 <= g <= self.max_bs or len(kv_lens) != g:
            raise ValueError(f"static attention: batch {len(kv_lens)} padded to {g} "
                             f"(max {self.max_bs})")
        if int(np.max(kv_lens)) > self.kv_capacity:
            raise ValueError(f"a request has {int(np.max(kv_lens))} KV positions, over the "
                             f"static capacity {self.kv_capacity}")
        valid_lens = np.asarray(valid_lens, np.int64)
        idx, req, pos = expand_kv_indices(flat, flat_lens, valid_lens, valid_lens, pad_slot)
        gather = self.kv_gather[:g]
        gather.fill_(pad_slot)
        gather[req, pos] = idx
        host = torch.from_numpy(np.concatenate([np.asarray(kv_lens, np.int64), valid_lens]))
        kv_valid = host.to(self.device, non_blocking=True)
        kv = self.kv_lens[:g]
        kv.copy_(kv_valid[:g])
        # keys past the valid length repeat the request's first slot (pad slot if it has none)
        gather.copy_(torch.where(self._j[None, :] < kv_valid[g:, None], gather, gather[:, :1]))
        q_pos = (kv - self.n)[:, None] + self._i[None, :]  # [g, n]
        j = self._j[None, None, :]
        self.mask[:g, 0] = (j < kv[:, None, None]) & (j <= q_pos[:, :, None])
        meta = self.metas.get(g)
        if meta is None:
            meta = self.metas[g] = TorchAttentionMetadata(
                qo_lens=self.qo_lens[:g], kv_lens=kv, kv_indices=gather.view(-1),
                qo_indptr=self.qo_indptr[: g + 1], kv_indptr=self.kv_indptr[: g + 1],
                max_qo_len=self.n, max_kv_len=self.kv_capacity, q_dst=self.q_dst[: g * self.n],
                kv_gather=gather, mask=self.mask[:g])
        return meta


def make_static_attention(backend: AttentionBackend, max_bs: int, qo_per_request: int,
                          kv_capacity: int, device: torch.device | str):
    """Fixed-shape attention metadata for ``backend`` (torch: :class:`TorchStaticAttention`;
    a backend with ``make_static_attention``, e.g. flashinfer: its own). ``TypeError`` else."""
    if isinstance(backend, TorchAttentionBackend):
        return TorchStaticAttention(max_bs, qo_per_request, kv_capacity, device)
    make = getattr(backend, "make_static_attention", None)
    if make is None:
        raise TypeError(f"{type(backend).__name__} has no CUDA-graph metadata "
                        "(make_static_attention)")
    return make(max_bs, qo_per_request, kv_capacity)


# --------------------------------------------------------------------------- graph pool
class _Graph:
    """A captured pass: ``replay()`` returns its outputs (the same tensors every replay, except
    in eager mode, where the pass simply runs and returns fresh ones)."""

    def __init__(self, run: Callable[[], Any], output: Any = None, graph: Any = None, *,
                 eager: bool = False) -> None:
        self._run, self.output, self.graph, self.eager = run, output, graph, eager

    def replay(self) -> Any:
        result = self._run()
        return result if self.eager else self.output


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


class GraphPool:
    """What the runners of one engine share when capturing.

    ``mode``:

    - ``"cuda"``: real graphs (``torch.cuda.CUDAGraph``), all in one memory pool
      (``torch.cuda.graph_pool_handle()``) and captured on one side stream; each capture runs
      the pass ``warmup`` times on that stream first (lazy library initialisation, flashinfer
      head signatures).
    - ``"eager"``: no capture; a "replay" runs the pass eagerly over the same static buffers
      (padding included): CPU runs, ``disable_cuda_graph`` comparisons.
    - ``"emulate"``: CPU test double of ``"cuda"``: the pass runs once at capture, each replay
      re-runs it and copies its results into the captured output tensors, so callers see the
      fixed output tensors of a real graph.

    ``mode=None`` picks ``"cuda"`` on a CUDA device, ``"eager"`` otherwise. ``capture_seconds``
    and ``num_captured`` accumulate. Raises ``ValueError`` for ``"cuda"`` off a CUDA device.
    """

    def __init__(self, device: torch.device | str, mode: str | None = None, *,
                 warmup: int = 2) -> None:
        self.device = torch.device(device)
        if mode is None:
            mode = "cuda" if self.device.type == "cuda" else "eager"
        if mode not in ("cuda", "eager", "emulate"):
            raise ValueError(f"GraphPool mode must be 'cuda', 'eager' or 'emulate', got {mode!r}")
        if mode == "cuda" and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        self.mode, self.warmup = mode, warmup
        self.handle = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self.stream = torch.cuda.Stream(self.device) if mode == "cuda" else None
        self.capture_seconds = 0.0
        self.num_captured = 0

    @property
    def use_graphs(self) -> bool:
        return self.mode != "eager"

    def capture(self, body: Callable[[], Any]) -> _Graph:
        """Capture ``body`` (a pass reading only static buffers) per :attr:`mode`."""
        t0 = time.perf_counter()
        if self.mode == "eager":
            return _Graph(body, eager=True)
        if self.mode == "emulate":
            out = body()
            graph = _Graph(lambda: _copy_into(out, body()), out)
        else:
            stream = self.stream
            assert stream is not None
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(self.warmup):
                    body()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph, pool=self.handle, stream=stream):
                out = body()
            graph = _Graph(cuda_graph.replay, out, cuda_graph)
            torch.cuda.synchronize(self.device)
        self.capture_seconds += time.perf_counter() - t0
        self.num_captured += 1
        return graph


# --------------------------------------------------------------------------- runner
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


class CudaGraphRunner:
    """Draft, verify and draft-extend passes of one ``steps`` value, replayed from CUDA graphs.

    Arguments:

    - ``steps``: the runtime state's steps value ``k`` (``n = k + 1`` verify tokens/request).
    - ``target`` (a ``LlamaForCausalLM``) and ``target_kv`` (its :class:`KVPool`); ``drafter``
      (a :class:`~specdial.worker.drafters.Drafter` with its ``kv``) or None (plain decoding).
    - ``backend``: the attention backend (torch or flashinfer), ``buffers``
      (:class:`StaticBuffers`, shared), ``pool`` (:class:`GraphPool`, shared).
    - ``kv_capacity``: most KV positions of one request (context length + steps + 1); sizes
      the static attention metadata.
    - ``logits_in_graph``: the verify graph also computes ``target.compute_logits``.
    - ``dummy_token_id``: token of padded requests (any valid id).

    Capture with :meth:`capture` (or :func:`capture_all` for every runner, largest batch
    first); the pass methods then replay the graph of ``graph_bs`` (the Rust ``graph_key``'s
    padded size) or of the smallest captured size ``>= B``, padding the batch, and fall back to
    eager forwards with ``backend.plan`` metadata otherwise (counted in :attr:`stats`). With
    :attr:`enabled` False every pass runs that eager path (``disable_cuda_graph``). Inputs are
    device int64 tensors unless noted; ``start`` arrays are host int64 ``[B]``. The passes do
    host work (input copies, attention plans) but never sync. Shape mismatches raise
    ``ValueError``.
    """

    def __init__(self, steps: int, *, target, target_kv: KVPool, drafter=None,
                 backend: AttentionBackend, buffers: StaticBuffers, pool: GraphPool,
                 kv_capacity: int, logits_in_graph: bool = True,
                 dummy_token_id: int = 0) -> None:
        if steps < 0 or steps > buffers.max_steps:
            raise ValueError(f"steps {steps} outside the static buffers' 0..{buffers.max_steps}")
        if steps > 0 and drafter is None:
            raise ValueError("steps > 0 needs a drafter")
        if drafter is not None and steps > drafter.max_steps:
            raise ValueError(f"steps {steps} above the drafter's max_steps {drafter.max_steps}")
        self.steps, self.n = steps, steps + 1
        self.target, self.target_kv, self.drafter = target, target_kv, drafter
        self.backend, self.buffers, self.pool = backend, buffers, pool
        self.kv_capacity, self.logits_in_graph = kv_capacity, logits_in_graph
        self.dummy_token_id = dummy_token_id
        self.pad_slot = target_kv.pad_slot
        dev = buffers.device
        self.device = dev
        mb = buffers.max_bs
        self.verify_attn = make_static_attention(backend, mb, self.n, kv_capacity, dev)
        self.draft_attn = [make_static_attention(backend, mb, 1, kv_capacity, dev)
                           for _ in range(steps)]
        self.extend_attn = (make_static_attention(backend, mb, self.n, kv_capacity, dev)
                            if drafter is not None else None)
        self.needs_hidden = bool(drafter is not None and drafter.needs_target_hidden)
        # a one-layer drafter's KV-only extend never runs attention (the last layer only
        # writes K/V), so its extend needs no attention plan
        self.extend_uses_attention = drafter is not None and drafter.num_layers > 1
        self.graphs: dict[tuple[str, int], _Graph] = {}
        self.sizes: list[int] = []  # captured batch sizes, ascending
        self.stats = RunnerStats()
        #: False: every pass runs eagerly with dynamic metadata (``disable_cuda_graph``)
        self.enabled = True
        self._greedy: dict[int, BatchSampling] = {}

    # ------------------------------------------------------------------ sizes
    def passes(self) -> tuple[str, ...]:
        if self.drafter is None:
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
        if not 1 <= g <= self.buffers.max_bs:
            raise ValueError(f"graph batch size {g} outside 1..{self.buffers.max_bs} (the "
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

        def body():
            hidden, feats = run_target(self.target, self.drafter, batch, self.target_kv,
                                       self.backend)
            logits = self.target.compute_logits(hidden) if self.logits_in_graph else None
            return hidden, logits, feats
        return body

    def _draft_body(self, g: int) -> Callable[[], Any]:
        b, k = self.buffers, self.steps
        batches = [ForwardBatch(b.draft_input_ids[i, :g], b.draft_positions[i, :g],
                                b.draft_out_loc[i, :g], self._draft_metas[i]) for i in range(k)]
        first = b.draft_first_hidden[:g] if self.needs_hidden else None
        sampling = self._greedy_sampling(g)

        def body():
            tokens, _ = self.drafter.draft(k, batches, self.backend, first_hidden=first,
                                           sampling=sampling, generator=None)
            return tokens
        return body

    def _extend_body(self, g: int) -> Callable[[], Any]:
        b, m = self.buffers, g * self.n
        batch = ForwardBatch(b.extend_input_ids[:m], b.extend_positions[:m], b.extend_out_loc[:m],
                             self._extend_meta)
        hidden = b.extend_hidden[:m] if self.needs_hidden else None

        def body():
            self.drafter.extend(batch, self.backend, hidden_states=hidden, kv_only=True)
            return None
        return body

    # ------------------------------------------------------------------ input filling
    @staticmethod
    def _pad(a: np.ndarray, g: int, value: int) -> np.ndarray:
        out = np.full(g, value, np.int64)
        out[: len(a)] = a
        return out

    def _fill_verify(self, g, input_ids, positions, out_loc, kv: KVLayout, start) -> None:
        """Static verify inputs for ``b = len(start)`` real requests padded to ``g``."""
        buf, n, b = self.buffers, self.n, len(start)
        m, mb = g * n, b * n
        for dst, src, pad in ((buf.verify_input_ids, input_ids, self.dummy_token_id),
                              (buf.verify_positions, positions, 0),
                              (buf.verify_out_loc, out_loc, self.pad_slot)):
            if mb:
                dst[:mb].copy_(src.reshape(-1))
            dst[mb:m].fill_(pad)
        kv_lens = self._pad(start + n, g, n)
        valid = self._pad(np.minimum(kv.lens, start + n), g, 0)
        self._verify_meta = self.verify_attn.plan(
            g, kv.indices, self._pad(kv.lens, g, 0), kv_lens, valid, self.pad_slot)

    def _fill_draft(self, g, input_ids, positions, out_loc, kv: KVLayout, start,
                    first_hidden) -> None:
        buf, k, b = self.buffers, self.steps, len(start)
        ids, pos, loc = buf.draft_input_ids, buf.draft_positions, buf.draft_out_loc
        if b:
            ids[0, :b].copy_(input_ids)
            pos[:k, :b].copy_(positions)
            loc[:k, :b].copy_(out_loc)
        ids[:k, b:g].fill_(self.dummy_token_id)
        pos[:k, b:g].fill_(0)
        loc[:k, b:g].fill_(self.pad_slot)
        if self.needs_hidden:
            if b:
                buf.draft_first_hidden[:b].copy_(first_hidden)
            buf.draft_first_hidden[b:g].zero_()
        flat_lens = self._pad(kv.lens, g, 0)
        self._draft_metas = []
        for i, attn in enumerate(self.draft_attn):
            lens = start + 1 + i
            self._draft_metas.append(attn.plan(
                g, kv.indices, flat_lens, self._pad(lens, g, 1),
                self._pad(np.minimum(kv.lens, lens), g, 0), self.pad_slot))

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
                            (buf.extend_out_loc, out_loc, self.pad_slot)):
            t[:m].fill_(pad)
            if dst is not None:
                t[dst] = src
        if self.needs_hidden:
            buf.extend_hidden[:m].zero_()
            if dst is not None:
                buf.extend_hidden[dst] = hidden_states.to(buf.extend_hidden.dtype)
        if self.extend_attn is not None and plan:
            self._extend_meta = self.extend_attn.plan(
                g, kv.indices, self._pad(kv.lens, g, 0), self._pad(start + n, g, n),
                self._pad(start + counts, g, 0), self.pad_slot)

    # ------------------------------------------------------------------ passes
    @torch.inference_mode()
    def verify(self, input_ids: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor,
               kv: KVLayout, start: np.ndarray, graph_bs: int | None = None) -> VerifyOutput:
        """Target forward over ``B * n`` tokens (``[x_L, d_1..d_k]`` per request at positions
        ``start[b] .. start[b] + k``; ``out_loc`` their slots, the pad slot allowed).

        Keys of request ``b``: positions ``0 .. start[b] + k`` from ``kv`` (entries past
        ``kv.lens[b]`` read the pad slot, for requests verifying fewer than ``k`` drafts).
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
              processing: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``k`` draft forwards: ``input_ids`` ``[B]`` (``x_L``), ``positions`` / ``out_loc``
        ``[k, B]`` (``L + i`` and its slot), ``start`` = ``L``; step ``i`` attends to positions
        ``0 .. L + i``. ``first_hidden`` ``[B, H]``: EAGLE's ``h_{L-1}``. Greedy batches replay
        the graph; sampling batches (``sampling.all_greedy`` false) run eagerly, with
        ``sample_positions`` (``[B]``, draft 1's sequence index, for seeded rows) passed to
        :meth:`Drafter.draft`; so do batches with penalties or ``min_tokens`` (``processing``,
        a :class:`~specdial.worker.processors.StepProcessing`: the graph drafts unprocessed).
        Returns ``(tokens [B, k] int64, probs [B, k, V] or None)``."""
        if self.steps == 0 or self.drafter is None:
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
                                     sampling, generator, sample_positions, processing)
        self._fill_draft(g, input_ids, positions, out_loc, kv, start, first_hidden)
        tokens = self.graphs[("draft", g)].replay()
        self.stats.replays["draft"] += 1
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
        if self.drafter is None:
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
        idx, _, _ = expand_kv_indices(kv.indices, kv.lens, kv_lens, valid, self.pad_slot)
        return self.backend.plan(torch.from_numpy(qo), torch.from_numpy(kv_lens), idx)

    def _verify_eager(self, input_ids, positions, out_loc, kv, start) -> VerifyOutput:
        n, b = self.n, len(start)
        meta = self._plan_eager(kv, np.full(b, n, np.int64), start + n,
                                np.minimum(kv.lens, start + n))
        batch = ForwardBatch(input_ids.reshape(-1), positions.reshape(-1), out_loc.reshape(-1),
                             meta)
        hidden, feats = run_target(self.target, self.drafter, batch, self.target_kv,
                                   self.backend)
        logits = self.target.compute_logits(hidden) if self.logits_in_graph else None
        return VerifyOutput(hidden, logits, feats)

    def _draft_eager(self, input_ids, positions, out_loc, kv, start, first_hidden, sampling,
                     generator, sample_positions=None, processing=None):
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
        return self.drafter.draft(k, batches, self.backend, first_hidden=first_hidden,
                                  sampling=sampling, generator=generator,
                                  sample_positions=sample_positions, processing=processing)

    def _extend_eager(self, input_ids, positions, out_loc, kv, start, counts, hidden_states):
        keep = counts > 0
        if not keep.any():
            return
        if not keep.all():  # drop requests with nothing to extend (their tokens are absent)
            kv_keep = np.repeat(keep, kv.lens)
            kv = KVLayout(kv.indices[torch.from_numpy(kv_keep).to(self.device)], kv.lens[keep])
            start, counts = start[keep], counts[keep]
        meta = self._plan_eager(kv, counts, start + counts, start + counts)
        batch = ForwardBatch(input_ids, positions, out_loc, meta)
        self.drafter.extend(batch, self.backend, hidden_states=hidden_states, kv_only=True)


# --------------------------------------------------------------------------- orchestration
@dataclass
class CaptureReport:
    """What :func:`capture_all` did: graphs, wall seconds, device memory (CUDA; else 0)."""

    num_graphs: int
    seconds: float
    pool_reserved_bytes: int
    device_used_bytes: int
    plan: dict[str, Any]


def capture_all(runners: Mapping[int, CudaGraphRunner], plan: CapturePlan) -> CaptureReport:
    """Capture ``plan`` across the runners (one per steps value), largest batch first.

    Raises ``KeyError`` when the plan names a steps value without a runner and ``ValueError``
    (from :meth:`StaticBuffers.check`) when a graph does not fit the static buffers.
    """
    if not runners:
        raise ValueError("capture_all: no runners")
    first = next(iter(runners.values()))
    first.buffers.check(plan)
    missing = [s for s, sizes in plan.sizes.items() if sizes and s not in runners]
    if missing:
        raise KeyError(f"capture plan has steps {missing} without a runner")
    dev = first.device
    cuda = first.pool.mode == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
        free0, reserved0 = torch.cuda.mem_get_info(dev)[0], torch.cuda.memory_reserved(dev)
    t0 = time.perf_counter()
    before = first.pool.num_captured
    for steps, bs in plan.order():
        runners[steps].capture_one(bs)
    if cuda:
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    pool_bytes = used = 0
    if cuda:
        pool_bytes = torch.cuda.memory_reserved(dev) - reserved0
        used = free0 - torch.cuda.mem_get_info(dev)[0]
    return CaptureReport(first.pool.num_captured - before, seconds, pool_bytes, used,
                         plan.to_dict())


def build_runners(plan: CapturePlan, *, target, target_kv: KVPool, drafter, backend,
                  pool: GraphPool, kv_capacity: int, logits_in_graph: bool = True,
                  dummy_token_id: int = 0) -> dict[int, CudaGraphRunner]:
    """One :class:`CudaGraphRunner` per steps value of ``plan`` over one shared
    :class:`StaticBuffers` sized from ``plan.max_steps`` and ``plan.max_bs`` (not captured yet:
    call :func:`capture_all`)."""
    w = target.embed_tokens.weight
    buffers = StaticBuffers(max_bs=plan.max_bs, max_steps=plan.max_steps,
                            hidden_size=target.config.hidden_size,
                            vocab_size=target.config.vocab_size, kv_capacity=kv_capacity,
                            dtype=w.dtype, device=w.device,
                            feature_size=None if drafter is None else drafter.feature_size)
    return {s: CudaGraphRunner(s, target=target, target_kv=target_kv, drafter=drafter,
                               backend=backend, buffers=buffers, pool=pool,
                               kv_capacity=kv_capacity, logits_in_graph=logits_in_graph,
                               dummy_token_id=dummy_token_id)
            for s in sorted(plan.sizes)}
