"""specdial: a speculative-decoding serving engine whose draft depth adapts every decode iteration.

The Rust core (``specdial._core``) decides `speculative_num_steps` every decode iteration: by
default the ``goodput`` strategy (expected tokens per second from per-position acceptance and an
online cost model of the measured iteration times), or SGLang's ``ema`` and ``throughput_aware``
rules; Python runs the torch passes. See docs/design.md in the repository
for the terms and invariants.
"""

from typing import TYPE_CHECKING

from specdial._core import (
    AdaptiveConfig,
    AdaptiveSpeculativeParams,
    AdaptiveStepSlot,
    ConfigError,
    CostTable,
    InternalError,
    Int64Array,
    KvError,
    KvPagePool,
    FinishedRequest,
    InvalidRequestError,
    QueueFullError,
    ReportResult,
    SchedulePlan,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
    SchedulerStats,
    StepDecision,
    __version__,
    validate_initial_steps,
)

__all__ = [
    "Engine",
    "AdaptiveConfig",
    "AdaptiveSpeculativeParams",
    "AdaptiveStepSlot",
    "ConfigError",
    "CostTable",
    "InternalError",
    "Int64Array",
    "KvError",
    "KvPagePool",
    "FinishedRequest",
    "InvalidRequestError",
    "QueueFullError",
    "ReportResult",
    "SchedulePlan",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "SchedulerStats",
    "StepDecision",
    "__version__",
    "validate_initial_steps",
]


if TYPE_CHECKING:  # type checkers see the class; at run time it is imported lazily below
    from specdial.engine.core import Engine


def __getattr__(name: str) -> object:
    # Engine needs torch; importing it lazily keeps `import specdial` (the policy, the replay
    # CLI) light.
    if name == "Engine":
        from specdial.engine.core import Engine

        return Engine
    raise AttributeError(f"module 'specdial' has no attribute {name!r}")
