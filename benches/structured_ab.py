"""Structured outputs under speculation (issue 31): with and without a JSON schema.

    .venv/bin/python benches/structured_ab.py [--concurrency 1,16] [--max-new-tokens 48]
        [--steps 3] [--topk 1] [--num-draft-tokens N] [--repetitions 5] [--threads 1] [--json]

One engine with the built-in models (EAGLE head, fixed ``--steps``; with ``--topk K > 1`` a
fixed draft tree of depth ``--steps``, top-k ``K`` and ``--num-draft-tokens`` nodes, root
excluded) per concurrency ``c``
(``max_running_requests = c``, ``2 c`` prompts per run, all submitted at once), generating at
temperature 1 with a per-prompt seed, alternating round-robin over ``--repetitions``:

- ``none``: no constraint;
- ``schema``: every request under a small JSON schema (``SCHEMA``);
- ``mixed``: half the requests under the schema (the unconstrained half shares its batches).

Reported per concurrency and mode: output tokens per second (median over repetitions), its
ratio to ``none`` of the same repetition (median of the paired ratios), ``cpu_ratio``: the
same tokens per second of process CPU time (all threads; steadier than wall time on a busy
shared machine) as a ratio of medians to ``none``'s, and the acceptance
length (tokens per drafting verify, all requests). The schema's outputs are other texts than
the unconstrained ones (often whitespace), so the acceptance differs for that reason too. Also:
``attach_cost_ns``, what a batch without a grammar pays for structured outputs on each new batch
composition (``attach_grammar``'s all-None check; its decode iterations pay three ``is None``
tests). On a shared CPU the noise floor is 10-30 % (BENCHMARKS.md section 5).

With trees, ``host_ms``: the host time of the grammar's tree hooks
(:class:`~specdial.worker.grammar_tree.TreeGrammar`) per call, median over the schema and
mixed runs' calls: ``level`` (one masked draft level: the frontier's copy wait, the path walks
and mask fills, the upload and the masking), ``verify`` (the verify columns' masks), ``root``
(level 1's mask).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from specdial.bench.datasets import build_requests
from specdial.engine import Engine
from specdial.engine.grammar_gate import attach_grammar
from specdial.worker.batch_sampling import BatchSampling
from specdial.worker.grammar_tree import TreeGrammar
from specdial.worker.sampling_params import SamplingParams

SCHEMA = json.dumps({"type": "object", "properties": {
    "id": {"type": "integer"}, "ok": {"type": "boolean"}, "tag": {"enum": ["a", "b", "c"]}},
    "required": ["id", "ok", "tag"], "additionalProperties": False})
MODES = ("none", "schema", "mixed")


def _params(mode: str, i: int, max_new: int) -> dict[str, Any]:
    p: dict[str, Any] = {"temperature": 1.0, "seed": i, "max_new_tokens": max_new}
    if mode == "schema" or (mode == "mixed" and i % 2 == 0):
        p["json_schema"] = SCHEMA
    return p


def one_concurrency(c: int, args: argparse.Namespace) -> dict[str, Any]:
    prompts = [r.prompt for r in build_requests("code", 2 * c, seed=0)]
    speed: dict[str, list[float]] = {m: [] for m in MODES}
    cpu_speed: dict[str, list[float]] = {m: [] for m in MODES}
    ratio: dict[str, list[float]] = {m: [] for m in MODES}
    tokens_verifies = {m: [0.0, 0] for m in MODES}
    hooks = HookTimes()
    # a tree's scratch slots need room besides one full-context request (the core's check)
    tree = ({} if args.topk == 1 else {"speculative_eagle_topk": args.topk,
                                       "speculative_num_draft_tokens": args.num_draft_tokens + 1,
                                       "kv_cache_tokens": 2048 * (c + 1)})
    with Engine(model_path=None, speculative_algorithm="EAGLE", speculative_adaptive=False,
                speculative_num_steps=args.steps, max_running_requests=c,
                log_interval_s=None, **tree) as engine:
        engine.generate(prompts[:2], [_params("schema", i, 8) for i in range(2)])  # warm-up
        for _ in range(args.repetitions):
            for mode in MODES:
                sps = [_params(mode, i, args.max_new_tokens) for i in range(len(prompts))]
                started, cpu = time.perf_counter(), time.process_time()
                with hooks if mode != "none" else _Nothing():
                    out = engine.generate(prompts, sps)
                seconds = time.perf_counter() - started
                tokens = sum(len(o["output_ids"]) for o in out)
                speed[mode].append(tokens / seconds)
                cpu_speed[mode].append(tokens / (time.process_time() - cpu))
                ratio[mode].append(speed[mode][-1] / speed["none"][-1])
                for o in out:
                    m = o["meta_info"]
                    tokens_verifies[mode][0] += m["spec_accept_length"] * m["spec_verify_ct"]
                    tokens_verifies[mode][1] += m["spec_verify_ct"]
    return {m: {"tokens_per_s": statistics.median(speed[m]),
                "ratio": statistics.median(ratio[m]),
                "cpu_ratio": (statistics.median(cpu_speed[m])
                              / statistics.median(cpu_speed["none"])),
                "accept_length": tokens_verifies[m][0] / max(tokens_verifies[m][1], 1)}
            for m in MODES} | ({"host_ms": hooks.medians()} if args.topk > 1 else {})


class HookTimes:
    """Wall time of :class:`TreeGrammar`'s hooks, per call, while installed (``with``)."""

    HOOKS = {"root": "mask_root", "level": "mask_level", "verify": "mask_verify"}

    def __init__(self) -> None:
        self.ms: dict[str, list[float]] = {k: [] for k in self.HOOKS}
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> "HookTimes":
        for key, name in self.HOOKS.items():
            orig = self._saved[name] = getattr(TreeGrammar, name)

            def timed(*a: Any, _orig: Any = orig, _key: str = key) -> Any:
                t = time.perf_counter()
                out = _orig(*a)
                self.ms[_key].append((time.perf_counter() - t) * 1e3)
                return out

            setattr(TreeGrammar, name, timed)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, orig in self._saved.items():
            setattr(TreeGrammar, name, orig)

    def medians(self) -> dict[str, float | None]:
        return {k: (statistics.median(v) if v else None) for k, v in self.ms.items()}


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def attach_cost_ns(batch: int = 16, calls: int = 2000) -> float:
    sampling = BatchSampling.from_params([SamplingParams()] * batch)
    matchers = [None] * batch
    started = time.perf_counter_ns()
    for _ in range(calls):
        attach_grammar(sampling, matchers, None)
    return (time.perf_counter_ns() - started) / calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--topk", type=int, default=1, help="draft tree top-k (1: chains)")
    p.add_argument("--num-draft-tokens", type=int, default=6,
                   help="tree nodes, root excluded (with --topk > 1)")
    p.add_argument("--repetitions", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {str(c): one_concurrency(int(c), args)
                              for c in args.concurrency.split(",")}
    result["attach_cost_ns"] = attach_cost_ns()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    shape = "" if args.topk == 1 else f", tree topk {args.topk} nodes {args.num_draft_tokens}"
    print(f"steps {args.steps}{shape}, {args.max_new_tokens} tokens max, {args.repetitions} "
          "repetitions, temperature 1")
    for c in args.concurrency.split(","):
        host = result[c].pop("host_ms", None)
        if host is not None:
            print(f"  c={c:>3} host ms per call (median): " + ", ".join(
                f"{k} {v:.3f}" for k, v in host.items() if v is not None))
        for mode, row in result[c].items():
            print(f"  c={c:>3} {mode:>6}: {row['tokens_per_s']:8.1f} tokens/s  "
                  f"ratio {row['ratio']:.3f}  cpu-time ratio {row['cpu_ratio']:.3f}  "
                  f"acceptance length {row['accept_length']:.2f}")
    print(f"  attach_grammar without a grammar: {result['attach_cost_ns']:.0f} ns per batch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
