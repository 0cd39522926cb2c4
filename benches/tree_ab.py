"""Draft trees against chains through the engine (issue 29): paired, alternating, batch size 1.

Arms (built-in target with the built-in draft model or the default EAGLE head, greedy, float32, ``--cpu-threads``):

- ``chain_adaptive``: the goodput policy over chains (``speculative_eagle_topk`` 1);
- ``tree_adaptive``: the same policy with trees up to ``--topk`` and ``--num-draft-tokens``
  (SGLang's counting, the root included) as its bounds;
- ``chain_fixed``: ``--fixed-steps`` drafts a chain every iteration;
- ``tree_fixed``: the fixed tree ``(--fixed-steps, --topk, --fixed-tree-tokens)``;
- ``tree_budget``: ``tree_adaptive`` with per-request node budgets (``"verify": "per_request"``,
  ``"min_survival": "auto"``; issue 29 item 5), paired against ``tree_adaptive``;
- ``tree_budget_padded``: ``tree_budget`` with the CPU path's ragged tree verify turned off
  while it runs (every request of a verify runs the batch's widest kept count + 1 columns, as
  before ragged packing; a bench-only patch of ``tree_step._verify``), paired against
  ``tree_budget``: what ragged packing saves (only at ``--concurrency`` > 1: a batch of one is
  never padded).

Every engine is built once and warmed up; each repetition runs every arm in turn (order
rotated per repetition) over the same prompts, one request at a time (batch size 1), or with
``--concurrency C > 1`` as one list of ``C`` requests submitted together (the prompts cycled;
``max_running_requests`` ``C``, so the batch holds them all), and records output tokens per wall second and per CPU second of the process (see
:func:`run_once`) and the acceptance length (``spec_accept_length``, tokens per verify,
averaged over requests).
Reported: per arm the medians; per pair (trees / chains, adaptive and fixed) the median of the
paired ratios, by each clock. Outputs are checked identical across arms (greedy is lossless). Speed is never
asserted; report the load average printed beside the figures.

Usage: ``nice -n 19 .venv/bin/python benches/tree_ab.py [--repeats 9] [--drafter draft|eagle]
[--prompts code|prose] [--concurrency 64] [--arms chain_adaptive,tree_adaptive] [--json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

PROMPTS = {
    "code": ["def fibonacci(n):", "import os\nimport", "class Stack:\n    def",
             "for i in range(", "def add(a, b):\n    return", "with open(path) as f:"],
    "prose": ["The history of the city", "Once upon a time, there", "In the morning the",
              "The weather today is", "She opened the door and", "Scientists have found"],
}


def build(arm: str, args: argparse.Namespace, **extra):
    """The warm engine of ``arm`` (see the module docstring); ``extra``: more
    :class:`specdial.Engine` keywords (e.g. ``record_trace``)."""
    import specdial
    from specdial.builtin import builtin_model_path

    conc = getattr(args, "concurrency", 1)
    kw = dict(model_path=None, policy_cache=False, log_interval_s=None,
              max_running_requests=conc, kv_cache_tokens=max(4096, 256 * conc),
              cpu_threads=args.cpu_threads)
    if args.drafter == "draft":  # the built-in draft model instead of the default EAGLE head
        kw["draft_model_path"] = str(builtin_model_path("draft"))
    if arm.endswith("fixed"):
        kw.update(speculative_adaptive=False, speculative_num_steps=args.fixed_steps)
    if arm in ("tree_adaptive", "tree_budget", "tree_budget_padded"):
        kw.update(speculative_eagle_topk=args.topk,
                  speculative_num_draft_tokens=args.num_draft_tokens)
    if arm in ("tree_budget", "tree_budget_padded"):
        from specdial._core import AdaptiveConfig

        cfg = json.loads(AdaptiveConfig.default().to_json())
        kw["speculative_adaptive_config"] = {**cfg, "verify": "per_request",
                                             "min_survival": "auto"}
    if arm == "tree_fixed":
        kw.update(speculative_eagle_topk=args.topk,
                  speculative_num_draft_tokens=args.fixed_tree_tokens)
    return specdial.Engine(**{**kw, **extra})


@contextlib.contextmanager
def padded_tree_verify(on: bool):
    """While ``on``: tree verifies without ragged packing (``tree_budget_padded``)."""
    from specdial.worker import tree_step

    real = tree_step._verify
    if on:
        tree_step._verify = lambda *a, **k: real(*a[:8], None)
    try:
        yield
    finally:
        tree_step._verify = real


def run_once(engine, prompts: list[str], tokens: int,
             together: bool = False) -> tuple[float, float, float, list[str]]:
    """(output tokens per wall second, per CPU second of this process, acceptance length,
    texts) of ``prompts`` one at a time, or all submitted together (``together``: one
    ``generate`` call over the list). The CPU clock (``time.process_time``: every thread of
    the process, the engine loop's included, which sleeps while idle) is far less disturbed
    than wall time by other work on a busy machine."""
    sp = {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True}
    start, cpu = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, sp) if together else [engine.generate(p, sp)
                                                           for p in prompts]
    secs, cpu = time.perf_counter() - start, time.process_time() - cpu
    out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    accept = [o["meta_info"].get("spec_accept_length") or 1.0 for o in outs]
    return (out_tokens / secs, out_tokens / cpu, statistics.mean(accept),
            [o["text"] for o in outs])


def paired(rates: dict[str, list[float]], prefix: str) -> dict[str, float]:
    """``{prefix + "tree/chain KIND": median paired ratio}`` for the arm pairs present."""
    out = {}
    for kind in ("adaptive", "fixed"):
        t, c = f"tree_{kind}", f"chain_{kind}"
        if t in rates and c in rates:
            out[f"{prefix}tree/chain {kind}"] = statistics.median(
                x / y for x, y in zip(rates[t], rates[c]))
    for base in ("tree_adaptive", "tree_budget_padded"):
        if "tree_budget" in rates and base in rates:
            out[f"{prefix}tree_budget/{base}"] = statistics.median(
                x / y for x, y in zip(rates["tree_budget"], rates[base]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--drafter", choices=("draft", "eagle"), default="draft")
    p.add_argument("--prompts", choices=tuple(PROMPTS), default="code")
    p.add_argument("--n-prompts", type=int, default=6)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--num-draft-tokens", type=int, default=16)
    p.add_argument("--fixed-steps", type=int, default=3)
    p.add_argument("--fixed-tree-tokens", type=int, default=8)
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=1,
                   help="1: one request at a time; C > 1: C requests submitted together")
    p.add_argument("--arms", default="chain_adaptive,tree_adaptive,chain_fixed,tree_fixed")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    arms = args.arms.split(",")
    if args.concurrency < 1:
        p.error(f"--concurrency must be >= 1, got {args.concurrency}")
    prompts = PROMPTS[args.prompts][: args.n_prompts]
    together = args.concurrency > 1
    if together:  # the prompts cycled to C requests
        prompts = [prompts[i % len(prompts)] for i in range(args.concurrency)]
    load = os.getloadavg()
    engines = {a: build(a, args) for a in arms}
    try:
        for a, e in engines.items():  # warm-up
            with padded_tree_verify(a == "tree_budget_padded"):
                run_once(e, prompts, args.tokens, together) if together else run_once(
                    e, prompts[:1], args.tokens)
        rates: dict[str, list[float]] = {a: [] for a in arms}
        cpu_rates: dict[str, list[float]] = {a: [] for a in arms}
        accepts: dict[str, list[float]] = {a: [] for a in arms}
        identical = True
        for r in range(args.repeats):
            texts = None
            for a in arms[r % len(arms):] + arms[: r % len(arms)]:
                with padded_tree_verify(a == "tree_budget_padded"):
                    rate, cpu_rate, acc, got = run_once(engines[a], prompts, args.tokens,
                                                        together)
                rates[a].append(rate)
                cpu_rates[a].append(cpu_rate)
                accepts[a].append(acc)
                identical &= texts is None or got == texts
                texts = got
    finally:
        for e in engines.values():
            e.shutdown()
    result = {"args": vars(args), "load_before": load, "load_after": os.getloadavg(),
              "identical": identical,
              "tokens_per_s": {a: statistics.median(v) for a, v in rates.items()},
              "tokens_per_cpu_s": {a: statistics.median(v) for a, v in cpu_rates.items()},
              "accept_length": {a: statistics.median(v) for a, v in accepts.items()},
              "raw": {"wall": rates, "cpu": cpu_rates, "accept": accepts},
              **paired(rates, ""), **paired(cpu_rates, "cpu ")}
    if args.json:
        print(json.dumps(result))
        return
    for a in arms:
        print(f"{a:15s} {result['tokens_per_s'][a]:8.1f} tok/s  "
              f"{result['tokens_per_cpu_s'][a]:8.1f} tok/CPU-s  accept "
              f"{result['accept_length'][a]:.2f}")
    for k, v in result.items():
        if "tree/chain" in k or "tree_budget/" in k:
            print(f"{k}: median paired ratio {v:.3f}")
    print(f"identical {identical}; load {load} -> {result['load_after']}")


if __name__ == "__main__":
    main()
