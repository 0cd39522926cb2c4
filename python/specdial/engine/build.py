"""The engine's wiring, in one place: from an :class:`EngineConfig` and built modules to the
scheduler, the worker, the steps policy and the loop (:func:`build_parts`).

Order: the steps policy of the options (:mod:`specdial.engine.policy_setup`), the limits (context
length, KV pages), the Rust :class:`~specdial._core.Scheduler` (queues, KV pages, the policy),
the :class:`~specdial.worker.worker.SpecWorker` (its runtime states are the steps the scheduler
can plan), the optional start-up profiling run (:mod:`specdial.engine.startup_profile`), then the
:class:`~specdial.engine.loop.EngineLoop` over both. :class:`specdial.Engine` holds the result,
an :class:`EngineParts`, and nothing else of the wiring.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from specdial._core import AdaptiveConfig, ConfigError, Scheduler, SchedulerConfig
from specdial.config import AUTO, EngineConfig, config_of_call
from specdial.engine.loop import EngineLoop
from specdial.engine.parts import EngineParts
from specdial.engine.policy_setup import policy_options
from specdial.engine.startup_profile import startup_profile
from specdial.models import LlamaForCausalLM
from specdial.worker.drafters import make_drafter
from specdial.worker.graph_tables import default_cuda_graph_bs, normalize_graph_bs
from specdial.worker.worker import SpecWorker

__all__ = ["adaptive_config_of", "build_parts", "graph_mode", "modules_config",
           "start_tensor_parallel"]

logger = logging.getLogger("specdial.engine")


def adaptive_config_of(value: Any) -> AdaptiveConfig:
    """``speculative_adaptive_config`` as an :class:`AdaptiveConfig`: None (the default
    config), an AdaptiveConfig, a dict or a JSON file path. :class:`ConfigError` for anything
    else or an invalid config."""
    if value is None:
        return AdaptiveConfig.default()
    if isinstance(value, AdaptiveConfig):
        return value
    if isinstance(value, dict):
        return AdaptiveConfig.from_dict(value)
    if isinstance(value, (str, os.PathLike)):
        return AdaptiveConfig.from_file(value)
    raise ConfigError("speculative_adaptive_config must be an AdaptiveConfig, a dict, a file "
                      f"path or None; got {type(value).__name__}")


def graph_mode(cfg: EngineConfig, device: torch.device) -> str | None:
    """The GraphPool mode of ``cfg`` on ``device``, or None for eager passes without runners.
    ``ConfigError`` for ``cuda_graph_mode='cuda'`` off CUDA."""
    if cfg.disable_cuda_graph:
        return None
    mode = cfg.cuda_graph_mode
    if mode is None:
        if device.type != "cuda":
            return None
        mode = "cuda"
    if mode == "cuda" and device.type != "cuda":
        raise ConfigError(f"cuda_graph_mode='cuda' needs a CUDA device, got {device}")
    return mode


def kv_limits(cfg: EngineConfig, target: LlamaForCausalLM) -> tuple[int, int]:
    """``(context_length, num_pages)``: the context is the model's unless given, cut (with a
    warning) to the KV cache when ``kv_cache_tokens`` is smaller and no ``context_length`` was
    given; ``kv_cache_tokens`` defaults to ``max_running_requests * context`` capped at 65536."""
    max_running, page_size = cfg.max_running_requests, cfg.page_size
    ctx = (target.config.max_position_embeddings if cfg.context_length is None
           else cfg.context_length)
    kv_cache_tokens = (min(max_running * ctx, 65536) if cfg.kv_cache_tokens is None
                       else cfg.kv_cache_tokens)
    num_pages = -(-kv_cache_tokens // page_size)
    if cfg.context_length is None and num_pages * page_size < ctx:
        logger.warning("kv_cache_tokens=%d (%d page(s) of %d tokens) is below the model's "
                       "context length %d: the context length is cut to %d tokens",
                       kv_cache_tokens, num_pages, page_size, ctx, num_pages * page_size)
        ctx = num_pages * page_size
    return ctx, num_pages


def eos_ids(target: LlamaForCausalLM, tokenizer: Any) -> frozenset[int]:
    """The model's EOS ids plus the tokenizer's ``eos_token_id``."""
    eos = set(target.config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id))
    return frozenset(eos)


def start_tensor_parallel(cfg: EngineConfig, adaptive: AdaptiveConfig | None, model_dir: Path,
                          draft_dir: Path | None, algorithm: str | None, dtype: torch.dtype,
                          device: torch.device) -> tuple[Any, torch.device]:
    """Start this node's other tensor-parallel ranks over the same models and options
    (:class:`~specdial.launch.tp_engine.TensorParallelRuntime`); returns it and rank 0's
    device (``cuda:0`` on CUDA)."""
    from specdial.launch.tp_engine import TensorParallelRuntime, rank_options

    loaded = None if adaptive is None else json.loads(adaptive.to_json())
    options = rank_options(cfg.replace(speculative_adaptive_config=loaded))
    runtime = TensorParallelRuntime.start(cfg.parallel_options(), {
        "model_path": str(model_dir.resolve()), "algorithm": algorithm,
        "draft_model_path": None if draft_dir is None else str(draft_dir.resolve()),
        "dtype": str(dtype).removeprefix("torch."), "options": options}, device.type)
    return runtime, torch.device(device.type, 0) if device.type == "cuda" else device


def modules_config(target: LlamaForCausalLM, drafter: Any, kwargs: dict[str, Any]
                   ) -> tuple[EngineConfig, Any, str | None]:
    """``(config, drafter, algorithm)`` of ``Engine.from_modules(target, drafter, **kwargs)``:
    the drafter wrapped (:func:`~specdial.worker.drafters.make_drafter`) and its algorithm
    inferred. ``ValueError`` for a parallel size above 1, model paths / ``device`` / ``dtype``
    (the modules are built and placed already) or a ``speculative_algorithm`` the drafter is
    not. Sets torch's threads when ``cpu_threads`` is given."""
    cfg = config_of_call((), kwargs)
    if cfg.tp_size > 1 or cfg.dp_size > 1:
        raise ValueError("from_modules builds one unsharded engine: tp_size and dp_size "
                         "must be 1")
    given = [k for k in ("model_path", "draft_model_path", "device", "dtype") if k in kwargs]
    if given:
        raise ValueError(f"from_modules takes built modules: {', '.join(given)} cannot "
                         "apply (load and place the modules before passing them)")
    if cfg.cpu_threads is not None:
        torch.set_num_threads(cfg.cpu_threads)
    wrapped = make_drafter(drafter, target, max_steps=cfg.drafter_max_steps)
    inferred = None if wrapped is None else wrapped.algorithm
    if cfg.speculative_algorithm not in (AUTO, inferred):
        raise ValueError(f"speculative_algorithm={cfg.speculative_algorithm!r} does not "
                         f"match the drafter given ({type(drafter).__name__})")
    return cfg, wrapped, inferred


def build_parts(target: LlamaForCausalLM, drafter: Any, tokenizer: Any,
                algorithm: str | None, cfg: EngineConfig,
                loaded_config: AdaptiveConfig | None) -> EngineParts:
    """Scheduler, worker, policy and loop over built modules (see the module docstring).
    ``loaded_config``: the given adaptive config, loaded (validated whenever given, even when
    it is not used: adaptive off, no drafter). Raises :class:`ConfigError` / ``ValueError``
    naming the option for steps, tree or graph settings the models cannot run (a tree,
    ``speculative_eagle_topk > 1``, without a drafter)."""
    target = target.eval()
    drafter = make_drafter(drafter, target, max_steps=cfg.drafter_max_steps)
    if drafter is not None:
        drafter.module.eval()
    elif cfg.speculative_eagle_topk > 1:  # else the scheduler's "steps 0" names no cause
        raise ConfigError(f"speculative_eagle_topk={cfg.speculative_eagle_topk} drafts a tree, "
                          "which needs a drafter; this engine has none (speculative_algorithm "
                          "None, or no draft model); allowed without a drafter: "
                          "speculative_eagle_topk 1")
    policy, step_values, adaptive = policy_options(
        cfg.speculative_num_steps, cfg.speculative_adaptive, loaded_config,
        None if drafter is None else drafter.max_steps, cfg.steps_schedule,
        cfg.speculative_initial_steps,
        tree=((cfg.speculative_eagle_topk, cfg.speculative_num_draft_tokens)
              if cfg.speculative_eagle_topk > 1 and drafter is not None
              and cfg.speculative_num_draft_tokens is not None else None))
    ctx, num_pages = kv_limits(cfg, target)
    mode = graph_mode(cfg, target.embed_tokens.weight.device)
    graph_bs = None if mode is None else list(normalize_graph_bs(
        cfg.cuda_graph_bs or default_cuda_graph_bs(cfg.max_running_requests)))
    scheduler = Scheduler(SchedulerConfig(
        max_running_requests=cfg.max_running_requests,
        max_queued_requests=cfg.max_queued_requests, max_prefill_tokens=cfg.max_prefill_tokens,
        chunked_prefill_size=cfg.chunked_prefill_size, context_length=ctx, num_pages=num_pages,
        page_size=cfg.page_size, eos_token_ids=[], record_trace=cfg.record_trace is not None,
        skip_zero_step_draft_extend=cfg.skip_zero_step_draft_extend and drafter is not None,
        enable_prefix_caching=cfg.enable_prefix_caching),
        cuda_graph_bs=graph_bs, **policy, speculative_eagle_topk=cfg.speculative_eagle_topk,
        # a chain's count was checked against speculative_num_steps (EngineConfig); the policy's
        # largest candidate may be below that bound
        speculative_num_draft_tokens=(cfg.speculative_num_draft_tokens
                                      if cfg.speculative_eagle_topk > 1 else None))
    worker = SpecWorker(target, drafter, scheduler.num_slots,
                        max_running_requests=cfg.max_running_requests, context_length=ctx,
                        step_values=step_values or scheduler.candidate_steps,
                        cuda_graph_bs=graph_bs, cuda_graph_mode=mode,
                        adaptive_config=adaptive if cfg.steps_schedule is None else None,
                        max_extend_tokens=cfg.max_prefill_tokens,
                        tree_max_num_draft_tokens=_tree_nodes(cfg, adaptive, drafter))
    parts = EngineParts(
        config=cfg, target=target, drafter=drafter, tokenizer=tokenizer,
        speculative_algorithm=algorithm, adaptive_config=adaptive, cuda_graph_bs=graph_bs,
        context_length=ctx, scheduler=scheduler, worker=worker, device=worker.device,
        generator=torch.Generator(device=worker.device).manual_seed(cfg.seed),
        eos_token_ids=eos_ids(target, tokenizer),
        record_trace=None if cfg.record_trace is None else Path(cfg.record_trace))
    if adaptive is not None and adaptive.profile is not None:
        parts.profile_points = startup_profile(parts, adaptive)
    trace_file = (None if cfg.record_trace is None
                  else open(cfg.record_trace, "a", encoding="utf-8"))
    parts.loop = EngineLoop(scheduler, worker, tokenizer=tokenizer, generator=parts.generator,
                            steps_schedule=cfg.steps_schedule, trace_file=trace_file,
                            log_interval_s=cfg.log_interval_s,
                            stream_interval=cfg.stream_interval)
    return parts


def _tree_nodes(cfg: EngineConfig, adaptive: AdaptiveConfig | None, drafter: Any) -> int | None:
    """The most nodes (root excluded) of a draft tree this engine runs, whose verify graphs the
    worker captures: the adaptive config's ``tree`` bound, else SGLang's
    ``speculative_num_draft_tokens - 1`` with ``speculative_eagle_topk > 1``; None: chains
    only (or no drafter)."""
    if drafter is None:
        return None
    tree = None if adaptive is None else json.loads(adaptive.to_json()).get("tree")
    if tree is not None:
        return int(tree["max_num_draft_tokens"])
    if cfg.speculative_eagle_topk > 1 and cfg.speculative_num_draft_tokens is not None:
        return cfg.speculative_num_draft_tokens - 1
    return None
