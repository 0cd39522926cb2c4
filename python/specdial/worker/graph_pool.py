"""One memory pool and one capture stream for every CUDA graph of an engine; capture orchestration.

- :class:`GraphPool`: one memory pool (``torch.cuda.graph_pool_handle()``) and one capture stream
  for all graphs (a fresh stream per capture partitions the pool's segments by stream; SGLang
  #35275), or the eager / emulated modes used on the CPU.
- :func:`capture_all`: capture a :class:`~specdial.worker.graph_tables.CapturePlan` across the
  step runners (one per steps value), largest batch first, and report time and memory.

Outputs of a replay are graph-pool tensors: valid until the next replay of any graph of the
same :class:`GraphPool` (consume or copy them first), as in SGLang's runners.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import torch

from specdial.worker.graph_tables import CapturePlan


class CapturedGraph:
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

    def capture(self, body: Callable[[], Any]) -> CapturedGraph:
        """Capture ``body`` (a pass reading only static buffers) per :attr:`mode`."""
        t0 = time.perf_counter()
        if self.mode == "eager":
            return CapturedGraph(body, eager=True)
        if self.mode == "emulate":
            out = body()
            graph = CapturedGraph(lambda: _copy_into(out, body()), out)
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
            graph = CapturedGraph(cuda_graph.replay, out, cuda_graph)
            torch.cuda.synchronize(self.device)
        self.capture_seconds += time.perf_counter() - t0
        self.num_captured += 1
        return graph


class Capturable(Protocol):
    """What :func:`capture_all` needs of a runner (a
    :class:`~specdial.worker.step_runner.StepRunner`): its buffers (``check(plan)``), device,
    pool, and ``capture_one(batch_size)``."""

    buffers: Any
    device: torch.device
    pool: Any

    def capture_one(self, g: int) -> None: ...


@dataclass
class CaptureReport:
    """What :func:`capture_all` did: graphs, wall seconds, device memory (CUDA; else 0)."""

    num_graphs: int
    seconds: float
    pool_reserved_bytes: int
    device_used_bytes: int
    plan: dict[str, Any]


def capture_all(runners: Mapping[int, Capturable], plan: CapturePlan) -> CaptureReport:
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
