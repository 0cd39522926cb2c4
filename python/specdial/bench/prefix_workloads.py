"""The prefix-cache workloads of ``specdial bench`` (issue 30) and their part of the report.

- ``--dataset multiturn``: chat conversations of 4-8 turns, each turn resending the history
  (:mod:`specdial.bench.multiturn`); ``--num-prompts`` counts conversations.
- ``--dataset generated-shared-prefix``: SGLang's ``bench_serving`` dataset of that name and
  its ``--gsp-*`` flags: ``--gsp-num-groups`` groups of ``--gsp-prompts-per-group`` requests;
  the requests of a group share one system prompt of ``--gsp-system-prompt-len`` random tokens
  and each adds its own question of ``--gsp-question-len`` random tokens, answered with
  ``--gsp-output-len`` tokens. The run sends groups x prompts-per-group requests (SGLang's
  rule; ``--num-prompts`` is not used), shuffled with the seed. Token ids are drawn uniformly
  from the vocabulary, as the ``random`` dataset's (``--random-vocab-size`` over HTTP).
  SGLang's defaults (64 groups of 16, 2048 + 128 tokens, 256 out) are sized for GPUs; these
  are sized for the CPU.

The report adds the cached prompt tokens, the hit rate and, for multi-turn runs, TTFT per
turn (:func:`prefix_cache_rows`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from specdial.bench.datasets import BenchRequest, DatasetError, build_requests
from specdial.bench.multiturn import conversation_runner, multiturn_conversations

__all__ = ["PREFIX_DATASETS", "PrefixWorkloadOptions", "prefix_cache_rows",
           "prefix_workload_requests", "shared_prefix_requests"]

#: ``--dataset`` names of this module.
PREFIX_DATASETS = ("multiturn", "generated-shared-prefix")


def _opt(help: str, default: Any = None, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class PrefixWorkloadOptions:
    """The options of the two workloads (module docstring)."""

    multiturn_source: str = _opt("--dataset multiturn: where user messages come from (a "
                                 "prompt set or a JSONL file)", default="code",
                                 metavar="NAME|PATH")
    multiturn_min_turns: int = _opt("--dataset multiturn: fewest turns per conversation",
                                    default=4, metavar="N")
    multiturn_max_turns: int = _opt("--dataset multiturn: most turns per conversation",
                                    default=8, metavar="N")
    gsp_num_groups: int = _opt("--dataset generated-shared-prefix: groups (one system prompt "
                               "each; SGLang's flag)", default=4, metavar="N")
    gsp_prompts_per_group: int = _opt("--dataset generated-shared-prefix: requests per group",
                                      default=8, metavar="N")
    gsp_system_prompt_len: int = _opt("--dataset generated-shared-prefix: tokens of a group's "
                                      "system prompt", default=512, metavar="N")
    gsp_question_len: int = _opt("--dataset generated-shared-prefix: tokens of each question",
                                 default=32, metavar="N")
    gsp_output_len: int = _opt("--dataset generated-shared-prefix: output tokens per request",
                               default=64, metavar="N")


def shared_prefix_requests(*, num_groups: int, prompts_per_group: int, system_prompt_len: int,
                           question_len: int, output_len: int, vocab_size: int,
                           seed: int = 0) -> list[BenchRequest]:
    """SGLang's generated-shared-prefix requests (module docstring), shuffled with ``seed``;
    ``index`` is the position after the shuffle. Raises :class:`DatasetError` for a count or
    length below 1."""
    for name, value in (("--gsp-num-groups", num_groups),
                        ("--gsp-prompts-per-group", prompts_per_group),
                        ("--gsp-system-prompt-len", system_prompt_len),
                        ("--gsp-question-len", question_len), ("--gsp-output-len", output_len)):
        if value < 1:
            raise DatasetError(f"{name} must be >= 1, got {value}")
    rng = random.Random(seed)
    reqs = []
    for g in range(num_groups):
        system = tuple(rng.randrange(vocab_size) for _ in range(system_prompt_len))
        for _ in range(prompts_per_group):
            question = tuple(rng.randrange(vocab_size) for _ in range(question_len))
            reqs.append((f"shared-prefix-{g}", system + question))
    rng.shuffle(reqs)
    return [BenchRequest(i, label, None, ids, max_new_tokens=output_len)
            for i, (label, ids) in enumerate(reqs)]


def prefix_workload_requests(cfg: Any, driver: Any, engine: Any
                             ) -> tuple[list[BenchRequest], Any]:
    """The requests of ``cfg.dataset`` (one of :data:`PREFIX_DATASETS`) and the runner that
    sends them (None: the default one). Raises :class:`DatasetError`."""
    if cfg.dataset == "generated-shared-prefix":
        vocab = cfg.random_vocab_size or (engine.vocab_size
                                          if engine is not None else None)
        if vocab is None:
            raise DatasetError("--dataset generated-shared-prefix with --backend http needs "
                               "--random-vocab-size")
        reqs = shared_prefix_requests(
            num_groups=cfg.gsp_num_groups, prompts_per_group=cfg.gsp_prompts_per_group,
            system_prompt_len=cfg.gsp_system_prompt_len, question_len=cfg.gsp_question_len,
            output_len=cfg.gsp_output_len, vocab_size=vocab, seed=cfg.arrival_seed)
        if not all(driver.fits(len(r.input_ids or ()), cfg.gsp_output_len) for r in reqs):
            raise DatasetError("--dataset generated-shared-prefix: the requests do not fit the "
                               "context; lower --gsp-system-prompt-len / --gsp-question-len")
        return reqs, None
    if cfg.request_rate is not None:
        raise DatasetError("--dataset multiturn sends each turn when the previous answer has "
                           "arrived; --request-rate does not apply (bound the conversations in "
                           "flight with --concurrency)")
    messages = build_requests(cfg.multiturn_source, max(cfg.num_prompts, 1) * 8,
                              seed=cfg.arrival_seed, directory=cfg.prompts_dir)
    encode = driver.encode if getattr(driver, "name", "") == "engine" else None
    convs = multiturn_conversations(
        messages, cfg.num_prompts, max_new_tokens=cfg.max_new_tokens, seed=cfg.arrival_seed,
        min_turns=cfg.multiturn_min_turns, max_turns=cfg.multiturn_max_turns, encode=encode,
        fits=driver.fits)
    turns = [t for c in convs for t in c.turns]
    return turns, conversation_runner(convs)


def prefix_cache_rows(summary: dict[str, Any]) -> list[tuple[str, Any]]:
    """The report's prefix-cache rows: cached prompt tokens and hit rate when the engine
    reported them, TTFT (ms, mean and p50) per turn for a multi-turn run."""
    rows: list[tuple[str, Any]] = []
    if summary.get("cached_tokens") is not None:
        rate = summary.get("prefix_cache_hit_rate")
        rows += [("-- Prefix cache --", ""), ("Cached prompt tokens", summary["cached_tokens"]),
                 ("Hit rate (cached / prompt tokens)", "-" if rate is None else f"{rate:.3f}")]
    per_turn = summary.get("ttft_per_turn_s") or {}
    if per_turn:
        rows.append(("-- TTFT per turn (ms): mean / p50 --", ""))
        for turn, s in per_turn.items():
            value = "-" if s["mean"] is None else f"{1e3 * s['mean']:.2f} / {1e3 * s['p50']:.2f}"
            rows.append((f"Turn {turn} ({s['count']} requests)", value))
    return rows
