"""Acceptance and speed gates of the built-in models (issue 4).

``python -m tools.builtin_models.gates`` (needs :class:`specdial.engine.Engine`):

- acceptance: mean ``meta_info["spec_accept_length"]`` at fixed ``steps = 3``, greedy, per
  drafter (EAGLE head, draft model) on ``--num-prompts`` evenly spaced prompts of
  ``code.jsonl``, ``hard.jsonl`` and ``prose.jsonl``;
- speed: batch size 1, greedy, float32 on ``code.jsonl``: no speculation and EAGLE steps 3
  (and the draft model) alternate prompt by prompt in one process; tokens/s ratio;
- a sample greedy continuation.

``python -m tools.builtin_models.gates --simulate`` needs no engine: it computes the target's greedy
continuation with ``transformers`` and replays chain drafting at steps 3 exactly (greedy
drafts are accepted while they match that continuation; the draft model's step ``i`` is its
teacher-forced argmax, the EAGLE head's step ``i`` is pass ``i`` of
:func:`tools.builtin_models.train.eagle_train_forward`, which attends to the keys chain drafting
holds).

``--record`` stores the figures in ``builtin/training_stats.json`` and re-renders
``MODEL_CARD.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tools.builtin_models.prompts import REPO_PROMPTS, read_jsonl

STEPS = 3


def pick(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """``n`` evenly spaced rows (deterministic)."""
    if n >= len(rows):
        return rows
    return [rows[i * len(rows) // n] for i in range(n)]


# ----------------------------------------------------------------------------- simulation

def _accept_lengths(match: list[np.ndarray], start: int, end: int, steps: int = STEPS) -> float:
    """Replay chain drafting over positions ``start..end``.

    ``match[i][p]``: draft step ``i + 1`` proposed at last-token position ``p`` is correct
    (given the earlier steps were). Returns the mean acceptance length per verify, counting
    like the engine: ``(completion_tokens - 1) / verifies``, the first token from prefill.
    """
    pos, verifies, emitted = start, 0, 0
    while pos < end:
        a = 0
        while a < steps and pos + a < end and match[a][pos]:
            a += 1
        emitted += min(a + 1, end - pos)
        pos += a + 1
        verifies += 1
    return emitted / max(verifies, 1)


@torch.no_grad()
def simulate(builtin: Path, prompts_dir: Path, num_prompts: int, max_new_tokens: int,
             threads: int) -> dict[str, Any]:
    from tokenizers import Tokenizer

    from tools.builtin_models.train import _shift_right, eagle_train_forward, load_hf
    from specdial.models import load_eagle_head, load_model

    torch.set_num_threads(threads)
    tok = Tokenizer.from_file(str(builtin / "target" / "tokenizer.json"))
    target = load_hf(builtin / "target")
    draft = load_hf(builtin / "draft")
    target_sd = load_model(builtin / "target")
    head = load_eagle_head(builtin / "eagle", target_sd)
    rows_out = []
    for name in ("code", "hard", "prose"):
        rows = pick(read_jsonl(prompts_dir / f"{name}.jsonl"), num_prompts)
        acc = {"eagle": [], "draft": []}
        agree = {"eagle": np.zeros(STEPS), "draft": np.zeros(STEPS)}
        npos = 0
        for r in rows:
            ids = torch.tensor([tok.encode(r["prompt"]).ids])
            p_len = ids.shape[1]
            seq = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0]
            n = seq.shape[0]
            x = seq[None]
            # sequence positions p = P-1 .. n-2: a draft at p proposes x_{p+1}; the first
            # decode iteration starts at the prefill token x_P (position P)
            start, end = p_len, n - 1
            # draft model: step i proposes argmax at p + i - 1 (teacher forced)
            d_pred = draft(input_ids=x).logits[0].argmax(-1)  # [n]: predicts x_{p+1}
            ok = torch.zeros(n, dtype=torch.bool)
            ok[:-1] = d_pred[:-1] == seq[1:]
            dm = [torch.roll(ok, -i).numpy() for i in range(STEPS)]  # dm[i][p] = ok[p + i]
            # EAGLE: pass j at position p + j - 1
            h = target.model(input_ids=x).last_hidden_state
            kv: list = []
            hid = _shift_right(h)
            em = []
            for j in range(STEPS):
                f, kvj = eagle_train_forward(head, x, hid, kv)
                kv.append(kvj)
                pred = head.lm_head(f[0]).argmax(-1)
                okj = torch.zeros(n, dtype=torch.bool)
                okj[:-1] = pred[:-1] == seq[1:]
                em.append(torch.roll(okj, -j).numpy())
                hid = _shift_right(f)
            acc["draft"].append(_accept_lengths(dm, start, end))
            acc["eagle"].append(_accept_lengths(em, start, end))
            for j in range(STEPS):
                agree["draft"][j] += dm[j][start:end].sum()
                agree["eagle"][j] += em[j][start:end].sum()
            npos += end - start
        for d in ("eagle", "draft"):
            rows_out.append({"prompts": f"{name}.jsonl ({len(rows)})", "drafter": d,
                             "accept_length": round(float(np.mean(acc[d])), 3),
                             "agree": " / ".join(f"{a / npos:.2f}" for a in agree[d])})
            print(rows_out[-1], flush=True)
    return {"description": f"{num_prompts} evenly spaced prompts per file, {max_new_tokens} "
                           "greedy target tokens each, chain drafting at steps 3 replayed "
                           "exactly (see tools/builtin_models/gates.py); agreement = teacher-forced "
                           "top-1 agreement of draft steps 1 / 2 / 3",
            "rows": rows_out}


# ----------------------------------------------------------------------------- engine gates

def engine_gates(builtin: Path, prompts_dir: Path, num_prompts: int, max_new_tokens: int,
                 speed_prompts: int, threads: int) -> dict[str, Any]:
    from specdial.engine import Engine

    torch.set_num_threads(threads)
    common = dict(model_path=str(builtin / "target"), device="cpu", dtype="float32",
                  max_running_requests=1, kv_cache_tokens=2048)
    engines = {
        None: Engine(speculative_algorithm=None, **common),
        "eagle": Engine(draft_model_path=str(builtin / "eagle"), speculative_algorithm="EAGLE",
                        speculative_num_steps=STEPS, speculative_adaptive=False, **common),
        "draft": Engine(draft_model_path=str(builtin / "draft"), speculative_algorithm="DRAFT",
                        speculative_num_steps=STEPS, speculative_adaptive=False, **common),
    }
    sp = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    acceptance = []
    for name in ("code", "hard", "prose"):
        rows = pick(read_jsonl(prompts_dir / f"{name}.jsonl"), num_prompts)
        for d in ("eagle", "draft"):
            outs = engines[d].generate([r["prompt"] for r in rows], sampling_params=sp)
            acc = [o["meta_info"]["spec_accept_length"] for o in outs]
            acceptance.append({"prompts": f"{name}.jsonl ({len(rows)})", "drafter": d,
                               "accept_length": round(float(np.mean(acc)), 3)})
            print(acceptance[-1], flush=True)
    # speed: batch size 1, alternate the engines prompt by prompt
    rows = pick(read_jsonl(prompts_dir / "code.jsonl"), speed_prompts)
    for e in engines.values():  # warm-up
        e.generate(rows[0]["prompt"], sampling_params=sp)
    secs = {k: 0.0 for k in engines}
    toks = {k: 0 for k in engines}
    same = True
    for r in rows:
        outs = {}
        for k, e in engines.items():
            t0 = time.perf_counter()
            o = e.generate(r["prompt"], sampling_params=sp)
            secs[k] += time.perf_counter() - t0
            toks[k] += o["meta_info"]["completion_tokens"]
            outs[k] = o["output_ids"]
        same &= outs[None] == outs["eagle"] == outs["draft"]
    tps = {k: toks[k] / secs[k] for k in engines}
    speed = {"prompts": len(rows), "max_new_tokens": max_new_tokens,
             "baseline_tok_s": round(tps[None], 1), "eagle_tok_s": round(tps["eagle"], 1),
             "ratio": round(tps["eagle"] / tps[None], 2), "draft_tok_s": round(tps["draft"], 1),
             "draft_ratio": round(tps["draft"] / tps[None], 2), "outputs_identical": same}
    print(speed, flush=True)
    r = rows[0]
    sample = {"id": r["id"], "prompt": r["prompt"],
              "completion": engines[None].generate(r["prompt"], sampling_params=sp)["text"]}
    return {"description": f"{num_prompts} evenly spaced prompts per file, {max_new_tokens} new "
                           "tokens (ignore_eos), greedy, float32, fixed steps 3, batch of all "
                           "prompts per file", "acceptance": acceptance, "speed": speed,
            "sample": sample, "threads": threads}


def main(argv: list[str] | None = None) -> None:
    from tools.builtin_models.train import PACKAGE_BUILTIN, stage_card, update_stats

    ap = argparse.ArgumentParser(prog="python -m tools.builtin_models.gates", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--builtin", type=Path, default=PACKAGE_BUILTIN)
    ap.add_argument("--prompts", type=Path, default=REPO_PROMPTS)
    ap.add_argument("--simulate", action="store_true", help="no engine: replay chain drafting")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--speed-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", action="store_true",
                    help="store the figures in training_stats.json and rewrite MODEL_CARD.md")
    args = ap.parse_args(argv)
    if args.simulate:
        res = simulate(args.builtin, args.prompts, args.num_prompts, args.max_new_tokens,
                       args.threads)
        key = "simulated_acceptance"
    else:
        res = engine_gates(args.builtin, args.prompts, args.num_prompts, args.max_new_tokens,
                           args.speed_prompts, args.threads)
        key = "gates"
        res["command"] = " ".join(["python -m tools.builtin_models.gates"] + (
            sys.argv[1:] if argv is None else list(argv)))
    print(json.dumps(res, indent=2))
    if args.record:
        update_stats(args.builtin, key, res)
        stage_card(args.builtin)


if __name__ == "__main__":
    main()
