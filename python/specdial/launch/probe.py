"""Collective probes: what one all-reduce costs on this transport, and how a rank failure shows.

:func:`collective_probe` is a worker-rank entry (see :mod:`specdial.launch.rank`) that
all-reduces a ``[numel]`` float32 tensor ``iters`` times and, on rank 0, writes a JSON report:
``{"ok": true, "seconds_per_call": s, "calls": n}`` or, when a peer died or hung,
``{"ok": false, "error": message, "elapsed_s": s}`` (then the rank exits with status 2). It
first writes ``ready`` files so a caller can stop a rank mid-loop (the fault tests do).
:func:`startup_probe` does the same for a rank's start-up (heartbeat and start-up barrier).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from specdial.distributed.group import DistConfig, RankFailure, TensorParallel
from specdial.distributed.liveness import Heartbeat, startup_barrier


def collective_probe(tp: TensorParallel, config: DistConfig, out_dir: str, iters: int = 100,
                     numel: int = 1024, pause_s: float = 0.0) -> None:
    """All-reduce ``iters`` times (``pause_s`` seconds apart); see the module docstring.

    Every rank touches ``out_dir/ready.<rank>`` once the group has formed; rank 0 writes
    ``out_dir/report.json``. Raises :class:`RankFailure` (after writing the report) when a
    peer fails.
    """
    out = Path(out_dir)
    t = torch.ones(numel)
    tp.all_reduce(t)  # everyone is here
    (out / f"ready.{tp.rank}").touch()
    started = time.monotonic()
    calls = 0
    try:
        for _ in range(iters):
            t.fill_(1.0)
            tp.all_reduce(t)
            calls += 1
            if pause_s:
                time.sleep(pause_s)
    except RankFailure as e:
        if tp.rank == 0:
            (out / "report.json").write_text(json.dumps(
                {"ok": False, "error": str(e), "elapsed_s": time.monotonic() - started,
                 "calls": calls}))
        raise
    elapsed = time.monotonic() - started
    if tp.rank == 0:
        if float(t[0]) != tp.size:
            raise RuntimeError(f"all_reduce of ones gave {float(t[0])}, expected {tp.size}")
        (out / "report.json").write_text(json.dumps(
            {"ok": True, "seconds_per_call": elapsed / max(calls, 1), "calls": calls}))


def startup_probe(tp: TensorParallel, config: DistConfig, out_dir: str,
                  load_s: float = 0.0) -> None:
    """A rank's start-up as the engine's ranks run it (:mod:`specdial.distributed.liveness`):
    start the heartbeat, touch ``out_dir/ready.<rank>``, "load" for ``load_s`` seconds (worker
    ranks; rank 0 goes straight on) and wait at the start-up barrier ``"loaded"``. Rank 0
    passes no process handles (its peers stand for ranks on another node), writes
    ``out_dir/report.json`` (``{"ok": true, "elapsed_s": s}`` or ``{"ok": false, "error":
    message, "elapsed_s": s}``) and raises :class:`RankFailure` (exit status 2) on a failure.
    """
    liveness = Heartbeat(tp).start()
    out = Path(out_dir)
    (out / f"ready.{tp.rank}").touch()
    started = time.monotonic()
    try:
        if tp.rank != 0:
            time.sleep(load_s)
        startup_barrier(tp, "loaded", liveness=liveness)
    except RankFailure as e:
        if tp.rank == 0:
            (out / "report.json").write_text(json.dumps(
                {"ok": False, "error": str(e), "elapsed_s": time.monotonic() - started}))
        raise
    finally:
        liveness.stop()
    if tp.rank == 0:
        (out / "report.json").write_text(json.dumps(
            {"ok": True, "elapsed_s": time.monotonic() - started}))


def idle(tp: TensorParallel, config: DistConfig, seconds: float = 60.0) -> None:
    """Join the group and sleep (a rank whose parent the tests kill)."""
    time.sleep(seconds)


def channel_probe(tp: TensorParallel, config: DistConfig, out_dir: str, steps: int = 5,
                  diverge_at: int | None = None) -> None:
    """Rank 0 leads ``steps`` iterations through :mod:`specdial.distributed.channel` (idle
    heartbeats between them); every rank computes ``payload * ones(4)`` per step and checks
    the ranks agree; ``diverge_at``: rank 1 adds 1 at that step. Rank 0 writes
    ``out_dir/report.json`` ``{"steps": n}`` or ``{"error": "RankDivergence: ..."}``."""
    from specdial.distributed.channel import Leader, follow
    from specdial.distributed.group import RankDivergence

    def run(payload: int) -> None:
        value = payload + (1 if tp.rank == 1 and payload == diverge_at else 0)
        tp.check_same(torch.full((4,), value), f"step {payload}")

    report = Path(out_dir) / "report.json"
    try:
        if tp.rank == 0:
            leader = Leader(tp)
            for i in range(steps):
                leader.step(i)
                run(i)
                leader.heartbeat()
            leader.shutdown()
            report.write_text(json.dumps({"steps": steps}))
        else:
            follow(tp, run)
    except RankDivergence as e:
        if tp.rank == 0:
            report.write_text(json.dumps({"error": f"RankDivergence: {e}"}))


def forward_probe(tp: TensorParallel, config: DistConfig, model_path: str, out_dir: str,
                  batch_size: int = 1, tokens_per_request: int = 4, context: int = 256,
                  iters: int = 30, warmup: int = 5) -> None:
    """Time the target's forward over a decode-shaped batch on this group.

    ``batch_size`` requests, each with ``context`` tokens in the KV cache and
    ``tokens_per_request`` new ones (a verify at ``steps = tokens_per_request - 1``); logits
    for every new token. Rank 0 writes ``out_dir/forward.json``: ``ms_per_forward`` (median),
    ``collective_ms_per_forward`` (mean time inside all-reduce / all-gather, from the
    :class:`~specdial.distributed.group.CollectiveTimer`), ``collectives_per_forward``,
    ``tp_size`` and ``threads``.
    """
    from specdial.attention.torch_backend import TorchAttentionBackend
    from specdial.models.batch import ForwardBatch
    from specdial.models.loader import load_model

    target = load_model(model_path, tp=tp)
    b, q = batch_size, tokens_per_request
    kv = target.make_kv_pool(b * context + 1)
    backend = TorchAttentionBackend()
    vocab = target.config.vocab_size
    ids = torch.randint(0, vocab, (b * q,), generator=torch.Generator().manual_seed(0))
    pos = (torch.arange(context - q, context)[None, :].expand(b, q)).reshape(-1)
    slots = torch.arange(b * context).view(b, context)
    loc = slots[:, context - q:].reshape(-1)
    attn = backend.plan(torch.full((b,), q), torch.full((b,), context), slots.reshape(-1))
    batch = ForwardBatch(ids, pos, loc, attn)
    times = []
    with torch.no_grad():
        for i in range(warmup + iters):
            tp.timer.enabled = False
            tp.all_reduce(torch.zeros(1))  # line the ranks up: time the forward, not the wait
            tp.timer.enabled = i >= warmup
            t0 = time.perf_counter()
            target.compute_logits(target(batch, kv, backend))
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    tp.timer.enabled = False
    calls = tp.timer.calls
    if tp.rank == 0:
        times.sort()
        (Path(out_dir) / "forward.json").write_text(json.dumps({
            "tp_size": tp.size, "threads": torch.get_num_threads(), "batch_size": b,
            "tokens_per_request": q, "context": context,
            "ms_per_forward": 1e3 * times[len(times) // 2],
            "collective_ms_per_forward": 1e3 * tp.timer.seconds / iters,
            "collectives_per_forward": calls / iters}))


class _Accumulator:
    """A stateful stand-in for a worker: ``add(x)`` returns the running total as a tensor."""

    def __init__(self, rank: int, skew_at: int | None) -> None:
        self.total, self.calls, self.rank, self.skew_at = 0, 0, rank, skew_at

    def add(self, x: int, scale: int = 1) -> torch.Tensor:
        self.calls += 1
        x *= scale
        self.total += x + (1 if self.rank == 1 and self.calls == self.skew_at else 0)
        return torch.tensor([self.total])

    def reset(self) -> None:
        self.total = 0


def mirror_probe(tp: TensorParallel, config: DistConfig, out_dir: str, values: list[int],
                 skew_at: int | None = None) -> None:
    """Rank 0 drives an accumulator through :class:`~specdial.distributed.mirror.Mirrored`
    (``add`` checked across ranks, ``reset`` not); worker ranks :func:`replay`. ``skew_at``:
    rank 1 adds 1 at that call. Rank 0 writes ``out_dir/report.json``: ``{"totals": [...]}``
    or ``{"error", "after", "failure"}`` (what a call does once the group has failed)."""
    from specdial.distributed.channel import Leader
    from specdial.distributed.group import RankDivergence
    from specdial.distributed.mirror import Mirrored, replay
    m: Mirrored | None = None

    acc = _Accumulator(tp.rank, skew_at)
    methods, check = ("add", "reset"), {"add": lambda t: t}
    report = Path(out_dir) / "report.json"
    try:
        if tp.rank == 0:
            leader = Leader(tp)
            # the wire form doubles x and sends scale 1 where the local call scales by 2:
            # both sides add 2x (a stand-in for a local-only argument filled in remotely)
            m = Mirrored(acc, leader, methods, check,
                         wire=lambda name, a, kw: ((2 * a[0],) if name == "add" else a, {}),
                         local_after_failure=("reset",))
            totals = []
            for v in values:
                totals.append(int(m.add(v, scale=2)))
            m.reset()
            totals.append(int(m.add(0, scale=2)))
            assert m.calls == len(values) + 1  # read locally, not mirrored
            leader.shutdown()
            report.write_text(json.dumps({"totals": totals}))
        else:
            replay(tp, acc, methods, check)
    except RankDivergence as e:
        if tp.rank == 0:
            assert m is not None
            m.reset()  # local only once failed: no collective, no hang
            try:
                m.add(1)
                after = "no error"
            except RankFailure as again:
                after = f"RankFailure: {again}"
            report.write_text(json.dumps({"error": f"RankDivergence: {e}", "after": after,
                                          "failure": m.failure}))
