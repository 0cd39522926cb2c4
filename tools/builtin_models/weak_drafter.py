"""``python -m tools.builtin_models.weak_drafter``: the built-in *weak* EAGLE head, for benchmarks.

A low-acceptance workload made honestly: the shipped EAGLE head with Gaussian noise of
``sigma`` times each weight matrix's standard deviation added to every matrix (seeded), so the
drafter disagrees with the target often (acceptance length about 1.5 at steps 3 on code with
sigma 0.4, against 2.8 for the trained head). It is labelled for benchmarking in
``builtin/MODEL_CARD.md``; the engine's default drafter stays the trained head.

Writes ``builtin/eagle-weak`` (config.json, model.safetensors in the head's dtype) and prints the
acceptance it measures with the engine (greedy, fixed steps 3, the first 16 code and prose
prompts, 48 tokens each).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdial.builtin import BUILTIN_DIR, builtin_model_path

SIGMA = 0.4
SEED = 0


def make_weak_head(out: Path, sigma: float = SIGMA, seed: int = SEED) -> None:
    """Writes the perturbed copy of the built-in EAGLE head to ``out``."""
    src = builtin_model_path("eagle")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", out / "config.json")
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        x = w.float()
        if x.ndim >= 2:
            x = x + sigma * x.std() * torch.randn(x.shape, generator=g)
        weights[name] = x.to(w.dtype)
    save_file(weights, str(out / "model.safetensors"))


def measure(head: Path, n: int = 16, tokens: int = 48) -> dict[str, float]:
    """Mean acceptance length (tokens per verify) per prompt set at fixed steps 3, greedy."""
    from specdial.bench.datasets import load_jsonl, prompts_dir
    from specdial.engine import Engine

    out = {}
    engine = Engine(model_path=None, draft_model_path=str(head), speculative_adaptive=False,
                    speculative_num_steps=3, log_interval_s=None)
    try:
        for name in ("code", "prose"):
            prompts = [r.prompt for r in load_jsonl(prompts_dir() / f"{name}.jsonl")[:n]]
            res = engine.generate(prompts, {"max_new_tokens": tokens, "temperature": 0})
            out[name] = sum(r["meta_info"]["spec_accept_length"] for r in res) / len(res)
    finally:
        engine.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sigma", type=float, default=SIGMA)
    parser.add_argument("--out", type=Path, default=BUILTIN_DIR / "eagle-weak")
    args = parser.parse_args(argv)
    make_weak_head(args.out, args.sigma)
    print(json.dumps({"sigma": args.sigma, "acceptance_length_steps3": measure(args.out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
