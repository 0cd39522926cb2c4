"""``specdial generate``: one completion, and statistics that explain themselves (issue 26).

What it prints (text mode), in order:

- the prompt and the completion, as one text (the completion continues the prompt);
- the speculation block: the algorithm, the policy that ran and its bounds (the strategy and
  each batch-size slot's candidate steps, or the fixed steps), whether the policy started from
  this machine's policy cache (:mod:`specdial.engine.policy_cache`), the acceptance length (one
  definition everywhere: tokens emitted per verify that carried drafts, accepted drafts + 1;
  SGLang's ``ema_accept_len`` counts accepted drafts only and is not shown), the verifies and
  the steps histogram. With speculation off (``--speculative-algorithm NONE``) the block says so
  and nothing about verifies;
- the time block: start-up (loading the models and building the engine) apart from generation
  (the ``generate`` call, prefill included) and its tokens/s; with ``--compare-no-spec`` the
  same generation without speculation on the same loaded target, and the speed-up;
- why runs differ: wall times on a shared machine vary run to run, the adaptive policy follows
  measured times (so its steps, and hence the acceptance length, can differ between runs with
  identical text); temperature 0 or ``--seed`` fixes the text; ``--no-speculative-adaptive
  --speculative-num-steps K`` fixes the steps.

``--json`` prints one object with the same facts. A progress bar (tqdm, on stderr when it is
a terminal) counts the tokens of each generation.
"""

from __future__ import annotations

import json
import time
from typing import Any

__all__ = ["format_generation", "policy_description", "run_generation"]

NOISE_NOTE = ("why runs differ: wall times on a shared machine vary from run to run (other "
              "processes, CPU frequency); the adaptive policy chooses steps from measured times, "
              "so its steps, and with them the acceptance length, can differ between runs that "
              "print the same text. --temperature 0 (greedy) or --seed fixes the text; "
              "--no-speculative-adaptive --speculative-num-steps K fixes the steps; "
              "--compare-no-spec times the same generation without speculation in this process.")
#: The note without speculation: only the machine's timing noise and the seed apply.
NOISE_NOTE_PLAIN = ("why runs differ: wall times on a shared machine vary from run to run (other "
                    "processes, CPU frequency). --temperature 0 (greedy) or --seed fixes the "
                    "text.")


def policy_description(engine: Any) -> str:
    """The policy that ran and its bounds, in words: ``adaptive goodput, candidate steps per
    batch-size slot: 1+: 0-7, 128+: 0-5, 256+: 0-3``, ``fixed steps 3``, or ``off``."""
    if getattr(engine, "speculative_algorithm", None) is None:
        return "off (plain decoding)"
    config = getattr(engine, "adaptive_config", None)
    if config is None:
        sched = engine.scheduler  # None in the serving process of replica processes
        fixed = sched.fixed_steps if sched is not None else engine.replicas[0].info["fixed_steps"]
        return f"fixed steps {fixed}" if fixed is not None else "a test schedule"
    slots = []
    for key, value in json.loads(config.to_json()).items():
        if key.isdigit():
            steps = value.get("candidate_steps", [])
            span = (f"{steps[0]}-{steps[-1]}" if steps == list(range(steps[0], steps[-1] + 1))
                    and len(steps) > 1 else ",".join(map(str, steps)))
            slots.append((int(key), f"{key}+: {span}"))
    bounds = "; ".join(text for _, text in sorted(slots))
    return f"adaptive {config.strategy}, candidate steps per batch-size slot: {bounds}"


def _generate(engine: Any, prompt: str, params: dict[str, Any], desc: str,
              warm_up: bool = False) -> tuple[dict, float]:
    """One timed generation, streamed so a progress bar can count its tokens. ``warm_up``: a
    4-token generation first, untimed (the first passes of an engine pay one-time costs, which
    would tilt a comparison of two engines)."""
    from tqdm import tqdm

    if warm_up:
        engine.generate(prompt, {**params, "max_new_tokens": min(4, params["max_new_tokens"])})

    out: dict[str, Any] = {}
    with tqdm(total=params.get("max_new_tokens"), desc=desc, unit="tok", leave=False,
              disable=None) as bar:
        start = time.perf_counter()
        for out in engine.generate(prompt, params, stream=True):
            bar.update(int(out["meta_info"].get("completion_tokens", 0)) - bar.n)
        seconds = time.perf_counter() - start
    return out, seconds


def _no_spec_engine(engine: Any, cfg: Any) -> Any:
    """An engine without a drafter over ``engine``'s loaded target (no second load)."""
    from specdial.engine.core import Engine

    c = cfg.engine_config()
    return Engine.from_modules(
        engine.target, None, engine.tokenizer, max_running_requests=c.max_running_requests,
        kv_cache_tokens=c.kv_cache_tokens, page_size=c.page_size,
        context_length=c.context_length, max_prefill_tokens=c.max_prefill_tokens,
        log_interval_s=None, disable_cuda_graph=c.disable_cuda_graph, policy_cache=False)


def run_generation(engine: Any, cfg: Any, startup_seconds: float) -> dict[str, Any]:
    """Runs ``cfg``'s generation on ``engine`` (then, with ``cfg.compare_no_spec``, without
    speculation) and returns the report :func:`format_generation` prints. Shuts ``engine``
    down (the policy cache is saved then). Raises what ``Engine.generate`` raises
    (``RequestError``, a ``ValueError``) for a rejected prompt or sampling option."""
    params = cfg.sampling_params()
    algorithm = getattr(engine, "speculative_algorithm", None)
    try:
        out, seconds = _generate(engine, cfg.prompt, params, "generate",
                                 warm_up=cfg.compare_no_spec)
        policy = policy_description(engine)
    finally:
        engine.shutdown()
    report: dict[str, Any] = {
        "prompt": cfg.prompt, "text": out.get("text", ""), "output_ids": out.get("output_ids", []),
        "meta_info": out["meta_info"], "seconds": seconds, "startup_seconds": startup_seconds,
        "speculative_algorithm": algorithm, "policy": policy,
        "policy_cache": engine.stats().policy_cache, "no_spec": None,
        "verify_lengths": engine.stats().verify_length_histogram,
        "tree_nodes": engine.stats().tree_node_histogram}
    if cfg.compare_no_spec and algorithm is not None:
        plain = _no_spec_engine(engine, cfg)
        try:
            base, base_s = _generate(plain, cfg.prompt, params, "without speculation",
                                     warm_up=True)
        finally:
            plain.shutdown()
        report["no_spec"] = {"seconds": base_s,
                             "completion_tokens": base["meta_info"]["completion_tokens"],
                             "same_text": base.get("output_ids") == out.get("output_ids")}
    return report


def _hist_text(hist: dict | None) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted((hist or {}).items())) or "-"


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f} tokens/s" if seconds > 0 else "-"


def format_generation(report: dict[str, Any]) -> str:
    """The text ``specdial generate`` prints for a :func:`run_generation` report."""
    m = report["meta_info"]
    n = int(m.get("completion_tokens", 0))
    finish = (m.get("finish_reason") or {}).get("type", "?")
    algorithm = report.get("speculative_algorithm")
    lines = [f"--- prompt ({m.get('prompt_tokens', 0)} tokens) + completion ({n} tokens, "
             f"finish: {finish}) ---", report.get("prompt", "") + report.get("text", ""),
             f"--- speculation: {algorithm or 'off'} ---",
             f"policy             {report.get('policy', '?')}"]
    if algorithm is not None:
        hist = m.get("spec_steps_histogram") or {}
        drafting = sum(v for k, v in hist.items() if int(k) > 0)
        hist_text = ", ".join(f"{k}: {v}" for k, v in sorted(hist.items(), key=lambda kv: int(kv[0])))
        lines += [
            f"policy cache       {report.get('policy_cache')}",
            f"acceptance length  {float(m.get('spec_accept_length', 0.0)):.2f} tokens per verify "
            "with drafts (accepted drafts + 1)",
            f"verifies           {m.get('spec_verify_ct', 0)} decode iterations, {drafting} with "
            "drafts (steps 0 is a plain decode)",
            f"steps histogram    {hist_text or '-'} (steps: decode iterations)",
            f"verify lengths     {_hist_text(report.get('verify_lengths'))} (chains: drafts "
            "verified per request: decode iterations)",
            f"tree nodes         {_hist_text(report.get('tree_nodes'))} (draft trees: nodes "
            "verified per request: decode iterations)"]
    seconds = float(report["seconds"])
    lines += ["--- time ---",
              f"start-up           {report.get('startup_seconds', 0.0):.2f} s (loading the models "
              "and building the engine; not in the rates below)",
              f"generation         {seconds:.2f} s, {_rate(n, seconds)} (prefill included)"]
    base = report.get("no_spec")
    if base is not None:
        bs = float(base["seconds"])
        speedup = f", speed-up {bs / seconds:.2f}x" if seconds > 0 else ""
        same = "same text" if base["same_text"] else "different text (sampling without a seed)"
        lines.append(f"no speculation     {bs:.2f} s, {_rate(int(base['completion_tokens']), bs)}"
                     f"{speedup} (one run each; {same})")
    lines.append(NOISE_NOTE if algorithm is not None else NOISE_NOTE_PLAIN)
    return "\n".join(lines)
