"""Tensor-parallel consistency check: the same forwards at ``tp_size`` 1 and N, compared.

``python -m specdial.launch.check MODEL_DIR [--draft-model-path DIR] --tp-size N`` loads
the target (and drafter) unsharded, runs :func:`forward_outputs`, then joins an N-rank group as
rank 0 (starting its node's other ranks, :func:`~specdial.launch.node.start_rank0`), runs
the same forwards sharded and prints the largest absolute and relative logit differences.
Multi-node: the same command with ``--nnodes``, ``--node-rank`` and ``--dist-init-addr`` on
every node (:func:`~specdial.launch.node.run_worker_node` on nodes other than 0). The
tests drive :func:`run_rank` on every rank and compare with :func:`forward_outputs` at tp 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from specdial.attention.torch_backend import TorchAttentionBackend
from specdial.distributed.group import (DEFAULT_TIMEOUT_S, SINGLE, DistConfig, TensorParallel,
                                       destroy_group)
from specdial.launch.node import run_worker_node, start_rank0
from specdial.config.parallel import ParallelOptions
from specdial.models.batch import ForwardBatch
from specdial.models.drafter_loader import load_drafter
from specdial.models.loader import load_model

#: Two requests: prefill of 7 and 5 tokens, then 3 more tokens each (a verify-shaped batch).
PREFILL, EXTEND = (7, 5), 3


def _batch(backend: TorchAttentionBackend, ids: list[list[int]], starts: list[int],
           slots: list[list[int]]) -> ForwardBatch:
    flat, pos, loc, kv_idx = [], [], [], []
    for r, toks in enumerate(ids):
        flat += toks
        pos += range(starts[r], starts[r] + len(toks))
        loc += slots[r][starts[r]:starts[r] + len(toks)]
        kv_idx += slots[r][:starts[r] + len(toks)]
    qo = torch.tensor([len(t) for t in ids])
    kv = torch.tensor([s + len(t) for s, t in zip(starts, ids)])
    attn = backend.plan(qo, kv, torch.tensor(kv_idx))
    return ForwardBatch(torch.tensor(flat), torch.tensor(pos), torch.tensor(loc), attn)


@torch.no_grad()
def forward_outputs(model_path: str, draft_path: str | None = None,
                    algorithm: str | None = None,
                    tp: TensorParallel = SINGLE) -> dict[str, torch.Tensor]:
    """Logits of a fixed two-request prefill + extend through the target, and of the drafter.

    Returns float32 CPU tensors: ``target_prefill`` / ``target_extend`` ``[T, vocab]``,
    ``hidden`` ``[T, hidden]`` and, with a drafter, ``draft_prefill`` / ``draft_extend``
    (an EAGLE head is fed the target's hidden states of the same tokens). The same on every
    rank of ``tp`` (the logits are gathered).
    """
    target = load_model(model_path, tp=tp)
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    total = [n + EXTEND for n in PREFILL]
    prompt = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in total]
    slots = [list(range(sum(total[:r]), sum(total[:r + 1])))[::-1] for r in range(len(total))]
    backend = TorchAttentionBackend()
    steps = [([p[:n] for p, n in zip(prompt, PREFILL)], [0] * len(PREFILL)),
             ([p[n:] for p, n in zip(prompt, PREFILL)], list(PREFILL))]
    out: dict[str, torch.Tensor] = {}
    kv = target.make_kv_pool(sum(total))
    hidden = []
    for name, (ids, starts) in zip(("prefill", "extend"), steps):
        batch = _batch(backend, ids, starts, slots)
        h = target(batch, kv, backend)
        hidden.append(h)
        out[f"target_{name}"] = target.compute_logits(h)
    out["hidden"] = torch.cat(hidden).float()
    if draft_path is not None:
        algo, drafter = load_drafter(draft_path, target, algorithm, tp=tp)
        dkv = drafter.make_kv_pool(sum(total))
        for name, (ids, starts), h in zip(("prefill", "extend"), steps, hidden):
            batch = _batch(backend, ids, starts, slots)
            if algo == "DRAFT":
                d = drafter(batch, dkv, backend)
            elif algo == "EAGLE3":
                d = drafter(batch, dkv, backend, hidden_states=drafter.fuse(
                    torch.cat([h] * len(drafter.spec.aux_layers), -1)))
            else:
                d = drafter(batch, dkv, backend, hidden_states=h)
            out[f"draft_{name}"] = drafter.compute_logits(d)
    return {k: v.float().cpu() for k, v in out.items()}


def run_rank(tp: TensorParallel, config: DistConfig, cases: list[dict[str, Any]],
             out: str | None = None) -> None:
    """Entry of every rank: :func:`forward_outputs` sharded for each case (a dict of its
    keyword arguments: ``model_path``, optional ``draft_path`` and ``algorithm``); rank 0
    saves the list of results to ``out`` (``torch.save``)."""
    results = [forward_outputs(tp=tp, **case) for case in cases]
    if tp.rank == 0 and out is not None:
        torch.save(results, out)


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, tuple[float,
                                                                                       float]]:
    """Per output: ``(max abs difference, max abs difference / max abs value of a)``."""
    if a.keys() != b.keys():
        raise ValueError(f"outputs differ in keys: {sorted(a)} vs {sorted(b)}")
    return {k: ((a[k] - b[k]).abs().max().item(),
                ((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-30)).item())
            for k in a}


def main(argv: list[str] | None = None) -> int:
    """CLI (module docstring); prints the differences, then a ``PASS:`` / ``FAIL:`` verdict
    line (:func:`verdict`); exit status 0 when every relative difference is below
    ``--rtol``, 1 otherwise. With ``--nnodes N --node-rank K --dist-init-addr HOST:PORT`` the
    same command on each node forms one group; nodes other than 0 only run their ranks."""
    p = argparse.ArgumentParser(prog="python -m specdial.launch.check")
    p.add_argument("model_path")
    p.add_argument("--draft-model-path", default=None)
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-init-addr", default=None)
    p.add_argument("--dist-timeout", type=float, default=DEFAULT_TIMEOUT_S)
    p.add_argument("--rtol", type=float, default=1e-4)
    ns = p.parse_args(argv)
    options = ParallelOptions(tp_size=ns.tp_size, nnodes=ns.nnodes, node_rank=ns.node_rank,
                              dist_init_addr=ns.dist_init_addr, dist_timeout=ns.dist_timeout)
    case = {"model_path": str(Path(ns.model_path).resolve()), "algorithm": ns.speculative_algorithm,
            "draft_path": (str(Path(ns.draft_model_path).resolve()) if ns.draft_model_path
                           else None)}
    entry, args = "specdial.launch.check:run_rank", {"cases": [case]}
    if options.node_rank > 0:
        return run_worker_node(options, entry, args)
    torch.set_num_threads(1)
    ref = forward_outputs(**case)
    tp, procs = start_rank0(options, entry, args)
    with procs:
        try:
            got = forward_outputs(tp=tp, **case)
        finally:
            destroy_group()
    diffs = compare(ref, got)
    for k, (abs_diff, rel) in diffs.items():
        print(f"{k:16s} max|diff| {abs_diff:.3e}  relative {rel:.3e}")
    line, code = verdict(diffs, ns.rtol, ns.tp_size)
    print(line)
    return code


def verdict(diffs: dict[str, tuple[float, float]], rtol: float, tp_size: int) -> tuple[str, int]:
    """The closing line of the check and its exit status: ``PASS: ...`` (0) when every
    relative difference of ``diffs`` (from :func:`compare`) is at most ``rtol``, else
    ``FAIL: ...`` naming the outputs beyond it (1)."""
    worst_key = max(diffs, key=lambda k: diffs[k][1])
    worst = diffs[worst_key][1]
    bad = [k for k, (_, rel) in diffs.items() if rel > rtol]
    if not bad:
        return (f"PASS: tp {tp_size} matches tp 1 within --rtol {rtol:g} (worst relative "
                f"difference {worst:.3e}, {worst_key})", 0)
    return (f"FAIL: tp {tp_size} differs from tp 1 beyond --rtol {rtol:g} in "
            f"{', '.join(bad)} (worst relative difference {worst:.3e}, {worst_key})", 1)


if __name__ == "__main__":
    sys.exit(main())
