"""The one-command GPU check of issue 7: CUDA-graph parity, per-iteration time, step-0 overhead,
capture cost with and without pruning.

Usage (repository root, one H200; well under 10 minutes without flashinfer JIT builds)::

    python3 -m pip install specdial-*.whl flashinfer-python   # flashinfer is optional
    PYTHONPATH=python python3 benches/gpu_check.py --out "$OUT"
    python benches/gpu_check.py --cpu-smoke                    # same logic, tiny, no GPU

Needs torch with CUDA, numpy and the compiled ``specdial._core`` (the project wheel, or the
working tree with its ``python/specdial/_core.abi3.so``: an abi3 module, so a build for
CPython 3.11 also loads on 3.12). Without ``flashinfer`` the torch attention backend is used
everywhere and the JSON says so. ``flashinfer-python`` JIT-compiles its kernels with nvcc at
first use unless its prebuilt cubins are installed, which can take minutes: pass
``--backend torch`` to keep a run short, and run flashinfer's timing as a second call.
``--budget-s`` (default 480) skips the remaining timing cells and sections once spent.

The models are random: a target of Llama-3-8B width (hidden 4096, 32 heads, 8 KV heads, head
dim 128, MLP 14336, vocab 128256) with 4 layers and an EAGLE head of the same width (accepts
almost nothing), plus, for parity only, a 1-layer target of that width with an EAGLE head that
copies it up to a small perturbation (accepts part of the drafts, so draft extends of every
length run).

What it checks and measures (each section is recorded in ``gpu_check.json``):

Everything runs the serving code: the sections drive :class:`SpecWorker` (its step runners,
CUDA graphs, acceptance, draft extends) through :class:`WorkerDriver`, which builds the worker's
inputs by hand instead of a scheduler so each iteration's steps come from a schedule, or the
engine itself (``engine_parity``).

1. ``parity``: greedy decoding in float32 (torch attention backend; padding changes GEMM shapes
   so bfloat16 may legitimately differ) through a worker with graphs against a worker
   without (eager passes, what ``disable_cuda_graph`` serves), for fixed steps 0,
   1, 3, 7, an adaptive run (the Rust policy with the default config, graph keys from
   ``decide``) and a forced switching schedule; the batch shrinks as requests finish, so padded
   replays of several sizes happen; both model sets. Every run must also equal target-only
   greedy decoding, and the graph side must have replayed graphs.
   ``engine_parity``: the same through ``Engine.from_modules(..., cuda_graph_bs=...,
   disable_cuda_graph=...)`` (``cuda_graph_mode`` = the section's graph mode, so the CPU smoke
   run emulates graphs); the graph side must have replayed graphs (``Engine.graph_stats``).
2. ``timing``: per ``SpecWorker.decode`` (inputs, draft + verify + greedy accept with its
   one host sync + draft extend), median of CUDA-event times over ``--iters`` iterations, for
   steps 0, 1, 3, 5, 7 at batch sizes 1, 8, 32, 64, 128 with graphs and eagerly, plus plain decoding (target
   only) and steps 0 with the drafter extend skipped; bfloat16, context ``--context`` tokens.
3. ``step0``: steps 0 warm (drafter extend kept) and skipped, as ratios to plain decoding.
4. ``capture``: capture seconds, graph count and device memory for the default adaptive config
   and ``default_cuda_graph_bs(128)``, pruned vs unpruned.

A short table is printed last (also ``table.md``); exit status 1 when a parity check fails.
``--cpu-smoke`` runs every section with tiny shapes on the CPU, graphs emulated
(``GraphPool(mode="emulate")``), timings by wall clock; tests/test_gpu_script.py runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
try:
    import specdial  # noqa: F401
except ImportError:  # running from a working tree without an installed wheel
    sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402

from specdial._core import AdaptiveConfig, AdaptiveSpeculativeParams  # noqa: E402
from specdial.attention.select import backend_name, flashinfer_available, select_backend  # noqa: E402
from specdial.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from specdial.models import EagleHead, LlamaForCausalLM  # noqa: E402
from specdial.models.config import ModelConfig  # noqa: E402
from specdial.models.eagle import EAGLE_ARCHITECTURE  # noqa: E402
from specdial.worker.drafters import make_drafter  # noqa: E402
from specdial.worker.graph_tables import CapturePlan, default_cuda_graph_bs  # noqa: E402
from specdial.worker.inputs import DecodeInput, PrefillInput  # noqa: E402
from specdial.worker.sampling import BatchSampling, SamplingParams  # noqa: E402
from specdial.worker.worker import SpecWorker  # noqa: E402


# --------------------------------------------------------------------------- shapes
@dataclasses.dataclass
class Shapes:
    """Everything that differs between the GPU run and the CPU smoke run."""

    model: ModelConfig
    device: str
    timing_dtype: torch.dtype
    parity_steps: tuple[int, ...]
    parity_prompts: int
    parity_new_tokens: tuple[int, ...]
    parity_graph_bs: tuple[int, ...]
    timing_steps: tuple[int, ...]
    timing_bs: tuple[int, ...]
    context: int
    capture_max_bs: int
    graph_mode: str  # GraphPool mode of the "with graphs" side
    accept_noise: float  # fc perturbation of the accepting EAGLE head (partial acceptance)


def _ints(text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    return default if not text else tuple(int(x) for x in text.split(","))


def gpu_shapes(args) -> Shapes:
    """Llama-3-8B's layer shapes (random weights), ``--layers`` deep (default 4: the parity
    sections; the cost surface of issue 18 asks for 32 where memory and time allow)."""
    cfg = ModelConfig("LlamaForCausalLM", hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=args.layers or 4, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5,
                      rope_theta=500000.0, max_position_embeddings=max(8192, 2 * (args.context
                                                                                   or 0)))
    return Shapes(cfg, "cuda", torch.bfloat16, (0, 1, 3, 7), 6, (40, 34, 28, 20, 12, 6),
                  (1, 2, 4, 8), _ints(args.timing_steps, (0, 1, 3, 5, 7)),
                  _ints(args.timing_bs, (1, 8, 32, 64, 128)), args.context or 512, 128,
                  "cuda", 0.05)


def smoke_shapes(args) -> Shapes:
    cfg = ModelConfig("LlamaForCausalLM", hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, vocab_size=256, max_position_embeddings=512)
    return Shapes(cfg, "cpu", torch.float32, (0, 1, 3, 7), 5, (24, 18, 12, 8, 4), (1, 2, 4),
                  (0, 1, 3), (1, 4), args.context or 24, 8, "emulate", 0.1)


def build_models(cfg: ModelConfig, dtype: torch.dtype, device: str, seed: int = 0):
    """Random target and EAGLE head, initialised directly on ``device`` (fast on a GPU)."""
    torch.manual_seed(seed)
    with torch.device(device):
        target = LlamaForCausalLM(cfg)
        head_cfg = dataclasses.replace(cfg, architecture=EAGLE_ARCHITECTURE, num_hidden_layers=1)
        head = EagleHead(head_cfg, target.embed_tokens, target.lm_head)
    target = target.to(device=device, dtype=dtype).eval()
    head = head.to(device=device, dtype=dtype).eval()
    return target, head


def build_accepting(cfg: ModelConfig, dtype: torch.dtype, device: str, noise: float,
                    seed: int = 0):
    """A 1-layer target (final norm weight 1) and an EAGLE head copying its layer, ``fc`` =
    ``[I + noise * N(0, 1/H), 0]``: with ``noise = 0`` the head predicts the target's greedy
    token exactly (RMSNorm only rescales; the head's KV equals the target's layer-0 KV), a small
    ``noise`` gives partial acceptance, so draft extends of every length run."""
    torch.manual_seed(seed)
    cfg1 = dataclasses.replace(cfg, num_hidden_layers=1)
    h = cfg.hidden_size
    with torch.device(device):
        target = LlamaForCausalLM(cfg1)
        head = EagleHead(dataclasses.replace(cfg1, architecture=EAGLE_ARCHITECTURE),
                         target.embed_tokens, target.lm_head)
        with torch.no_grad():
            target.norm.weight.fill_(1.0)
            fc = torch.eye(h) + noise * torch.randn(h, h) / h ** 0.5
            head.fc.weight.copy_(torch.cat([fc, torch.zeros(h, h)], 1))
            head.fc.bias.zero_()
            head.layers[0].load_state_dict(target.layers[0].state_dict())
    return target.to(dtype=dtype).eval(), head.to(dtype=dtype).eval()


# --------------------------------------------------------------------------- the worker driver
def greedy(batch_size: int, device) -> BatchSampling:
    return BatchSampling.from_params([SamplingParams()] * batch_size, device)


class WorkerDriver:
    """Greedy decoding through the serving worker (:class:`SpecWorker` ``prefill`` / ``decode``:
    its step runners, CUDA graphs, acceptance and draft extends), with inputs built by hand
    instead of a scheduler so that the steps of every iteration come from a schedule (fixed,
    cycling, or the Rust policy's ``decide``).

    Row ``r`` owns slots ``r * cap .. r * cap + cap - 1`` (slot = base + position). ``graph_bs``
    None builds an eager worker (what ``disable_cuda_graph`` serves); else the worker captures
    every steps value's graphs (``mode``: the :class:`GraphPool` mode; ``adaptive_config``
    prunes the plan).
    """

    def __init__(self, target, head, backend, *, max_requests: int, cap: int, steps,
                 graph_bs=None, mode: str | None = None, adaptive_config=None,
                 skip_zero_extend: bool = False) -> None:
        steps = sorted(set(steps))
        drafter = (None if head is None
                   else make_drafter(head, target, max_steps=max(max(steps), 1)))
        self.worker = SpecWorker(
            target, drafter, max_requests * cap, max_running_requests=max_requests,
            context_length=cap, step_values=steps, backend=backend, cuda_graph_bs=graph_bs, cuda_graph_mode=mode,
            adaptive_config=adaptive_config)
        self.cap, self.device = cap, self.worker.device
        self.skip_zero = skip_zero_extend  # plans mark skip_extend as the scheduler would
        self.last = np.zeros(max_requests, np.int64)  # x_L of every row
        self.lens = np.zeros(max_requests, np.int64)  # L of every row (the driver's plans)
        self.outputs: list[list[int]] = []
        self._greedy: dict[int, BatchSampling] = {}

    def sampling(self, b: int) -> BatchSampling:
        s = self._greedy.get(b)
        if s is None:
            s = self._greedy[b] = greedy(b, self.device)
        return s

    def decode_input(self, rows: np.ndarray, steps: int, graph_bs: int | None) -> DecodeInput:
        """The plan a scheduler would give ``rows`` at their current lengths."""
        L, n = self.lens[rows], steps + 1
        if int(L.max()) + n > self.cap:
            raise ValueError("request outgrew its slot range; raise cap")
        loc = (rows * self.cap + L)[:, None] + np.arange(n)[None, :]
        return DecodeInput(steps, graph_bs, rows, self.last[rows].copy(), L.copy(),
                           loc.reshape(-1), np.full(len(rows), steps, np.int64),
                           skip_extend=np.full(len(rows), int(self.skip_zero and steps == 0),
                                               np.int64))

    def prefill(self, prompts: list[list[int]]) -> None:
        """One prefill of rows ``0..len(prompts)-1``, first tokens sampled."""
        rows = np.arange(len(prompts), dtype=np.int64)
        lens = np.array([len(p) for p in prompts], np.int64)
        pos = np.concatenate([np.arange(n) for n in lens])
        inp = PrefillInput(rows, np.concatenate([np.asarray(p, np.int64) for p in prompts]),
                           np.repeat(rows * self.cap, lens) + pos, lens, lens,
                           np.ones(len(rows), np.int64), np.cumsum(lens) - 1)
        out = self.worker.prefill(inp, self.sampling(len(rows)), None)
        self.outputs = [[int(t)] for t in out.tokens]
        self.last[rows] = out.tokens
        self.lens[rows] = lens

    def step(self, rows: np.ndarray, steps: int, graph_bs: int | None = None) -> np.ndarray:
        """One decode iteration of ``rows``; returns the accepted drafts ``[B]``."""
        out = self.worker.decode(self.decode_input(rows, steps, graph_bs),
                                 self.sampling(len(rows)), None)
        for b, r in enumerate(rows.tolist()):
            toks = out.tokens_of(b)
            self.outputs[r].extend(toks.tolist())
            self.last[r] = toks[-1]
        self.lens[rows] += out.accepted + 1
        return out.accepted

    def generate(self, prompts, new_tokens, schedule) -> tuple[list[list[int]], dict]:
        """Decode until every request has its ``new_tokens``; ``schedule(i, bs)`` gives
        ``(steps, graph_bs)`` (an ``on_verify`` attribute, if any, gets the acceptance)."""
        self.prefill(prompts)
        target_n = np.asarray(new_tokens, np.int64)
        hist: dict[int, int] = {}
        it = verifies = emitted = 0
        while True:
            produced = np.array([len(o) for o in self.outputs])
            rows = np.nonzero(produced < target_n)[0].astype(np.int64)
            if not len(rows):
                break
            steps, graph_bs = schedule(it, len(rows))
            acc = self.step(rows, steps, graph_bs)
            feedback = getattr(schedule, "on_verify", None)
            if feedback is not None:
                feedback(acc, len(rows))
            hist[steps] = hist.get(steps, 0) + 1
            it += 1
            verifies += len(rows)
            emitted += int(acc.sum()) + len(rows)
        out = [o[:n] for o, n in zip(self.outputs, target_n.tolist())]
        return out, {"iterations": it, "steps_histogram": dict(sorted(hist.items())),
                     "accept_length": round(emitted / max(verifies, 1), 3)}

    def graph_counters(self) -> tuple[dict, dict]:
        """Replays and eager fallbacks per steps value."""
        runners = self.worker.graph_runners
        return ({s: dict(r.stats.replays) for s, r in runners.items()},
                {s: dict(r.stats.eager) for s, r in runners.items()})


class AdaptiveSchedule:
    """Steps and graph key from the Rust policy (``decide``), fed back with ``on_verify``."""

    def __init__(self, graph_bs) -> None:
        self.params = AdaptiveSpeculativeParams(3, AdaptiveConfig.default())
        self.params.set_cuda_graph_bs(list(graph_bs))
        self.switches = 0
        self.last: int | None = None

    def __call__(self, it: int, bs: int):
        d = self.params.decide(bs)
        if self.last is not None and d.steps != self.last:
            self.switches += 1
        self.last = d.steps
        return d.steps, d.graph_bs

    def on_verify(self, acc: np.ndarray, bs: int) -> None:
        self.params.on_verify_complete(np.ascontiguousarray(acc, np.int64),  # type: ignore[arg-type]
                                       bs)  # numpy: a buffer


def fixed(steps: int):
    return lambda it, bs: (steps, None)


def cycle(schedule: list[int]):
    return lambda it, bs: (schedule[it % len(schedule)], None)


# --------------------------------------------------------------------------- sections
def section_parity(sh: Shapes, log) -> dict:
    """Float32 greedy decoding, graphs vs eager vs target-only, fixed/adaptive/switching, with
    a random EAGLE head (nothing accepted) and an accepting one (partial acceptance)."""
    results: dict[str, Any] = {"new_tokens": list(sh.parity_new_tokens[:sh.parity_prompts]),
                               "graph_bs": list(sh.parity_graph_bs)}
    config = AdaptiveConfig.default()
    sched = [3, 0, 7, 1, 0, 0, 5, 3, 7, 0, 1]
    sets: dict[str, Any] = {
        "random": (lambda: build_models(sh.model, torch.float32, sh.device, seed=1),
                   [(f"steps={s}", s, False) for s in sh.parity_steps]
                   + [("adaptive", "adaptive", False), ("switching", sched, False)]),
        "accepting": (lambda: build_accepting(sh.model, torch.float32, sh.device,
                                              sh.accept_noise, seed=4),
                      [(f"steps={s}", s, False) for s in sh.parity_steps if s]
                      + [("adaptive", "adaptive", False), ("switching-skip0", sched, True)]),
    }
    ok_all = True
    for set_name, (build, runs) in sets.items():
        target, head = build()
        backend = TorchAttentionBackend(sh.device)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, sh.model.vocab_size, size=int(rng.integers(8, 40))).tolist()
                   for _ in range(sh.parity_prompts)]
        new_tokens = list(sh.parity_new_tokens[:sh.parity_prompts])
        cap = max(len(p) for p in prompts) + max(new_tokens) + 16
        # target-only greedy reference (eager worker, no drafter)
        ref, _ = WorkerDriver(target, None, backend, max_requests=len(prompts), cap=cap,
                              steps=[0]).generate(prompts, new_tokens, fixed(0))
        for name, what, skip in runs:
            t0 = time.perf_counter()
            if what == "adaptive":
                steps, adaptive = config.candidate_steps, config
            else:
                steps, adaptive = (what if isinstance(what, list) else [what]), None
            outs, infos, drivers = {}, {}, {}
            for label, graph_bs in (("graphs", sh.parity_graph_bs), ("eager", None)):
                if what == "adaptive":
                    schedule = AdaptiveSchedule(sh.parity_graph_bs)
                elif isinstance(what, list):
                    schedule = cycle(what)
                else:
                    schedule = fixed(what)
                drivers[label] = dec = WorkerDriver(
                    target, head, backend, max_requests=len(prompts), cap=cap, steps=steps,
                    graph_bs=graph_bs, mode=sh.graph_mode, adaptive_config=adaptive,
                    skip_zero_extend=skip)
                outs[label], infos[label] = dec.generate(prompts, new_tokens, schedule)
                if isinstance(schedule, AdaptiveSchedule):
                    infos[label]["switches"] = schedule.switches
            report = drivers["graphs"].worker.capture_report
            assert report is not None
            replays, fallbacks = drivers["graphs"].graph_counters()
            same = outs["graphs"] == outs["eager"]
            lossless = outs["graphs"] == ref
            n_replays = sum(sum(v.values()) for v in replays.values())
            ok = same and lossless and (sh.graph_mode == "eager" or n_replays > 0)
            ok_all &= ok
            first_diff = None
            if not same:
                first_diff = next(i for i, (a, b) in enumerate(zip(outs["graphs"], outs["eager"]))
                                  if a != b)
            key = f"{set_name} {name}"
            results[key] = {
                "status": "PASS" if ok else "FAIL", "graphs_equal_eager": same,
                "equal_target_only": lossless, "first_differing_request": first_diff,
                "tokens": sum(len(o) for o in outs["graphs"]),
                "accept_length": infos["graphs"]["accept_length"],
                "graphs_captured": report.num_graphs, "replays": replays,
                "eager_fallbacks": fallbacks, "decode": infos,
                "seconds": round(time.perf_counter() - t0, 2)}
            log(f"parity {key}: {results[key]['status']} ({results[key]['tokens']} tokens, "
                f"{n_replays} replays, steps {infos['graphs']['steps_histogram']}, "
                f"{results[key]['seconds']} s)")
            del drivers
            gc.collect()
        del target, head
        free_memory(sh.device)
    results["status"] = "PASS" if ok_all else "FAIL"
    return results


def section_engine_parity(sh: Shapes, log) -> dict:
    """Greedy outputs of Engine.generate with graphs vs disable_cuda_graph (needs the wiring),
    and their logprobs (issue 13: computed from the verify logits, copied to the host on the
    step's sync): equal within 1e-3 between the two, finite, top-1 >= the chosen token's."""
    from specdial.engine import Engine
    target, head = build_models(sh.model, torch.float32, sh.device, seed=1)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, sh.model.vocab_size, size=int(rng.integers(8, 40))).tolist()
               for _ in range(sh.parity_prompts)]
    sp = [{"temperature": 0.0, "max_new_tokens": n}
          for n in sh.parity_new_tokens[:sh.parity_prompts]]
    kw: dict[str, Any] = dict(max_running_requests=max(sh.parity_graph_bs), kv_cache_tokens=4096,
              page_size=16,
              drafter_max_steps=7, cuda_graph_bs=list(sh.parity_graph_bs))
    results: dict[str, Any] = {}
    cases: list[tuple[str, dict[str, Any]]] = [(f"steps={s}", dict(speculative_adaptive=False, speculative_num_steps=s))
             for s in sh.parity_steps] + [("adaptive", {})]
    ok_all = True
    for name, spec in cases:
        outs, stats, lps = {}, {}, {}
        try:
            for label, disable in (("graphs", False), ("eager", True)):
                engine = Engine.from_modules(target, head, disable_cuda_graph=disable,
                                             cuda_graph_mode=sh.graph_mode, **spec, **kw)
                gen = engine.generate(input_ids=prompts, sampling_params=sp,
                                      return_logprob=True, top_logprobs_num=2,
                                      logprob_start_len=0)
                outs[label] = [o["output_ids"] for o in gen]
                lps[label] = [(lp, top[0][0]) for o in gen for lp, top in zip(
                    (x[0] for x in o["meta_info"]["output_token_logprobs"]),
                    o["meta_info"]["output_top_logprobs"])]
                stats[label] = engine.graph_stats()
                engine.shutdown()
        except TypeError as e:
            if "cuda_graph" in str(e) or "unexpected keyword" in str(e):
                log(f"engine parity: SKIP (Engine lacks the CUDA-graph options: {e})")
                return {"status": "SKIP", "reason": f"not wired: {e}"}
            raise
        same = outs["graphs"] == outs["eager"]
        lp_ok = same and len(lps["graphs"]) == len(lps["eager"]) and all(
            np.isfinite(a) and abs(a - b) < 1e-3 and top >= a - 1e-6
            for (a, top), (b, _) in zip(lps["graphs"], lps["eager"]))
        replays = stats["graphs"]["replays"]
        ok = same and lp_ok and (sh.graph_mode == "eager" or replays.get("verify", 0) > 0)
        ok_all &= ok
        results[name] = {"status": "PASS" if ok else "FAIL", "graphs_equal_eager": same,
                         "logprobs_equal": lp_ok,
                         "replays": replays, "eager_fallbacks": stats["graphs"]["eager"],
                         "graphs_captured": stats["graphs"]["captured"]}
        log(f"engine parity {name}: {results[name]['status']} "
            f"({sum(replays.values())} replays)")
    results["status"] = "PASS" if ok_all else "FAIL"
    del target, head
    free_memory(sh.device)
    return results


class Timer:
    """CUDA events on a GPU (GPU timeline of the whole iteration, host gaps included), wall
    clock on the CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def __call__(self, fn, iters: int, warmup: int) -> dict:
        for _ in range(warmup):
            fn()
        times, walls = [], []
        if self.cuda:
            torch.cuda.synchronize()
        for _ in range(iters):
            w0 = time.perf_counter()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                fn()
            walls.append((time.perf_counter() - w0) * 1e3)
        t = times if self.cuda else walls
        return {"median_ms": round(statistics.median(t), 4), "min_ms": round(min(t), 4),
                "wall_median_ms": round(statistics.median(walls), 4), "n": iters}


def section_timing(sh: Shapes, args, log, deadline) -> dict:
    """Per-iteration time of :meth:`SpecWorker.decode` for each (steps, bs), with graphs and
    eagerly (a worker without graphs, what ``disable_cuda_graph`` serves), plus plain decoding.

    Every timed iteration starts from the same state (context ``sh.context``, random KV and
    tokens): the rows' lengths are reset before it. Accepted drafts are what the random head
    gives (about 0); a replayed draft extend covers ``steps + 1`` tokens per request whatever
    was accepted."""
    target, head = build_models(sh.model, sh.timing_dtype, sh.device, seed=2)
    name = backend_name(sh.device, None if args.backend == "auto" else args.backend,
                        sh.timing_dtype)
    backend = select_backend(sh.device, name, sh.timing_dtype)
    max_bs, cap = max(sh.timing_bs), sh.context + 16
    timer = Timer(sh.device)
    results: dict[str, Any] = {"backend": name, "dtype": str(sh.timing_dtype),
                               "context": sh.context, "iters": args.iters, "accept": "model",
                               "rows": {}}
    gen = torch.Generator(device=sh.device).manual_seed(0)

    def driver(module, graphs: bool) -> WorkerDriver:
        steps = sh.timing_steps if module is not None else [0]
        d = WorkerDriver(target, module, backend, max_requests=max_bs, cap=cap, steps=steps,
                         graph_bs=sh.timing_bs if graphs else None, mode=sh.graph_mode)
        w = d.worker
        pools = [w.kv] + ([w.drafter.kv] if w.drafter is not None else [])
        for p in pools:
            for buf in (p.k_buffer, p.v_buffer):
                buf.normal_(generator=gen)
        if w.hidden is not None:
            w.hidden.normal_(generator=gen)
        # every row holds random tokens at slots base + position, context tokens long
        rows = np.arange(max_bs, dtype=np.int64)
        rng = np.random.default_rng(0)
        w.tables.write(rows, np.zeros(max_bs, np.int64), np.full(max_bs, cap, np.int64),
                       kv_slots=(rows[:, None] * cap + np.arange(cap)[None, :]).reshape(-1),
                       ids=rng.integers(0, sh.model.vocab_size, size=max_bs * cap))
        d.last[:] = rng.integers(0, sh.model.vocab_size, size=max_bs)
        return d

    drivers = {(m, g): driver(head if m == "spec" else None, g)
               for m in ("spec", "plain") for g in (True, False)}
    results["capture_seconds"] = round(sum(
        d.worker.capture_report.seconds for d in drivers.values()
        if d.worker.capture_report is not None), 2)
    variants = [("plain", "plain", 0, False)] + [
        (f"steps={s}", "spec", s, False) for s in sh.timing_steps] + [
        ("steps=0 skip", "spec", 0, True)]
    for label, models, steps, skip in variants:
        row: dict[str, Any] = {}
        for bs in sh.timing_bs:
            if time.perf_counter() > deadline:
                row[str(bs)] = {"skipped": "time budget"}
                continue
            rows = np.arange(bs, dtype=np.int64)
            cell = {}
            for mode, graphs in (("graphs", True), ("eager", False)):
                d = drivers[(models, graphs)]
                w = d.worker
                d.skip_zero = skip  # what the scheduler's plan would mark
                d.lens[rows] = w.draft_len[rows] = sh.context
                inp = d.decode_input(rows, steps, None)
                sampling = d.sampling(bs)

                def it(w=w, inp=inp, sampling=sampling):
                    w.draft_len[rows] = sh.context
                    w.decode(inp, sampling, None)
                iters = args.iters if graphs else max(3, args.iters // 2)
                cell[mode] = timer(it, iters, warmup=3)
                d.skip_zero = False
            cell["speedup"] = round(cell["eager"]["median_ms"] / cell["graphs"]["median_ms"], 3)
            row[str(bs)] = cell
        results["rows"][label] = row
        log(f"timing {label}: " + ", ".join(
            f"bs{bs}={row[str(bs)]['graphs']['median_ms']:.3f}ms"
            for bs in sh.timing_bs if "graphs" in row[str(bs)]))
    drivers.clear()
    free_memory(sh.device)
    return results


def write_cost_table(timing: dict, sh: Shapes, out_dir: Path, log) -> dict:
    """The measured surface as the cost-table JSON that ``specdial policy simulate --curve`` and
    ``policy replay --cost-table`` read (:class:`specdial.CostTable`: one entry per measured
    (batch size, steps) with the graph replay's median seconds at ``sh.context`` tokens of
    context per request; ``graph_bs``: the capture sizes), then the simulator over it: goodput
    of ``goodput``, ``ema`` (SGLang's default config), ``throughput_aware`` and every fixed
    steps value against the oracle. Writes ``cost_table.json`` and ``simulate.txt``."""
    from specdial.policy_sim import build_spec, format_table, run_simulation

    entries = []
    for label, row in timing.get("rows", {}).items():
        if not label.startswith("steps=") or label.endswith("skip"):
            continue
        k = int(label.split("=")[1])
        for bs, cell in row.items():
            if "graphs" in cell:
                entries.append({"batch_size": int(bs), "steps": k,
                                "context_per_request": sh.context,
                                "seconds": cell["graphs"]["median_ms"] / 1000.0})
    table_json = {"device": (torch.cuda.get_device_name() if sh.device == "cuda" else "cpu"),
                  "model": f"random {sh.model.num_hidden_layers}-layer "
                           f"{sh.model.hidden_size}-hidden target + EAGLE head, "
                           f"{timing.get('dtype')}",
                  "graph_bs": list(sh.timing_bs), "entries": entries}
    path = out_dir / "cost_table.json"
    path.write_text(json.dumps(table_json, indent=1))
    # the CLI's defaults (`specdial policy simulate --curve cost_table.json`)
    cases = run_simulation(build_spec(regimes=None, curves=[str(path)], policies=None,
                                      segments=16000, seed=0, noise=0.1, spikes=0.01))
    text = format_table(cases)
    (out_dir / "simulate.txt").write_text(text + "\n")
    log(f"cost table: {len(entries)} entries -> {path}; simulator:\n{text}")
    return {"entries": len(entries), "path": str(path),
            "mean_goodput_over_oracle": {
                name: round(sum(c["ratios"][name] for c in cases) / len(cases), 4)
                for name in cases[0]["ratios"]} if cases else {}}


def step0_overhead(timing: dict, bs_list) -> dict:
    rows = timing.get("rows", {})
    out = {}
    for bs in map(str, bs_list):
        try:
            plain = rows["plain"][bs]["graphs"]["median_ms"]
            warm = rows["steps=0"][bs]["graphs"]["median_ms"]
            skip = rows["steps=0 skip"][bs]["graphs"]["median_ms"]
        except KeyError:
            continue
        out[bs] = {"plain_ms": plain, "warm_ms": warm, "skip_ms": skip,
                   "warm_over_plain": round(warm / plain, 3),
                   "skip_over_plain": round(skip / plain, 3)}
    return out


def section_capture(sh: Shapes, args, log) -> dict:
    """Capture cost pruned vs unpruned for SGLang's default EMA config (it prunes from batch 8
    up; specdial's default goodput config prunes only from batch 128, and its plan's graph count
    is recorded beside)."""
    target, head = build_models(sh.model, sh.timing_dtype, sh.device, seed=3)
    name = backend_name(sh.device, None if args.backend == "auto" else args.backend,
                        sh.timing_dtype)
    config = AdaptiveConfig.ema_default()
    sizes = default_cuda_graph_bs(sh.capture_max_bs)
    default = AdaptiveConfig.default()
    results: dict[str, Any] = {"backend": name, "graph_bs": sizes,
                               "candidate_steps": config.candidate_steps,
                               "default_config_graphs": CapturePlan.build(
                                   default.candidate_steps, sizes, default).num_graphs}
    for label, prune in (("pruned", True), ("unpruned", False)):
        backend = select_backend(sh.device, name, sh.timing_dtype)
        plan = CapturePlan.build(config.candidate_steps, sizes, config, prune=prune)
        free_memory(sh.device)
        w = WorkerDriver(target, head, backend, max_requests=sh.capture_max_bs,
                         cap=sh.context + 16, steps=config.candidate_steps,
                         graph_bs=sizes, mode=sh.graph_mode,
                         adaptive_config=config if prune else None).worker
        rep = w.capture_report
        assert rep is not None and rep.plan == plan.to_dict()
        results[label] = {"graphs": rep.num_graphs, "seconds": round(rep.seconds, 2),
                          "pool_reserved_mib": round(rep.pool_reserved_bytes / 2**20, 1),
                          "device_used_mib": round(rep.device_used_bytes / 2**20, 1),
                          "sizes": rep.plan["sizes"]}
        log(f"capture {label}: {rep.num_graphs} graphs, {rep.seconds:.1f} s, "
            f"{results[label]['device_used_mib']} MiB")
        del w, backend
        free_memory(sh.device)
    del target, head
    return results


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- report
def table(res: dict, sh: Shapes) -> str:
    lines = ["| check | result |", "| --- | --- |"]
    for key in ("parity", "engine_parity"):
        sec = res.get(key)
        if not isinstance(sec, dict):
            continue
        for name, v in sec.items():
            if isinstance(v, dict) and "status" in v:
                lines.append(f"| {key} {name} | {v['status']} |")
        if "reason" in sec:
            lines.append(f"| {key} | {sec['status']}: {sec['reason'][:80]} |")
    timing = res.get("timing", {})
    if timing.get("rows"):
        lines += ["", f"per-iteration ms, median (graphs / eager), {timing['backend']}, "
                  f"{timing['dtype']}, context {timing['context']}", "",
                  "| variant | " + " | ".join(f"bs {b}" for b in sh.timing_bs) + " |",
                  "| --- |" + " --- |" * len(sh.timing_bs)]
        for label, row in timing["rows"].items():
            cells = []
            for b in sh.timing_bs:
                c = row.get(str(b), {})
                cells.append(f"{c['graphs']['median_ms']:.3f} / {c['eager']['median_ms']:.3f}"
                             if "graphs" in c else "-")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    s0 = res.get("step0")
    if s0:
        lines += ["", "| bs | steps 0 warm / plain | steps 0 skipped / plain |",
                  "| --- | --- | --- |"]
        for bs, v in s0.items():
            lines.append(f"| {bs} | {v['warm_over_plain']} | {v['skip_over_plain']} |")
    cap = res.get("capture")
    if isinstance(cap, dict) and "pruned" in cap:
        lines += ["", "| capture | graphs | seconds | device MiB |", "| --- | --- | --- | --- |"]
        for label in ("pruned", "unpruned"):
            v = cap[label]
            lines.append(f"| {label} | {v['graphs']} | {v['seconds']} | {v['device_used_mib']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default $OUT or out/gpu_check)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--sections", default="parity,engine,timing,capture")
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "flashinfer"],
                    help="attention backend of the timing and capture sections")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per cell")
    ap.add_argument("--context", type=int, default=None, help="context tokens for timing")
    ap.add_argument("--layers", type=int, default=None,
                    help="GPU: decoder layers of the 8B-shaped target (default 4)")
    ap.add_argument("--timing-bs", default=None,
                    help="GPU: comma-separated batch sizes timed (default 1,8,32,64,128)")
    ap.add_argument("--timing-steps", default=None,
                    help="GPU: comma-separated steps values timed (default 0,1,3,5,7)")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="soft time budget: later timing cells and sections are skipped")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    if args.cpu_smoke:
        torch.set_num_threads(1)
        sh = smoke_shapes(args)
        args.iters = args.iters or 3
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --cpu-smoke, or on the GPU machine", file=sys.stderr)
            return 2
        sh = gpu_shapes(args)
        args.iters = args.iters or 30
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / "out" / "gpu_check")
    out_dir.mkdir(parents=True, exist_ok=True)
    sections = set(args.sections.split(","))

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    res: dict[str, Any] = {"env": {
        "torch": torch.__version__, "device": (torch.cuda.get_device_name()
                                               if sh.device == "cuda" else "cpu"),
        "flashinfer": _flashinfer_version(), "cpu_smoke": args.cpu_smoke,
        "date": time.strftime("%Y-%m-%d"), "model": dataclasses.asdict(sh.model)}}
    failed = False
    steps = [("parity", lambda: section_parity(sh, log)),
             ("engine", lambda: section_engine_parity(sh, log)),
             ("timing", lambda: section_timing(sh, args, log, deadline)),
             ("capture", lambda: section_capture(sh, args, log))]
    for key, fn in steps:
        name = "engine_parity" if key == "engine" else key
        if key not in sections:
            continue
        if time.perf_counter() > deadline:
            res[name] = {"status": "SKIP", "reason": "time budget"}
            continue
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 - record and go on to the next section
            res[name] = {"status": "ERROR", "reason": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()}
            log(f"{name}: ERROR {type(e).__name__}: {e}")
        if isinstance(res[name], dict) and res[name].get("status") in ("FAIL", "ERROR") \
                and key in ("parity", "engine"):
            failed = True
        (out_dir / "gpu_check.json").write_text(json.dumps(res, indent=1, default=str))
    if "timing" in res and isinstance(res["timing"], dict):
        res["step0"] = step0_overhead(res["timing"], sh.timing_bs)
        if res["timing"].get("rows"):
            try:
                res["cost_table"] = write_cost_table(res["timing"], sh, out_dir, log)
            except Exception as e:  # noqa: BLE001 - the timings are saved either way
                res["cost_table"] = {"status": "ERROR", "reason": f"{type(e).__name__}: {e}"}
                log(f"cost table: ERROR {type(e).__name__}: {e}")
    res["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    res["status"] = "FAIL" if failed else "OK"
    (out_dir / "gpu_check.json").write_text(json.dumps(res, indent=1, default=str))
    text = table(res, sh)
    (out_dir / "table.md").write_text(text + "\n")
    print(f"\n{res['env']['device']} · torch {res['env']['torch']} · flashinfer "
          f"{res['env']['flashinfer']} · {res['elapsed_s']} s · {res['status']}\n")
    print(text)
    return 1 if failed else 0


def _flashinfer_version() -> str | None:
    if not flashinfer_available():
        return None
    import flashinfer
    return getattr(flashinfer, "__version__", "unknown")


if __name__ == "__main__":
    sys.exit(main())
