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

1. ``parity``: greedy decoding in float32 (torch attention backend; padding changes GEMM shapes
   so bfloat16 may legitimately differ) through :class:`StepRunner` with graphs against
   the same runners with graphs disabled (eager passes, dynamic metadata), for fixed steps 0,
   1, 3, 7, an adaptive run (the Rust policy with the default config, graph keys from
   ``decide``) and a forced switching schedule; the batch shrinks as requests finish, so padded
   replays of several sizes happen; both model sets. Every run must also equal target-only
   greedy decoding, and the graph side must have replayed graphs.
   ``engine_parity``: the same through ``Engine.from_modules(..., cuda_graph_bs=...,
   disable_cuda_graph=...)`` (``cuda_graph_mode`` = the section's graph mode, so the CPU smoke
   run emulates graphs); the graph side must have replayed graphs (``Engine.graph_stats``).
2. ``timing``: per decode iteration (draft + verify + greedy accept with its one host sync +
   draft extend), median of CUDA-event times over ``--iters`` iterations, for steps 0, 1, 3,
   5, 7 at batch sizes 1, 8, 32, 64, 128 with graphs and eagerly, plus plain decoding (target
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
from specdial.models.batch import ForwardBatch  # noqa: E402
from specdial.models.config import ModelConfig  # noqa: E402
from specdial.models.eagle import EAGLE_ARCHITECTURE  # noqa: E402
from specdial.worker.graph_pool import GraphPool, capture_all  # noqa: E402
from specdial.worker.graph_tables import CapturePlan, default_cuda_graph_bs  # noqa: E402
from specdial.worker.step_buffers import KVLayout  # noqa: E402
from specdial.worker.step_runner import build_runners  # noqa: E402
from specdial.worker.drafters import make_drafter  # noqa: E402


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


def gpu_shapes(args) -> Shapes:
    cfg = ModelConfig("LlamaForCausalLM", hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                      max_position_embeddings=8192)
    return Shapes(cfg, "cuda", torch.bfloat16, (0, 1, 3, 7), 6, (40, 34, 28, 20, 12, 6),
                  (1, 2, 4, 8), (0, 1, 3, 5, 7), (1, 8, 32, 64, 128), args.context or 512, 128,
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


# --------------------------------------------------------------------------- the decoder
class MiniDecoder:
    """Greedy speculative decoding driven through :class:`StepRunner` (the worker's decode
    iteration in small; it shows the runner API an engine calls).

    Request ``r`` owns slots ``r * cap .. r * cap + cap - 1`` (slot = base + position), so no
    allocator is needed. Per request: ``L`` target KV positions (the last emitted token
    ``x_L`` is not in the KV yet), ``D`` valid drafter positions. ``hidden`` holds the target's
    final hidden state per slot (EAGLE's input feature), row ``num_slots + 1`` is zero.
    """

    def __init__(self, target, drafter, runners, backend, *, max_requests: int, cap: int,
                 skip_zero_extend: bool = False) -> None:
        self.target, self.drafter, self.runners, self.backend = target, drafter, runners, backend
        self.kv = next(iter(runners.values())).target_kv
        self.cap, self.max_requests = cap, max_requests
        self.skip_zero_extend = skip_zero_extend
        w = target.embed_tokens.weight
        self.device, self.dtype = w.device, w.dtype
        self.num_slots = self.kv.num_slots
        self.zero_row = self.num_slots + 1
        self.hidden = torch.zeros(self.num_slots + 2, target.config.hidden_size, dtype=w.dtype,
                                  device=w.device)
        self.tok = np.zeros((max_requests, cap + 1), np.int64)
        self.L = np.zeros(max_requests, np.int64)
        self.D = np.zeros(max_requests, np.int64)

    def _d(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, np.int64)).to(self.device)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> None:
        """Eager ragged prefill of rows ``0..len(prompts)-1`` (target, then drafter KV)."""
        rows = np.arange(len(prompts), dtype=np.int64)
        lens = np.array([len(p) for p in prompts], np.int64)
        pos = np.concatenate([np.arange(n) for n in lens])
        loc = np.repeat(rows * self.cap, lens) + pos
        ids = np.concatenate([np.asarray(p, np.int64) for p in prompts])
        loc_d, pos_d = self._d(loc), self._d(pos)
        meta = self.backend.plan(torch.from_numpy(lens), torch.from_numpy(lens), loc_d)
        batch = ForwardBatch(self._d(ids), pos_d, loc_d, meta)
        hidden = self.target(batch, self.kv, self.backend)
        self.hidden.index_copy_(0, loc_d, hidden)
        first = self.target.compute_logits(hidden[self._d(np.cumsum(lens) - 1)]).argmax(-1)
        for r, p in enumerate(prompts):
            self.tok[r, :len(p)] = p
        self.tok[rows, lens] = first.cpu().numpy()
        self.L[rows], self.D[rows] = lens, 0
        if self.drafter is not None:
            feats = self.hidden[torch.where(pos_d > 0, loc_d - 1, self.zero_row)]
            self.drafter.prefill(batch, self.backend, hidden_states=feats)
            self.D[rows] = lens

    def _layout(self, rows: np.ndarray, lens: np.ndarray) -> KVLayout:
        total = int(lens.sum())
        offsets = np.repeat(np.cumsum(lens) - lens, lens)
        flat = np.repeat(rows * self.cap, lens) + np.arange(total) - offsets
        return KVLayout(self._d(flat), lens)

    def _extend(self, runner, rows, start, end, layout, graph_bs) -> None:
        counts = end - start
        if not counts.any():
            return
        offsets = np.repeat(np.cumsum(counts) - counts, counts)
        pos = np.repeat(start, counts) + np.arange(int(counts.sum())) - offsets
        row_rep = np.repeat(rows, counts)
        loc = row_rep * self.cap + pos
        feats = None
        if self.drafter.needs_target_hidden:
            prev = np.where(pos > 0, loc - 1, self.zero_row)
            feats = self.hidden[self._d(prev)]
        runner.draft_extend(self._d(self.tok[row_rep, pos]), self._d(pos), self._d(loc), layout,
                            start, counts, feats, graph_bs=graph_bs)
        self.D[rows] = np.maximum(self.D[rows], end)

    @torch.inference_mode()
    def step(self, rows: np.ndarray, steps: int, graph_bs: int | None = None,
             force_accept: int | None = None) -> np.ndarray:
        """One decode iteration with ``steps`` drafts for ``rows``; returns accepted drafts.
        ``force_accept`` (timing only) pretends ``min(force_accept, steps)`` drafts were
        accepted by every request, so the draft extend does representative work."""
        runner = self.runners[steps]
        k, n, b = steps, steps + 1, len(rows)
        L, base = self.L[rows].copy(), rows * self.cap
        if int(L.max()) + n > self.cap:
            raise ValueError("request outgrew its slot range; raise cap")
        layout = self._layout(rows, L + n)
        x_last = self._d(self.tok[rows, L])
        vpos = L[:, None] + np.arange(n)[None, :]
        vloc = base[:, None] + vpos
        if k:
            D = self.D[rows]
            if (D < L).any():  # catch-up after skipped zero-step extends
                self._extend(runner, rows, D, L, layout, graph_bs)
            first = self.hidden[self._d(base + L - 1)] if self.drafter.needs_target_hidden \
                else None
            drafts, _ = runner.draft(x_last, self._d(vpos[:, :k].T), self._d(vloc[:, :k].T),
                                     layout, L, first_hidden=first, graph_bs=graph_bs)
            ids = torch.cat([x_last[:, None], drafts], 1)
        else:
            ids = x_last[:, None]
        vloc_d = self._d(vloc.reshape(-1))
        out = runner.verify(ids.reshape(-1), self._d(vpos.reshape(-1)), vloc_d, layout, L,
                            graph_bs=graph_bs)
        if self.drafter is not None:
            self.hidden.index_copy_(0, vloc_d, out.hidden)
        best = out.logits.view(b, n, -1).argmax(-1)  # [B, n] target greedy tokens
        if k:  # ids holds a copy of the drafts (graph outputs are only valid until the
            # next replay, here the verify graph's)
            acc = (ids[:, 1:] == best[:, :k]).to(torch.int64).cumprod(1).sum(1)
        else:
            acc = torch.zeros(b, dtype=torch.int64, device=self.device)
        if force_accept is not None:
            acc = torch.full_like(acc, min(force_accept, k))
        host = torch.cat([acc[:, None], best], 1).cpu().numpy()  # the one sync
        acc_np, best_np = host[:, 0], host[:, 1:]
        for i, r in enumerate(rows.tolist()):
            a = int(acc_np[i])
            self.tok[r, L[i] + 1:L[i] + a + 2] = best_np[i, :a + 1]
        new_l = L + acc_np + 1
        if k and self.drafter is not None:
            self.D[rows] = self.drafter.draft_len_after_verify(L, k, acc_np)
        self.L[rows] = new_l
        if self.drafter is not None and not (k == 0 and self.skip_zero_extend):
            self._extend(runner, rows, self.D[rows], new_l, layout, graph_bs)
        return acc_np

    def generate(self, prompts, new_tokens, schedule) -> tuple[list[list[int]], dict]:
        """Decode until every request has its ``new_tokens``; ``schedule(i, bs)`` gives
        ``(steps, graph_bs)`` and may return ``on_verify`` feedback via a callback attr."""
        self.prefill(prompts)
        lens = np.array([len(p) for p in prompts], np.int64)
        target_n = np.asarray(new_tokens, np.int64)
        hist: dict[int, int] = {}
        it = verifies = emitted = 0
        while True:
            produced = self.L[:len(prompts)] + 1 - lens
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
        out = [self.tok[r, lens[r]:lens[r] + target_n[r]].tolist() for r in range(len(prompts))]
        return out, {"iterations": it, "steps_histogram": dict(sorted(hist.items())),
                     "accept_length": round(emitted / max(verifies, 1), 3)}


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
def make_runner_set(target, head, backend, plan, mode, cap, max_requests, dtype_device):
    drafter = make_drafter(head, target, max_steps=max(plan.max_steps, 1)) if head is not None \
        else None
    num_slots = max_requests * cap
    kv = target.make_kv_pool(num_slots)
    if drafter is not None:
        drafter.init_kv(num_slots)
    pool = GraphPool(dtype_device, mode)
    runners = build_runners(plan, target=target, target_kv=kv, drafter=drafter,
                            backend=backend, pool=pool, kv_capacity=cap)
    report = capture_all(runners, plan)
    return drafter, runners, report


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
        # target-only greedy reference (eager, no drafter)
        plain_plan = CapturePlan.build([0], sh.parity_graph_bs, has_drafter=False)
        _, plain_runners, _ = make_runner_set(target, None, backend, plain_plan, "eager", cap,
                                              len(prompts), sh.device)
        for r in plain_runners.values():
            r.enabled = False
        ref, _ = MiniDecoder(target, None, plain_runners, backend, max_requests=len(prompts),
                             cap=cap).generate(prompts, new_tokens, fixed(0))
        del plain_runners
        for name, what, skip in runs:
            t0 = time.perf_counter()
            if what == "adaptive":
                plan = CapturePlan.build(config.candidate_steps, sh.parity_graph_bs, config)
            elif isinstance(what, list):
                plan = CapturePlan.build(sorted(set(what)), sh.parity_graph_bs)
            else:
                plan = CapturePlan.build([what], sh.parity_graph_bs)
            drafter, runners, report = make_runner_set(target, head, backend, plan,
                                                       sh.graph_mode, cap, len(prompts),
                                                       sh.device)
            outs, infos = {}, {}
            for label, enabled in (("graphs", True), ("eager", False)):
                for r in runners.values():
                    r.enabled = enabled
                if what == "adaptive":
                    schedule = AdaptiveSchedule(plan.graph_bs)
                elif isinstance(what, list):
                    schedule = cycle(what)
                else:
                    schedule = fixed(what)
                dec = MiniDecoder(target, drafter, runners, backend, max_requests=len(prompts),
                                  cap=cap, skip_zero_extend=skip)
                outs[label], infos[label] = dec.generate(prompts, new_tokens, schedule)
                if isinstance(schedule, AdaptiveSchedule):
                    infos[label]["switches"] = schedule.switches
            replays = {s: dict(r.stats.replays) for s, r in runners.items()}
            fallbacks = {s: dict(r.stats.eager) for s, r in runners.items()}
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
            del runners, drafter
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
    sp = [{"max_new_tokens": n} for n in sh.parity_new_tokens[:sh.parity_prompts]]
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
    """Per-iteration time for each (steps, bs), graphs and eager, plus plain decoding."""
    target, head = build_models(sh.model, sh.timing_dtype, sh.device, seed=2)
    name = backend_name(sh.device, None if args.backend == "auto" else args.backend,
                        sh.timing_dtype)
    backend = select_backend(sh.device, name, sh.timing_dtype)
    max_bs, cap = max(sh.timing_bs), sh.context + 16
    timer = Timer(sh.device)
    results: dict[str, Any] = {"backend": name, "dtype": str(sh.timing_dtype),
                               "context": sh.context, "iters": args.iters,
                               "accept": args.accept, "rows": {}}

    def fill_state(dec: MiniDecoder, bs: int) -> np.ndarray:
        rows = np.arange(bs, dtype=np.int64)
        rng = np.random.default_rng(bs)
        dec.tok[:bs, :sh.context + 1] = rng.integers(0, sh.model.vocab_size,
                                                     size=(bs, sh.context + 1))
        return rows

    def reset(dec: MiniDecoder, rows: np.ndarray) -> None:
        dec.L[rows] = sh.context
        dec.D[rows] = sh.context

    def randomize_kv(*pools) -> None:
        gen = torch.Generator(device=sh.device).manual_seed(0)
        for p in pools:
            for buf in (p.k_buffer, p.v_buffer):
                buf.normal_(generator=gen)

    variants = [("plain", None, 0, False)] + [
        (f"steps={s}", head, s, False) for s in sh.timing_steps] + [
        ("steps=0 skip", head, 0, True)]
    # one runner set per drafter presence, every size captured (no pruning), graphs shared
    plan_spec = CapturePlan.build(sh.timing_steps, sh.timing_bs)
    plan_plain = CapturePlan.build([0], sh.timing_bs, has_drafter=False)
    drafter, spec_runners, rep_spec = make_runner_set(target, head, backend, plan_spec,
                                                      sh.graph_mode, cap, max_bs, sh.device)
    _, plain_runners, rep_plain = make_runner_set(target, None, backend, plan_plain,
                                                  sh.graph_mode, cap, max_bs, sh.device)
    results["capture_seconds"] = round(rep_spec.seconds + rep_plain.seconds, 2)
    randomize_kv(next(iter(spec_runners.values())).target_kv, drafter.kv,
                 next(iter(plain_runners.values())).target_kv)
    for label, drafter_module, steps, skip in variants:
        runners = plain_runners if drafter_module is None else spec_runners
        dec = MiniDecoder(target, drafter if drafter_module is not None else None, runners,
                          backend, max_requests=max_bs, cap=cap, skip_zero_extend=skip)
        dec.hidden.normal_()
        row: dict[str, Any] = {}
        for bs in sh.timing_bs:
            if time.perf_counter() > deadline:
                row[str(bs)] = {"skipped": "time budget"}
                continue
            rows = fill_state(dec, bs)
            cell = {}
            for mode, enabled in (("graphs", True), ("eager", False)):
                for r in runners.values():
                    r.enabled = enabled

                accept = {"half": (steps + 1) // 2, "all": steps, "model": None}[args.accept]

                def it():
                    reset(dec, rows)
                    dec.step(rows, steps, force_accept=accept)
                iters = args.iters if enabled else max(3, args.iters // 2)
                cell[mode] = timer(it, iters, warmup=3)
            cell["speedup"] = round(cell["eager"]["median_ms"] / cell["graphs"]["median_ms"], 3)
            row[str(bs)] = cell
        results["rows"][label] = row
        log(f"timing {label}: " + ", ".join(
            f"bs{bs}={row[str(bs)]['graphs']['median_ms']:.3f}ms"
            for bs in sh.timing_bs if "graphs" in row[str(bs)]))
    for r in list(spec_runners.values()) + list(plain_runners.values()):
        r.enabled = True
    del spec_runners, plain_runners, drafter, target, head
    free_memory(sh.device)
    return results


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
        _, runners, rep = make_runner_set(target, head, backend, plan, sh.graph_mode,
                                          sh.context + 16, sh.capture_max_bs, sh.device)
        results[label] = {"graphs": rep.num_graphs, "seconds": round(rep.seconds, 2),
                          "pool_reserved_mib": round(rep.pool_reserved_bytes / 2**20, 1),
                          "device_used_mib": round(rep.device_used_bytes / 2**20, 1),
                          "sizes": rep.plan["sizes"]}
        log(f"capture {label}: {rep.num_graphs} graphs, {rep.seconds:.1f} s, "
            f"{results[label]['device_used_mib']} MiB")
        del runners, backend
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
    ap.add_argument("--accept", default="half", choices=["half", "all", "model"],
                    help="accepted drafts per request in timed iterations: ceil(steps/2), "
                         "steps, or what the random head gives (about 0: no extend work)")
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
