"""The steps policy an Engine's options describe: fixed, adaptive, or a test schedule.

One meaning for ``speculative_num_steps`` (SGLang's and vLLM's ``num_speculative_tokens``: the
most draft tokens per request per iteration):

- adaptive (``speculative_adaptive=True``): the **upper bound** of adaptation. Candidates above
  it are removed from every slot of the adaptive config (a slot left with none gets ``[K]``),
  so no decode iteration ever runs more steps; the steps start at the largest remaining
  candidate. None: the config's candidates, starting at the middle of their union.
  ``speculative_initial_steps`` (Python only) sets the starting steps instead.
- fixed: the steps of every iteration (default :data:`FIXED_DEFAULT_STEPS`).
"""

from __future__ import annotations

import json
from typing import Any

from specdial._core import (MAX_TREE_NUM_DRAFT_TOKENS, MAX_TREE_TOPK, AdaptiveConfig,
                           ConfigError, validate_draft_tree, validate_initial_steps)
from specdial.config import FIXED_DEFAULT_STEPS

__all__ = ["cap_candidates", "policy_options"]


def cap_candidates(config: AdaptiveConfig, max_steps: int) -> AdaptiveConfig:
    """``config`` with every slot's candidates above ``max_steps`` removed (a slot left empty
    gets ``[max_steps]``); ``config`` itself when nothing is above. Raises
    :class:`ConfigError` when the result is invalid for the strategy (``throughput_aware``
    with ``max_steps`` 0: its candidates must be > 0)."""
    if max(config.candidate_steps) <= max_steps:
        return config
    data = json.loads(config.to_json())
    for key, slot in data.items():
        if key.isdigit() and isinstance(slot, dict) and "candidate_steps" in slot:
            kept = [k for k in slot["candidate_steps"] if k <= max_steps]
            slot["candidate_steps"] = kept or [max_steps]
    try:
        return AdaptiveConfig.from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"speculative_num_steps={max_steps} as the bound of the adaptive "
                          f"config's candidates: {e}") from None


#: The goodput strategy's largest ``tree.max_num_draft_tokens`` (root excluded), from the Rust
#: core (``MAX_NUM_DRAFT_TOKENS`` of ``rust/core/src/config/tree.rs``, as ``MAX_TREE_TOPK`` is
#: its ``MAX_TOPK``): checked here so that the error names SGLang's flags in SGLang's counting.
MAX_TREE_NODES = MAX_TREE_NUM_DRAFT_TOKENS


def with_tree_bounds(config: AdaptiveConfig, topk: int, num_draft_tokens: int
                     ) -> AdaptiveConfig:
    """``config`` with the ``goodput`` strategy's ``tree`` key set from SGLang's
    ``speculative_eagle_topk`` / ``speculative_num_draft_tokens`` (root included; the key's
    ``max_num_draft_tokens`` excludes it): with adaptation on, the flags bound the trees the
    policy chooses (issue 29). Raises :class:`ConfigError` naming the option for bounds out
    of range (top-k in 2..=:data:`MAX_TREE_TOPK`, ``num_draft_tokens`` in
    2..=:data:`MAX_TREE_NODES` + 1), a strategy that chooses no trees, or a config whose own
    ``tree`` key differs from the flags."""
    if not 2 <= topk <= MAX_TREE_TOPK:
        raise ConfigError(f"speculative_eagle_topk: must be in 2..={MAX_TREE_TOPK} as the "
                          f"adaptive policy's tree bound (a fixed tree, "
                          f"--no-speculative-adaptive, allows more), got {topk}")
    if not 2 <= num_draft_tokens <= MAX_TREE_NODES + 1:
        raise ConfigError(f"speculative_num_draft_tokens: must be in 2..={MAX_TREE_NODES + 1} "
                          f"(the root plus 1..={MAX_TREE_NODES} tree nodes) as the adaptive "
                          f"policy's tree bound, got {num_draft_tokens}")
    data = json.loads(config.to_json())
    what = f"speculative_eagle_topk={topk}"
    if data.get("strategy") != "goodput":
        raise ConfigError(f"{what} with adaptive steps needs the goodput strategy (it chooses "
                          f"tree shapes by cost); the config's strategy is "
                          f"{data.get('strategy')!r}")
    bounds = {"max_topk": topk, "max_num_draft_tokens": num_draft_tokens - 1}
    if data.get("tree") not in (None, bounds):
        raise ConfigError(f"{what}, speculative_num_draft_tokens={num_draft_tokens}: the "
                          f"adaptive config's tree {data['tree']} differs; give the bounds once")
    data["tree"] = bounds
    return AdaptiveConfig.from_dict(data)


def policy_options(num_steps: int | None, adaptive: bool, loaded: AdaptiveConfig | None,
                   drafter_max_steps: int | None, schedule: Any, initial: int | None = None,
                   tree: tuple[int, int] | None = None
                   ) -> tuple[dict[str, Any], list[int] | None, AdaptiveConfig | None]:
    """``(scheduler policy kwargs, worker step values or None, adaptive config or None)``.

    ``drafter_max_steps`` None: no drafter (plain decoding; ``num_steps`` must be 0 or None).
    ``schedule``: the ``steps_schedule`` test hook (a sequence or callable) or None.
    ``initial``: adaptive only, the starting steps (``speculative_initial_steps``; a candidate
    of some slot, ``ConfigError`` otherwise); default: see the module docstring.
    ``tree``: adaptive only, ``(speculative_eagle_topk, speculative_num_draft_tokens)`` with
    top-k > 1, the policy's tree bounds (:func:`with_tree_bounds`).
    Raises :class:`ConfigError` naming the option for steps the drafter or config cannot run.
    """
    if drafter_max_steps is None:
        if num_steps:
            raise ConfigError(f"speculative_num_steps={num_steps} needs a drafter "
                              "(speculative_algorithm is None)")
        return {"speculative_num_steps": 0, "adaptive": False}, None, None
    max_steps = drafter_max_steps
    if schedule is not None:
        if not callable(schedule) and (
                not schedule or not all(0 <= int(k) <= max_steps for k in schedule)):
            raise ConfigError(f"steps_schedule values must be in 0..{max_steps}")
        return ({"speculative_num_steps": 0, "adaptive": False}, list(range(max_steps + 1)),
                None)
    if adaptive:
        config = loaded if loaded is not None else AdaptiveConfig.default()
        if num_steps is not None:
            config = cap_candidates(config, num_steps)
        if tree is not None:  # SGLang's rule at the deepest candidate, named as the flags are
            validate_draft_tree(config.candidate_steps[-1], *tree)
            config = with_tree_bounds(config, *tree)
        union = config.candidate_steps
        if initial is None:
            initial = union[len(union) // 2] if num_steps is None else union[-1]
        validate_initial_steps(config, initial)
        if union[-1] > max_steps:
            raise ConfigError(f"candidate steps {union[-1]} exceeds what the drafter supports "
                              f"(max_steps={max_steps})")
        return ({"speculative_num_steps": initial, "adaptive": True, "adaptive_config": config},
                None, config)
    steps = FIXED_DEFAULT_STEPS if num_steps is None else num_steps
    if steps > max_steps:
        raise ConfigError(f"speculative_num_steps={steps} exceeds what the drafter "
                          f"supports (max_steps={max_steps})")
    return {"speculative_num_steps": steps, "adaptive": False}, None, None
