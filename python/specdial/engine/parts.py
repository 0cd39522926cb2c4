"""What one engine is made of: :class:`EngineParts`, built by
:func:`specdial.engine.build.build_parts` and read by the start-up profile and the Engine
(its own module so that both can import it without importing each other)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from specdial._core import AdaptiveConfig, Scheduler
from specdial.config import EngineConfig
from specdial.engine.loop import EngineLoop
from specdial.engine.sampling_defaults import request_defaults
from specdial.models import LlamaForCausalLM
from specdial.profiling import ProfilePoint

__all__ = ["EngineParts", "remote_parts"]


@dataclass(eq=False)
class EngineParts:
    """What one engine is made of (one replica; :func:`build_parts` makes it).

    ``target`` / ``drafter`` (a :class:`~specdial.worker.drafters.Drafter` or None) /
    ``tokenizer``; ``speculative_algorithm`` (``"EAGLE"``, ``"EAGLE3"``, ``"DRAFT"`` or None);
    ``adaptive_config``: the policy's config (None: fixed steps or the test schedule);
    ``cuda_graph_bs``: the captured batch sizes (None: no graph runners); ``context_length``
    (tokens); ``scheduler``, ``worker`` (rank 0's tensor-parallel wrapper once attached; None
    after shutdown), ``device`` (the worker's), ``loop``; ``generator``: the sampling generator
    of unseeded requests; ``eos_token_ids``; ``profile_points``: the start-up profiling run's
    measurements (empty without one); ``record_trace``: the trace file's path or None;
    ``sampling_defaults``: what a request's unset sampling fields get
    (:func:`~specdial.engine.sampling_defaults.request_defaults`); ``vocab_size``: the token
    ids the engine takes, ``[0, vocab_size)`` (the target's; known without it, as for replica
    processes).
    """

    config: EngineConfig
    target: LlamaForCausalLM
    drafter: Any
    tokenizer: Any
    speculative_algorithm: str | None
    adaptive_config: AdaptiveConfig | None
    cuda_graph_bs: list[int] | None
    context_length: int
    scheduler: Scheduler
    worker: Any
    device: torch.device
    generator: torch.Generator
    eos_token_ids: frozenset[int]
    loop: EngineLoop | None = None
    profile_points: list[ProfilePoint] = field(default_factory=list)
    record_trace: Path | None = None
    sampling_defaults: Mapping[str, Any] = field(default_factory=request_defaults)
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.vocab_size is None and self.target is not None:
            self.vocab_size = int(self.target.config.vocab_size)

    @property
    def max_running_requests(self) -> int:
        return self.config.max_running_requests

    @property
    def steps_schedule(self) -> Any:
        return self.config.steps_schedule


def remote_parts(config: EngineConfig, info: Mapping[str, Any]) -> EngineParts:
    """The parts an Engine whose replicas run in other processes can read here: the
    ``tokenizer``, ``context_length``, ``eos_token_ids``, ``sampling_defaults`` and
    ``speculative_algorithm``, ``adaptive_config`` and ``vocab_size`` of replica 0 (``info``: its ready message,
    :func:`specdial.launch.replica_main.ready_info`); the models, scheduler, worker and
    generator live in the replicas (None here)."""
    return EngineParts(config=config, target=None, drafter=None,  # type: ignore[arg-type]
                       tokenizer=info["tokenizer"],
                       speculative_algorithm=info["speculative_algorithm"],
                       adaptive_config=(None if info.get("adaptive_config") is None else
                                        AdaptiveConfig.from_json(info["adaptive_config"])),
                       cuda_graph_bs=None,
                       context_length=int(info["context_length"]),
                       scheduler=None, worker=None, device=None,  # type: ignore[arg-type]
                       generator=None,  # type: ignore[arg-type]
                       eos_token_ids=frozenset(info["eos_token_ids"]),
                       sampling_defaults=info["sampling_defaults"],
                       vocab_size=int(info["vocab_size"]))
