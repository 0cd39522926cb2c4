"""Tensor parallelism on this machine: target forward time at tp 1 and tp 2, and the share
spent in collectives (issue 17).

Every configuration runs in fresh rank processes started the way the engine starts them
(:func:`specdial.launch.launch_ranks`, gloo on the CPU), including tp 1 (a group of one:
no collectives), so the ratios compare like with like. For each model and batch shape it
prints ms per forward (median) for tp 1 with 1 and 2 torch threads and tp 2 with 1 thread per
rank, the ratio tp2 / tp1, and tp 2's time inside all-reduce / all-gather per forward.

Usage: ``nice -n 19 .venv/bin/python benches/tp_forward.py [--out results.json]``. Models: the
built-in target (7M parameters, hidden 256, 8 layers) and a random Llama of hidden 1024,
8 layers, 16 heads (8 kv), MLP 2816, vocab 32000 (~170M parameters), written to a temp dir.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from specdial.config import DistConfig
from specdial.launch import launch_ranks
from specdial.distributed.group import free_port

BUILTIN = Path(__file__).resolve().parents[1] / "python/specdial/builtin/target"
SHAPES = [(1, 4), (8, 4), (32, 1)]  # (batch size, tokens per request): verify / decode shapes


def _wide_model(path: Path) -> Path:
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                   num_attention_heads=16, num_key_value_heads=8,
                                   vocab_size=32000, max_position_embeddings=2048)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def run(model: Path, tp: int, threads: int, b: int, q: int, context: int, iters: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        config = DistConfig(tp_size=tp, rank=0, init_addr=f"127.0.0.1:{free_port()}",
                            timeout_s=120, threads=threads)
        with launch_ranks(config, range(tp), "specdial.launch.probe:forward_probe",
                          {"model_path": str(model), "out_dir": out, "batch_size": b,
                           "tokens_per_request": q, "context": context,
                           "iters": iters}) as procs:
            codes = [p.wait(600) for p in procs.procs.values()]
        if any(codes):
            raise RuntimeError(f"ranks exited with {codes}")
        return json.loads((Path(out) / "forward.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--iters", type=int, default=30)
    ns = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"builtin-7M": BUILTIN, "random-170M": _wide_model(Path(tmp) / "wide")}
        for name, path in models.items():
            for b, q in SHAPES:
                r1 = run(path, 1, 1, b, q, ns.context, ns.iters)
                r1t2 = run(path, 1, 2, b, q, ns.context, ns.iters)
                r2 = run(path, 2, 1, b, q, ns.context, ns.iters)
                row = {"model": name, "batch_size": b, "tokens_per_request": q,
                       "tp1_1thread_ms": r1["ms_per_forward"],
                       "tp1_2threads_ms": r1t2["ms_per_forward"],
                       "tp2_ms": r2["ms_per_forward"],
                       "tp2_collective_ms": r2["collective_ms_per_forward"],
                       "tp2_collectives": r2["collectives_per_forward"]}
                row["tp2_over_tp1_1thread"] = row["tp2_ms"] / row["tp1_1thread_ms"]
                row["tp2_over_tp1_2threads"] = row["tp2_ms"] / row["tp1_2threads_ms"]
                row["collective_share"] = row["tp2_collective_ms"] / row["tp2_ms"]
                rows.append(row)
                print(f"{name:12s} bs {b:2d} x {q} tok | tp1 1t {row['tp1_1thread_ms']:7.2f} ms"
                      f" | tp1 2t {row['tp1_2threads_ms']:7.2f} | tp2 {row['tp2_ms']:7.2f} "
                      f"(x{row['tp2_over_tp1_1thread']:.2f} vs 1t, "
                      f"x{row['tp2_over_tp1_2threads']:.2f} vs 2t) | collectives "
                      f"{row['tp2_collective_ms']:6.2f} ms ({row['tp2_collectives']:.0f} calls, "
                      f"{100 * row['collective_share']:.0f}%)", flush=True)
    if ns.out:
        Path(ns.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
