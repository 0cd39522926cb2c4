"""Torch ops and CPU time of one model forward at batch size 1 (issue 29: per-op cost).

    .venv/bin/python benches/forward_ops.py [--context 256] [--calls 40] [--rounds 7]
        [--layer-ops] [--scattered] [--json]
    .venv/bin/python benches/forward_ops.py --base /path/to/base/python [--rounds 7] [--json]

On the built-in models (float32, one torch thread, the torch attention backend on the CPU),
after a prefill of ``--context`` tokens, each case runs one forward of one request (its KV
slots consecutive, as the page pool hands them to a lone request, or ``--scattered``):

- ``target_decode`` / ``target_verify4``: the target over 1 / 4 new tokens (a plain decode,
  a chain-3 verify);
- ``draft_decode`` / ``draft_verify4``: the built-in draft model over 1 / 4 tokens (a draft
  step, a draft extend of 4);
- ``eagle_decode``: the built-in EAGLE-1 head over 1 token (hidden states given);
- ``*_logits``: the same forward followed by ``compute_logits`` over its last row;
  ``target_verify17_logits`` / ``draft_verify4_logits``: over every row (a tree verify of 16
  nodes, a tree draft level of top-k 4: their LM heads run over 17 / 4 rows).

Per case: the torch ops one forward dispatches (``torch.profiler``, CPU, ``record_shapes``
off): ``ops`` every op event, nested ones included (``aten::linear`` and the ``aten::addmm``
it calls count 2), ``top_ops`` those called from Python; and ``us`` the median over
``--rounds`` of this thread's CPU time (``time.thread_time``) per forward over ``--calls``
calls. ``--layer-ops`` also prints the ops of one target decoder layer's forward, in order.

``--base``: the A/B. Each of ``--rounds`` rounds runs this script in a fresh process once per
side, order alternating, with ``PYTHONPATH`` at ``--base`` (another copy of the ``specdial``
package, its compiled ``_core`` included) or at ``--new`` (default: this checkout's
``python/``); reported per
case: both sides' ops, the median µs per forward and the median of the paired new/base
ratios. Speed is never asserted; the load average is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ("target_decode", "target_verify4", "target_verify4_logits", "target_verify17_logits",
         "draft_decode", "draft_decode_logits", "draft_verify4", "draft_verify4_logits",
         "eagle_decode")


def _setup(context: int, scattered: bool = False):
    """The models, KV pools and one forward closure per case. ``scattered``: the request's
    KV slots in a random order (else ``0..n - 1``, what the page pool hands out to a lone
    request)."""
    import torch

    from specdial.attention.torch_backend import TorchAttentionBackend
    from specdial.builtin import builtin_model_path
    from specdial.models import load_model
    from specdial.models.batch import ForwardBatch
    from specdial.models.drafter_loader import load_eagle_head

    torch.set_num_threads(1)
    torch.manual_seed(0)
    target = load_model(builtin_model_path("target"))
    draft = load_model(builtin_model_path("draft"))
    eagle = load_eagle_head(builtin_model_path("eagle"), target)
    backend = TorchAttentionBackend()
    slots = context + 20
    pools = {m: m.make_kv_pool(slots) for m in (target, draft, eagle)}
    vocab = target.config.vocab_size
    ids = torch.randint(0, vocab, (context + 17,))
    slot = torch.randperm(slots) if scattered else torch.arange(slots)

    def batch(n_new: int) -> ForwardBatch:
        kv_len = context + n_new
        pos = torch.arange(context, kv_len)
        meta = backend.plan(torch.tensor([n_new]), torch.tensor([kv_len]), slot[:kv_len])
        return ForwardBatch(ids[context:kv_len], pos, slot[context:kv_len], meta)

    with torch.inference_mode():
        meta = backend.plan(torch.tensor([context]), torch.tensor([context]), slot[:context])
        full = ForwardBatch(ids[:context], torch.arange(context), slot[:context], meta)
        hidden = target(full, pools[target], backend)
        draft(full, pools[draft], backend)
        eagle(full, pools[eagle], backend, hidden_states=hidden)
    b1, b4, b17 = batch(1), batch(4), batch(17)
    h1 = hidden[-1:].clone()

    def fwd(model, b, logits: str | None = None, **kw):
        def run():
            out = model(b, pools[model], backend, **kw)
            if logits is None:
                return out
            return model.compute_logits(out[-1:] if logits == "last" else out)
        return run

    return {
        "target_decode": fwd(target, b1), "target_verify4": fwd(target, b4),
        "target_verify4_logits": fwd(target, b4, "last"),
        "target_verify17_logits": fwd(target, b17, "all"),
        "draft_decode": fwd(draft, b1), "draft_decode_logits": fwd(draft, b1, "last"),
        "draft_verify4": fwd(draft, b4), "draft_verify4_logits": fwd(draft, b4, "all"),
        "eagle_decode": fwd(eagle, b1, hidden_states=h1),
    }, target, pools[target], backend, b1


def _count_ops(fn) -> tuple[int, int]:
    """(every op event, top-level op events) of one call of ``fn``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU],
                                         record_shapes=False) as prof:
        fn()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    return len(events), sum(1 for e in events if e.cpu_parent is None
                            or not e.cpu_parent.name.startswith("aten::"))


def _layer_ops(target, pool, backend, b) -> list[str]:
    """Names of the top-level ops of one target decoder layer's forward over ``b``, in order."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    x = target.embed_tokens(b.input_ids)
    cos, sin = target.rotary(b.positions, x.dtype)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU],
                                         record_shapes=False) as prof:
        target.layers[0](x, cos, sin, b, pool, backend)
    events = sorted((e for e in prof.events() if e.name.startswith("aten::")
                     and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))),
                    key=lambda e: e.time_range.start)
    return [e.name for e in events]


def child(args: argparse.Namespace) -> dict:
    """This process's figures (module docstring)."""
    import torch

    cases, target, pool, backend, b1 = _setup(args.context, args.scattered)
    out: dict = {"ops": {}, "top_ops": {}, "us": {}}
    with torch.inference_mode():
        for fn in cases.values():  # warm-up
            for _ in range(3):
                fn()
    for name, fn in cases.items():
        out["ops"][name], out["top_ops"][name] = _count_ops(fn)
    samples: dict[str, list[float]] = {n: [] for n in cases}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, fn in cases.items():
                t0 = time.thread_time()
                for _ in range(args.calls):
                    fn()
                samples[name].append((time.thread_time() - t0) / args.calls * 1e6)
    out["us"] = {n: statistics.median(v) for n, v in samples.items()}
    if args.layer_ops:
        out["layer_ops"] = _layer_ops(target, pool, backend, b1)
    return out


def ab(args: argparse.Namespace) -> dict:
    """Alternating fresh-process rounds of both sides (module docstring)."""
    sides = {"base": args.base, "new": args.new or str(ROOT / "python")}
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    load = os.getloadavg()
    for r in range(args.rounds):
        for side in (("base", "new") if r % 2 == 0 else ("new", "base")):
            cmd = [sys.executable, __file__, "--json", "--rounds", "3", "--calls",
                   str(args.calls), "--context", str(args.context)]
            cmd += ["--scattered"] if args.scattered else []
            proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=sides[side]),
                                  capture_output=True, text=True, check=True)
            runs[side].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    out: dict = {"args": vars(args), "load_before": load, "load_after": os.getloadavg(),
                 "cases": {}}
    for c in CASES:
        base_us = [r["us"][c] for r in runs["base"]]
        new_us = [r["us"][c] for r in runs["new"]]
        out["cases"][c] = {
            "ops": {s: runs[s][0]["ops"][c] for s in sides},
            "top_ops": {s: runs[s][0]["top_ops"][c] for s in sides},
            "us": {"base": statistics.median(base_us), "new": statistics.median(new_us)},
            "new_over_base": statistics.median(n / b for n, b in zip(new_us, base_us)),
            "raw_us": {"base": base_us, "new": new_us}}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--layer-ops", action="store_true")
    p.add_argument("--scattered", action="store_true",
                   help="the request's KV slots in a random order (default: consecutive)")
    p.add_argument("--base", help="directory holding the base specdial package (A/B mode)")
    p.add_argument("--new", help="the new side's package directory (default: this checkout's "
                                 "python/)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.base is not None:
        if not (Path(args.base) / "specdial" / "__init__.py").is_file():
            p.error(f"--base: no specdial package under {args.base!r}")
        out = ab(args)
        if args.json:
            print(json.dumps(out))
            return
        for c, d in out["cases"].items():
            print(f"{c:22s} ops {d['ops']['base']:4d} -> {d['ops']['new']:4d} (top "
                  f"{d['top_ops']['base']:4d} -> {d['top_ops']['new']:4d})  µs "
                  f"{d['us']['base']:7.0f} -> {d['us']['new']:7.0f}  new/base "
                  f"{d['new_over_base']:.3f}")
        print(f"rounds {args.rounds}; load {out['load_before']} -> {out['load_after']}")
        return
    out = child(args)
    out["load"] = os.getloadavg()
    if args.json:
        print(json.dumps(out))
        return
    for c in out["us"]:
        print(f"{c:22s} ops {out['ops'][c]:4d} (top {out['top_ops'][c]:4d})  "
              f"{out['us'][c]:7.0f} µs per forward")
    if args.layer_ops:
        print("one target layer's top-level ops:", " ".join(
            o.removeprefix("aten::") for o in out["layer_ops"]))
    print(f"load {out['load']}")


if __name__ == "__main__":
    main()
