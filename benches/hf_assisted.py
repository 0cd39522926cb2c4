"""specdial against Hugging Face transformers' assisted generation (issue 29), same draft model.

Pinned comparison (the issue's "Done means"): the built-in target and the built-in draft model,
loaded by transformers as ``LlamaForCausalLM`` in float32 (the same files specdial loads; see
``tests/test_builtin_models.py``), one torch thread for both (``torch.set_num_threads(1)`` and
the engines' ``cpu_threads=1``), greedy, ``--tokens`` (48) new tokens per prompt without
stopping at EOS (specdial's ``ignore_eos``; transformers with ``eos_token_id=None``), batch
size 1, one warm-up per arm. transformers' assistant schedule, two arms:

- ``hf_default``: the installed version's own defaults, untouched. In transformers 5.x these
  are ``num_assistant_tokens_schedule="constant"``, 20 assistant tokens, and an assistant
  confidence threshold of 0.4 (the draft stops early below it; without scikit-learn the
  threshold is not re-fitted). transformers 4.x defaulted to ``"heuristic"``.
- ``hf_heuristic``: ``num_assistant_tokens_schedule="heuristic"`` (+2 assistant tokens after an
  all-accepted verify, -1 otherwise, carried over between calls in the draft's
  ``generation_config``), the schedule the issue names.

The version and each arm's effective schedule fields are printed with the figures.

specdial arms, with the built-in draft model: ``chain_adaptive`` (goodput policy over chains),
``tree_adaptive`` (the policy with trees up to ``--topk`` / ``--num-draft-tokens``),
``tree_fixed`` (the fixed tree ``(--fixed-steps, --topk, --fixed-tree-tokens)``) and
``chain_fixed``: one arm ``chain_fixed<k>`` per depth ``k`` of ``--chain-steps`` (a fixed chain
of ``k`` drafts every iteration, no adaptation), to find the best fixed depth in the same
script; the engines are :func:`tree_ab.build`'s. Every engine starts with
``policy_cache=False`` (nothing read from or written to this machine's policy cache, so a run
does not depend on earlier runs) and keeps its policy state over the whole run (warm-up, every
repetition, both datasets), as a server would.

Each repetition runs every arm in turn (order rotated per repetition) over the same code and
prose prompts (``tree_ab.PROMPTS``), one request at a time. Reported per dataset and arm:
the depth histogram (``depths``: ``{verify length: request-iterations}`` of chain iterations,
``engine.stats().verify_length_histogram`` summed over the run's repetitions; trees' node
counts under ``tree_nodes``),
median output tokens per wall second (``datasets``) and per CPU second of this process
(``datasets_cpu``: every thread, the engine loop's included), and for each specdial arm the
median of the paired per-repetition ratios to each HF arm with a 90 % bootstrap interval of that median (``--bootstrap``
resamples of the repetitions, percentiles 5 and 95). Outputs are compared token by token:
both are the target's greedy decoding, so every specdial arm must emit exactly transformers'
tokens (``identical``). Speed is never asserted; the load average is printed beside it.

Usage: ``nice -n 19 .venv/bin/python benches/hf_assisted.py [--repeats 9] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tree_ab  # noqa: E402  (a sibling script: its prompts and its engines)

SPECDIAL_ARMS = ("chain_adaptive", "tree_adaptive", "tree_fixed", "chain_fixed")
#: wall time, and the CPU time of this process (``time.process_time``: every thread, the
#: engine loop's included; far less disturbed than wall time on a busy machine)
CLOCKS = ("wall", "cpu")


HF_SCHEDULES = ("default", "heuristic")


def load_hf(schedules: list[str]):
    """(target, {arm: draft}, tokenizer) as transformers loads the built-in models, float32.

    One draft model per schedule (``hf_default``: the installed version's defaults untouched;
    ``hf_heuristic``: ``num_assistant_tokens_schedule="heuristic"``), because the heuristic keeps
    its number of assistant tokens in the draft's ``generation_config`` between calls.
    """
    import transformers

    from specdial.builtin import builtin_model_path

    def one(name: str):
        model = transformers.LlamaForCausalLM.from_pretrained(
            str(builtin_model_path(name)), dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # as specdial's ignore_eos: never stop early
        return model

    drafts = {}
    for sched in schedules:
        drafts[f"hf_{sched}"] = d = one("draft")
        if sched != "default":
            d.generation_config.num_assistant_tokens_schedule = sched
    tok = transformers.AutoTokenizer.from_pretrained(str(builtin_model_path("draft")))
    return one("target"), drafts, tok


def hf_run(target, draft, prompts: list[list[int]], tokens: int
           ) -> tuple[tuple[float, float], list[list[int]]]:
    """((output tokens per wall second, per CPU second), new token ids per prompt) of
    transformers' assisted greedy decoding."""
    outs, n = [], 0
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = target.generate(x, attention_mask=torch.ones_like(x), assistant_model=draft,
                                do_sample=False, max_new_tokens=tokens, eos_token_id=None,
                                pad_token_id=0)
            new = y[0, len(ids):].tolist()
            outs.append(new)
            n += len(new)
    return (n / (time.perf_counter() - start), n / (time.process_time() - cpu)), outs


def histograms(engine) -> tuple[dict[int, int], dict[int, int]]:
    """The engine's cumulative ``(verify_length_histogram, tree_node_histogram)`` now."""
    s = engine.stats()
    return dict(s.verify_length_histogram), dict(s.tree_node_histogram)


def add_delta(into: dict[int, int], after: dict[int, int], before: dict[int, int]) -> None:
    """``into[k] += after[k] - before[k]`` for every key of ``after`` that grew."""
    for k, v in after.items():
        if v != before.get(k, 0):
            into[k] = into.get(k, 0) + v - before.get(k, 0)


def specdial_run(engine, prompts: list[list[int]], tokens: int
                 ) -> tuple[tuple[float, float], float, list[list[int]]]:
    """((output tokens per wall second, per CPU second of the process), mean acceptance
    length, output ids per prompt), one request at a time."""
    sp = {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True}
    outs, n, accept = [], 0, []
    start, cpu = time.perf_counter(), time.process_time()
    for ids in prompts:
        o = engine.generate(input_ids=ids, sampling_params=sp)
        outs.append(list(o["output_ids"]))
        n += o["meta_info"]["completion_tokens"]
        accept.append(o["meta_info"].get("spec_accept_length") or 1.0)
    return ((n / (time.perf_counter() - start), n / (time.process_time() - cpu)),
            statistics.mean(accept), outs)


def bootstrap_median(xs: list[float], resamples: int, seed: int = 0) -> tuple[float, float]:
    """90 % percentile-bootstrap interval (5th, 95th) of the median of ``xs``."""
    rng = np.random.default_rng(seed)
    a = np.asarray(xs, np.float64)
    meds = np.median(a[rng.integers(0, len(a), (resamples, len(a)))], axis=1)
    return float(np.percentile(meds, 5)), float(np.percentile(meds, 95))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--datasets", default="code,prose")
    p.add_argument("--n-prompts", type=int, default=6)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--num-draft-tokens", type=int, default=16)
    p.add_argument("--fixed-steps", type=int, default=3)
    p.add_argument("--fixed-tree-tokens", type=int, default=8)
    p.add_argument("--chain-steps", default="3",
                   help="depths of the chain_fixed arms, comma-separated (each in 1..7): one "
                        "arm chain_fixed<k> per depth")
    p.add_argument("--arms", default=",".join(SPECDIAL_ARMS),
                   help=f"specdial arms, a subset of {','.join(SPECDIAL_ARMS)}")
    p.add_argument("--hf-schedules", default=",".join(HF_SCHEDULES),
                   help="transformers arms: 'default' (the installed version's own defaults) "
                        "and/or 'heuristic' (num_assistant_tokens_schedule='heuristic')")
    p.add_argument("--bootstrap", type=int, default=10000)
    p.add_argument("--trace-dir", default=None,
                   help="a directory: each specdial arm records its per-verify trace there "
                        "(<arm>.jsonl, the engine's record_trace: steps, accepted drafts, "
                        "measured and predicted seconds per decode iteration)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    for a in args.arms.split(","):
        if a not in SPECDIAL_ARMS:
            p.error(f"--arms: unknown arm {a!r}; allowed: {', '.join(SPECDIAL_ARMS)}")
    for sch in args.hf_schedules.split(","):
        if sch not in HF_SCHEDULES:
            p.error(f"--hf-schedules: unknown schedule {sch!r}; allowed: "
                    f"{', '.join(HF_SCHEDULES)}")
    for d in args.datasets.split(","):
        if d not in tree_ab.PROMPTS:
            p.error(f"--datasets: unknown dataset {d!r}; allowed: {', '.join(tree_ab.PROMPTS)}")
    try:
        args.chain_steps = [int(k) for k in args.chain_steps.split(",")]
    except ValueError:
        p.error(f"--chain-steps: integers in 1..7 expected, got {args.chain_steps!r}")
    if not all(1 <= k <= 7 for k in args.chain_steps):
        p.error(f"--chain-steps: each depth must be in 1..7, got {args.chain_steps}")
    args.drafter, args.cpu_threads = "draft", 1  # tree_ab.build's fields: pinned here
    return args


def build_engines(args: argparse.Namespace) -> dict:
    """``{arm: engine}``; ``chain_fixed`` becomes one arm ``chain_fixed<k>`` per
    ``--chain-steps`` depth (a fixed chain: :func:`tree_ab.build`'s ``chain_fixed`` with
    ``fixed_steps = k``)."""
    def extra(name: str) -> dict:
        if args.trace_dir is None:
            return {}
        os.makedirs(args.trace_dir, exist_ok=True)
        path = Path(args.trace_dir) / f"{name}.jsonl"
        path.unlink(missing_ok=True)  # the engine appends
        return {"record_trace": str(path)}

    engines = {}
    for a in args.arms.split(","):
        if a == "chain_fixed":
            for k in args.chain_steps:
                engines[f"chain_fixed{k}"] = tree_ab.build(
                    "chain_fixed", argparse.Namespace(**{**vars(args), "fixed_steps": k}),
                    **extra(f"chain_fixed{k}"))
        else:
            engines[a] = tree_ab.build(a, args, **extra(a))
    return engines


def measure(args: argparse.Namespace, hf, engines: dict, prompts: dict) -> dict:
    """Every repetition: each arm (rotated) over each dataset's prompts -> raw figures
    (``rates[clock][dataset][arm]``, clock ``wall`` or ``cpu``)."""
    target, drafts, _ = hf
    arms = [*drafts, *engines]
    rates = {c: {d: {a: [] for a in arms} for d in prompts} for c in CLOCKS}
    accepts = {d: {a: [] for a in engines} for d in prompts}
    depths = {d: {a: {"depths": {}, "tree_nodes": {}} for a in engines} for d in prompts}
    identical, first = True, {}
    for r in range(args.repeats):
        for a in arms[r % len(arms):] + arms[: r % len(arms)]:
            for d, ps in prompts.items():
                if a in drafts:
                    rate, got = hf_run(target, drafts[a], ps, args.tokens)
                else:
                    before = histograms(engines[a])
                    rate, acc, got = specdial_run(engines[a], ps, args.tokens)
                    accepts[d][a].append(acc)
                    for key, b4, now in zip(("depths", "tree_nodes"), before,
                                            histograms(engines[a])):
                        add_delta(depths[d][a][key], now, b4)
                for c, x in zip(CLOCKS, rate):
                    rates[c][d][a].append(x)
                identical &= got == first.setdefault(d, got)
    return {"rates": rates, "accepts": accepts, "depths": depths, "identical": identical}


def summarize(args: argparse.Namespace, raw: dict, hf_arms: list[str], clock: str) -> dict:
    """Medians per arm; per HF arm, each specdial arm's paired ratios with a bootstrap
    interval, by ``clock``."""
    out = {}
    for d, by_arm in raw["rates"][clock].items():
        row = {"tokens_per_s": {a: statistics.median(v) for a, v in by_arm.items()},
               "accept_length": {a: statistics.median(v) for a, v in raw["accepts"][d].items()},
               "depths": {a: {key: dict(sorted(h.items())) for key, h in v.items()}
                          for a, v in raw["depths"][d].items()},
               "ratio_to": {}}
        for base in hf_arms:
            row["ratio_to"][base] = {}
            for a, v in by_arm.items():
                if a not in hf_arms:
                    ratios = [x / y for x, y in zip(v, by_arm[base])]
                    lo, hi = bootstrap_median(ratios, args.bootstrap)
                    row["ratio_to"][base][a] = {"median": statistics.median(ratios),
                                                "ci90": [lo, hi], "ratios": ratios}
        out[d] = row
    return out


def describe_hf(drafts: dict) -> dict:
    """transformers' version and each HF arm's effective assistant schedule after the run."""
    import importlib.util

    import transformers

    defaults = transformers.GenerationConfig._get_default_generation_params()
    keys = ("num_assistant_tokens_schedule", "num_assistant_tokens",
            "assistant_confidence_threshold")
    arms = {a: {k: getattr(d.generation_config, k) if getattr(d.generation_config, k) is not None
                else defaults[k] for k in keys} for a, d in drafts.items()}
    # without scikit-learn transformers keeps the confidence threshold fixed (no ROC update)
    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "hf_arms": arms,
            "sklearn_available": importlib.util.find_spec("sklearn") is not None}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    datasets = args.datasets.split(",")
    hf = load_hf(args.hf_schedules.split(","))
    prompts = {d: [hf[2].encode(p) for p in tree_ab.PROMPTS[d][: args.n_prompts]]
               for d in datasets}
    load = os.getloadavg()
    engines = build_engines(args)
    try:
        warm = prompts[datasets[0]][:1]
        for draft in hf[1].values():
            hf_run(hf[0], draft, warm, args.tokens)
        for e in engines.values():
            specdial_run(e, warm, args.tokens)
        raw = measure(args, hf, engines, prompts)
    finally:
        for e in engines.values():
            e.shutdown()
    result = {"args": vars(args), **describe_hf(hf[1]), "load_before": load,
              "load_after": os.getloadavg(), "identical": raw["identical"],
              "datasets": summarize(args, raw, list(hf[1]), "wall"),
              "datasets_cpu": summarize(args, raw, list(hf[1]), "cpu")}
    if args.json:
        print(json.dumps(result))
        return
    print(f"transformers {result['transformers']}, torch {result['torch']}, "
          f"{result['torch_threads']} thread, HF arms {result['hf_arms']}, "
          f"sklearn {result['sklearn_available']}")
    for clock, key in (("wall", "datasets"), ("cpu", "datasets_cpu")):
        for d, row in result[key].items():
            for a, v in row["tokens_per_s"].items():
                acc = row["accept_length"].get(a)
                hist = row["depths"].get(a, {})
                print(f"[{d}, {clock}] {a:15s} {v:7.1f} tok/s"
                      + (f"  accept {acc:.2f}" if acc else "")
                      + (f"  depths {hist['depths']}" if hist.get("depths") else "")
                      + (f"  tree nodes {hist['tree_nodes']}" if hist.get("tree_nodes") else ""))
            for base, by_arm in row["ratio_to"].items():
                for a, rr in by_arm.items():
                    lo, hi = rr["ci90"]
                    print(f"[{d}, {clock}] {a:15s} / {base}: median {rr['median']:.3f} "
                          f"(90 % CI {lo:.3f}-{hi:.3f})")
    print(f"identical {result['identical']}; load {load} -> {result['load_after']}")


if __name__ == "__main__":
    main()
