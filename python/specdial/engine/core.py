"""``specdial.Engine``: speculative decoding with adaptive steps over continuous batching.

The Rust :class:`specdial._core.Scheduler` owns the requests, the queue, the KV pages and the
``steps`` of every decode iteration (the adaptive policy, SGLang PRs #21599 / #24055, or fixed);
a background loop thread (:mod:`specdial.engine.loop`) runs plan -> passes
(:class:`~specdial.worker.worker.SpecWorker`) -> report. Every front end shares that one running
batch: :meth:`Engine.generate` (blocking, from any number of threads), :meth:`Engine.stream`
(a synchronous iterator of :class:`~specdial.engine.api.StreamChunk`) and
:meth:`Engine.async_stream` (asyncio); the contract is :mod:`specdial.engine.api`.

Output dicts of ``generate`` follow SGLang's offline ``Engine.generate``: ``text``,
``output_ids`` and ``meta_info`` with ``prompt_tokens``, ``completion_tokens``,
``finish_reason`` (``{"type": "length", "length": n}``, ``{"type": "stop", "matched":
token_id_or_str}``, ``{"type": "abort", "message": str, "cause": "client" | "shutdown"}`` or,
for a request the engine failed, ``{"type": "error", "message": cause, "status_code": 500}``:
:mod:`specdial.engine.ends`), ``spec_verify_ct`` (decode
iterations the request took part in, trivial verifies at ``steps = 0`` included),
``spec_accept_length`` (the acceptance length: tokens emitted per verify that carried
drafts, accepted drafts + 1; trivial verifies left out; ``(completion_tokens - 1) /
spec_verify_ct`` when no verify carried drafts, 0.0 without verifies) and ``spec_steps_histogram`` (``{steps: iterations}``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import operator
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import torch

from specdial._core import AdaptiveConfig, ConfigError, Scheduler, SchedulerConfig
from specdial.launch.data_parallel import DataParallelEngine
from specdial.launch.tp_engine import TensorParallelRuntime, rank_options
from specdial.engine.api import EngineStats, LogprobOptions, RequestError, StreamChunk
from specdial.engine.loop import Abort, Cancel, EngineLoop, Message, RequestSpec, Shutdown
from specdial.config import AUTO, EngineConfig, config_of_call
from specdial.engine.loading import builtin_dirs, resolve_placement
from specdial.engine.policy_setup import policy_options
from specdial.engine.resolve import resolve_model_dir
from specdial.engine.output import OutputAccumulator
from specdial.engine.policy_cache import PolicyCache, engine_key
from specdial.engine.requests import (async_collect, async_stream, collect, logprob_options,
                                      make_spec, sync_stream)
from specdial.models import LlamaForCausalLM, load_engine_modules, resolve_draft_algorithm
from specdial.profiling import ProfilePoint, default_seq_len, profile_decode
from specdial.config import default_cuda_graph_bs, normalize_graph_bs
from specdial.worker.drafters import Drafter, make_drafter
from specdial.worker.worker import SpecWorker

logger = logging.getLogger("specdial.engine")


def _release_loop(loop: EngineLoop) -> None:
    """Finalizer of an Engine never shut down (collected, or alive at interpreter exit): abort
    its requests and join its loop thread, so that the thread is not torn down inside a torch
    call while the interpreter finalizes (which aborts the process)."""
    if loop.thread.is_alive():
        loop.post(Shutdown(False))
        if threading.current_thread() is not loop.thread:
            loop.thread.join(timeout=60.0)
    elif loop.trace_file is not None and not loop.thread.ident:
        loop.trace_file.close()


class Engine:
    """Speculative-decoding engine (see the module docstring and :mod:`specdial.engine.api`).

    Its options are the fields of :class:`~specdial.engine.config.EngineConfig` (the defaults
    and their validation live there only), given as keyword arguments (the first nine may also
    be positional, in the order below); the built config is :attr:`config`. Unknown keywords
    raise ``TypeError``; bad values ``ValueError`` / :class:`ConfigError` naming the field.

    - ``model_path``: local HF Llama/Qwen2 directory; ``None``: the built-in models (target +
      EAGLE head, adaptive steps); ``NotImplementedError`` when they are not installed.
    - ``draft_model_path``: a draft model directory (same tokenizer), or an EAGLE-1 or EAGLE-3
      head directory in specdial's, SGLang's or vLLM's layout
      (:mod:`specdial.models.drafter_loader`).
    - ``speculative_algorithm``: ``"EAGLE"``, ``"EAGLE3"``, ``"DRAFT"`` or ``None``. Default:
      inferred from ``draft_model_path`` (none: no speculation); the built-in models use EAGLE.
      Naming EAGLE or EAGLE3 loads a head labelled ``LlamaForCausalLM`` as that kind of head,
      as SGLang and vLLM do.
    - ``speculative_num_steps``: adaptive: the upper bound of adaptation, never exceeded
      (candidates above it removed from every slot; :mod:`specdial.engine.policy_setup`);
      fixed: the steps (default 3). ``ConfigError`` above the drafter's ``max_steps``.
    - ``speculative_adaptive`` / ``speculative_adaptive_config`` (an ``AdaptiveConfig``, a
      dict, a JSON file path, or None for the default). A given config is loaded and validated
      (``ConfigError``) even when it is not used (adaptive off, or no drafter).
    - ``skip_zero_step_draft_extend`` (default True): skip the drafter extend at ``steps = 0``;
      it catches up in one batched extend when steps turn positive, so the drafter resumes with
      the KV a fresh prefill would give (docs/design.md invariant 3) and steps 0 costs what plain
      decoding costs (vLLM's lazy draft-KV catch-up asks #53416, #53426). False runs the extend
      every iteration (SGLang #23994's warm draft KV).
    - ``device`` ``"auto"`` (default: CUDA when present, else the CPU), ``"cpu"``/``"cuda"``/
      ``"cuda:N"`` (``ValueError`` when CUDA is not available or there is no device N);
      ``dtype`` ``"auto"`` (default: on CUDA the checkpoint's, bfloat16 for a float32 one;
      float32 on the CPU), ``"float32"``, ``"bfloat16"``, ``"float16"`` (``"float"``,
      ``"half"``). ``model_path`` / ``draft_model_path`` may be Hugging Face ids, resolved
      through the local cache (:mod:`specdial.engine.resolve`). ``cpu_threads``: torch's
      intra-op threads, set process-wide before loading. A given adaptive config is validated
      before any model loads.
    - keyword-only: ``max_running_requests`` (requests admitted at once, prefilling included),
      ``max_queued_requests`` (new requests waiting beyond the free running slots; beyond it
      submissions raise :class:`~specdial.engine.api.QueueFullError`; ``generate`` waits
      instead),
      ``kv_cache_tokens`` (KV slots; default ``max_running_requests * context_length`` capped
      at 65536), ``page_size``, ``context_length`` (an int >= 1; default the target's
      ``max_position_embeddings``, cut to the KV cache with a warning when that is smaller),
      ``max_prefill_tokens`` (prompt tokens per prefill iteration; longer prompts are chunked),
      ``record_trace`` (a path: the per-verify trace of ``specdial policy replay`` is appended
      to it), ``log_interval_s`` (seconds between log lines while decoding; None: off),
      ``seed`` (the engine's sampling generator, used by requests without a ``seed`` only),
      ``drafter_max_steps``, and the
      test hook ``steps_schedule``: a sequence (decode iteration ``i`` uses
      ``schedule[i % len]``) or a callable ``(iteration, batch_size) -> steps`` replacing the
      policy (runtime states for ``0..drafter_max_steps``).
    - Per-request ``seed`` (sampling params): a seeded sampling request draws every random
      number from a counter-based source keyed by (its seed, the position of the token being
      decided) (:mod:`specdial.worker.seeded_noise`), never from the shared generator, and its
      drafts are verified with coupled draws: the drafter proposes the token at each position
      with that position's noise, and a draft is accepted exactly when it equals the target's
      own draw there (:func:`~specdial.worker.sampling.speculative_accept`). Guarantee: its
      tokens are the ones plain decoding (no speculation) samples with its seed; they depend
      only on its prompt, seed and sampling params, not on the other requests in its batch,
      the steps schedule (fixed, adaptive or any sequence of switches), the drafter, or
      whether speculation is on; the output distribution is exactly the target's. The price is
      a lower acceptance than rejection sampling's for seeded requests (measured in
      BENCHMARKS.md); requests without a seed keep rejection sampling. Caveat: logits are not
      bitwise invariant to the batch and the verify width (batch size, padding and the number
      of positions per forward can change floating-point reduction order), so a draw whose
      comparison falls within rounding of a tie can very rarely flip, and the request then
      continues differently. Requests without a seed share the engine generator and are not
      reproducible per request.
    - CUDA graphs (keyword-only): ``cuda_graph_bs`` (batch sizes to capture, per steps value;
      None: :func:`~specdial.worker.graph_tables.default_cuda_graph_bs` of
      ``max_running_requests``) and ``disable_cuda_graph`` (default False). Graphs are used on
      CUDA devices only (captured at start; the adaptive config prunes the sizes per steps
      value); on the CPU the passes run eagerly. Test hook ``cuda_graph_mode``: ``"emulate"``
      (the runner path on the CPU, graphs emulated), ``"eager"`` (runners without graphs) or
      ``"cuda"``; None: ``"cuda"`` on CUDA, no runners otherwise.
      :meth:`Engine.graph_stats` reports replays and eager fallbacks.
    - Tensor parallelism (keyword-only, :mod:`specdial.distributed`): ``tp_size`` (ranks that
      shard the target and drafter Megatron-style; default 1, the unsharded code path), and
      for several nodes ``nnodes``, ``node_rank`` (an Engine is node 0) and
      ``dist_init_addr`` (``host:port`` of node 0's rendezvous; default 127.0.0.1 and a free
      port), ``dist_timeout`` (seconds a rank waits for a peer, default 60). The Engine starts
      its node's other ranks itself (``python -m specdial.distributed.rank`` subprocesses,
      one torch thread each on the CPU, this process included), owns the scheduler and sends
      each iteration's worker input to them once (:mod:`specdial.distributed.tp_engine`); it
      takes requests once every rank has loaded and built its engine (start-up barriers under
      a long start-up timeout, :mod:`specdial.distributed.liveness`). A rank that dies or
      hangs fails the running requests (finish reason ``error`` naming the cause) within
      ``dist_timeout`` and sets :attr:`failure`. ``ValueError`` for sizes that do not split
      (heads, key/value heads, MLP width over ``tp_size``) or bad parallel options.
    - Data parallelism (keyword-only): ``dp_size`` replicas of this engine in this process
      (default 1), each with its own scheduler, KV cache and adaptive policy, behind one front
      end (:class:`~specdial.distributed.data_parallel.DataParallelEngine`, also
      :attr:`data_parallel`): every request goes to the replica with the fewest in flight;
      :meth:`generate` with a list spreads it over them; :meth:`stats` sums them;
      :meth:`abort` takes the front end's ids. ``tokenizer``, ``context_length`` and the models
      read from the Engine are replica 0's; :attr:`replicas` lists them. ``dp_size > 1`` with
      ``tp_size > 1`` raises ``ValueError``.
    """

    _tp: TensorParallelRuntime | None = None
    _loop: EngineLoop
    worker: Any  # SpecWorker, or rank 0's tensor-parallel wrapper of it
    #: With ``dp_size > 1``: the replicas behind this Engine (each an Engine with its own
    #: scheduler and policy); every public call goes through it. None otherwise.
    _dp: DataParallelEngine | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.config = cfg = config_of_call(args, kwargs)
        parallel = cfg.parallel_options()
        if parallel.node_rank != 0:
            raise ValueError(f"node_rank={parallel.node_rank}: an Engine runs on node 0; "
                             "other nodes only run worker ranks (specdial serve --node-rank N, "
                             "specdial.distributed.node.run_worker_node)")
        if cfg.dp_size > 1:
            self._start_replicas(cfg)
            return
        if cfg.cpu_threads is not None:
            torch.set_num_threads(cfg.cpu_threads)  # process-wide; the loop thread inherits it
        draft_dir = (None if cfg.draft_model_path is None
                     else resolve_model_dir(cfg.draft_model_path, "draft_model_path"))
        algo = cfg.speculative_algorithm
        # validated before any model loads
        adaptive_config = (None if cfg.speculative_adaptive_config is None
                           else self._adaptive_config(cfg.speculative_adaptive_config))
        if cfg.model_path is None:
            model_dir, draft_dir, algo = builtin_dirs(draft_dir, algo)
        else:
            model_dir = resolve_model_dir(cfg.model_path, "model_path")
        dev, dtype = resolve_placement(cfg.device, cfg.dtype, model_dir)
        if algo == AUTO:
            algo = None if draft_dir is None else resolve_draft_algorithm(draft_dir)
        elif algo is not None and draft_dir is not None:
            algo = resolve_draft_algorithm(draft_dir, algo)
        if algo is not None and draft_dir is None:
            raise ValueError(f"speculative_algorithm={algo!r} needs draft_model_path (a draft "
                             "model or EAGLE head directory)")
        if algo is None and draft_dir is not None:
            raise ValueError("draft_model_path is given but speculative_algorithm is None")
        tp = None
        if parallel.distributed:
            adaptive = (None if adaptive_config is None
                        else json.loads(adaptive_config.to_json()))
            options = rank_options(cfg.replace(speculative_adaptive_config=adaptive))
            self._tp = TensorParallelRuntime.start(parallel, {
                "model_path": str(model_dir.resolve()), "algorithm": algo,
                "draft_model_path": None if draft_dir is None else str(draft_dir.resolve()),
                "dtype": str(dtype).removeprefix("torch."), "options": options},
                dev.type)
            tp = self._tp.tp
            dev = torch.device(dev.type, 0) if dev.type == "cuda" else dev
        try:
            target, drafter_module, tokenizer = load_engine_modules(
                model_dir, draft_dir, algo, dtype=dtype, device=dev, tp=tp)
            if self._tp is not None:  # no collective before every rank has loaded
                self._tp.barrier("loaded")
            self._setup(target, drafter_module, tokenizer, algo, cfg, adaptive_config)
            if self._tp is not None:  # waits for every rank's engine ("ready")
                self.worker = self._loop.worker = self._tp.attach(self.worker)
        except BaseException:
            if self._tp is not None:
                self._tp.close()
            raise
        self.policy_cache = PolicyCache.open(
            self.scheduler, enabled=cfg.policy_cache, directory=cfg.policy_cache_dir,
            key=engine_key(self, cfg, model_dir, draft_dir, algo, dtype))

    def _start_replicas(self, cfg: EngineConfig) -> None:
        """``dp_size`` replicas of this engine (each ``dp_size=1``) behind one
        :class:`~specdial.distributed.data_parallel.DataParallelEngine`, which routes every
        request to the least-loaded replica and aggregates their stats. The models, tokenizer
        and limits read from this Engine are replica 0's."""
        replicas: list[Engine] = []
        try:
            for _ in range(cfg.dp_size):
                replicas.append(Engine(**cfg.replace(dp_size=1).to_dict()))
        except BaseException:
            for r in replicas:
                r.shutdown(drain=False)
            raise
        self._dp = DataParallelEngine(replicas)
        first = replicas[0]
        for name in ("target", "tokenizer", "drafter", "speculative_algorithm",
                     "adaptive_config", "steps_schedule", "cuda_graph_bs", "scheduler",
                     "worker", "device", "generator", "eos_token_ids", "max_running_requests",
                     "profile_points", "record_trace"):
            setattr(self, name, getattr(first, name))
        self.context_length = self._dp.context_length
        self._closed = False

    @property
    def data_parallel(self) -> DataParallelEngine | None:
        """The front end over the replicas when ``dp_size > 1`` (routing counts,
        :meth:`~specdial.distributed.data_parallel.DataParallelEngine.replica_stats`), else
        None."""
        return self._dp

    @property
    def replicas(self) -> list["Engine"]:
        """The engines that serve: ``dp_size`` replicas, or ``[self]``."""
        return [self] if self._dp is None else list(self._dp.replicas)

    @property
    def failure(self) -> str | None:
        """None while the engine can run its passes; else why not (its loop stopped, a
        tensor-parallel rank died or hung, or a data-parallel replica failed: the message
        names it). ``/health`` then answers 503 and ``/metrics`` reads ``specdial:engine_up``
        0."""
        if self._dp is not None:
            return self._dp.failure
        dead = self._loop.dead
        if dead is not None:
            return f"the engine loop stopped: {type(dead).__name__}: {dead}"
        return None if self._tp is None else self._tp.failure

    @classmethod
    def from_modules(cls, target: LlamaForCausalLM,
                     drafter: torch.nn.Module | Drafter | None = None, tokenizer: Any = None,
                     **kwargs: Any) -> "Engine":
        """An Engine over already-built modules (tests, notebooks). ``drafter``: an
        :class:`EagleHead` (EAGLE), an :class:`Eagle3Head` (EAGLE3), a :class:`LlamaForCausalLM`
        (DRAFT), a :class:`Drafter`, or None; the algorithm is inferred from it (an explicit
        ``speculative_algorithm`` that disagrees raises ``ValueError``). ``kwargs``: the
        options of :class:`Engine` (fields of :class:`EngineConfig`) other than the model
        paths, ``device``, ``dtype`` and the parallel options (``ValueError`` for a parallel
        size above 1: the modules are already built)."""
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
        self = cls.__new__(cls)
        self.config = cfg
        self._setup(target, wrapped, tokenizer, inferred, cfg,
                    None if cfg.speculative_adaptive_config is None
                    else self._adaptive_config(cfg.speculative_adaptive_config))
        return self

    def _setup(self, target: LlamaForCausalLM, drafter: Any, tokenizer: Any,
               algorithm: str | None, cfg: EngineConfig,
               loaded_config: AdaptiveConfig | None) -> None:
        """Scheduler, worker and loop over built modules. ``loaded_config``: the given
        adaptive config, loaded (validated whenever given, even when it is not used: adaptive
        off, no drafter)."""
        self.target, self.tokenizer = target.eval(), tokenizer
        self.speculative_algorithm = algorithm
        self.drafter = make_drafter(drafter, target, max_steps=cfg.drafter_max_steps)
        if self.drafter is not None:
            self.drafter.module.eval()
        steps_schedule = self.steps_schedule = cfg.steps_schedule
        policy, step_values, self.adaptive_config = policy_options(
            cfg.speculative_num_steps, cfg.speculative_adaptive, loaded_config,
            None if self.drafter is None else self.drafter.max_steps, steps_schedule,
            cfg.speculative_initial_steps)
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
        self.context_length = ctx
        graph_mode = self._graph_mode(cfg, target.embed_tokens.weight.device)
        self.cuda_graph_bs = None if graph_mode is None else (
            list(normalize_graph_bs(cfg.cuda_graph_bs or default_cuda_graph_bs(max_running))))
        self.scheduler = Scheduler(SchedulerConfig(
            max_running_requests=max_running, max_queued_requests=cfg.max_queued_requests,
            max_prefill_tokens=cfg.max_prefill_tokens,
            chunked_prefill_size=cfg.chunked_prefill_size, context_length=ctx, num_pages=num_pages,
            page_size=page_size, eos_token_ids=[], record_trace=cfg.record_trace is not None),
            cuda_graph_bs=self.cuda_graph_bs, **policy)
        self.worker = SpecWorker(target, self.drafter, self.scheduler.num_slots,
                                 max_running_requests=max_running, context_length=ctx,
                                 step_values=step_values or self.scheduler.candidate_steps,
                                 skip_zero_step_draft_extend=cfg.skip_zero_step_draft_extend,
                                 cuda_graph_bs=self.cuda_graph_bs, cuda_graph_mode=graph_mode,
                                 adaptive_config=(self.adaptive_config
                                                  if steps_schedule is None else None),
                                 max_extend_tokens=cfg.max_prefill_tokens)
        self.device = self.worker.device
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        eos = set(target.config.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self.max_running_requests = max_running
        self.profile_points: list[ProfilePoint] = []
        if self.adaptive_config is not None and self.adaptive_config.profile is not None:
            self.profile_points = self._startup_profile(self.adaptive_config)
        record_trace = cfg.record_trace
        self.record_trace = None if record_trace is None else Path(record_trace)
        trace_file = None if record_trace is None else open(record_trace, "a", encoding="utf-8")
        self._loop = EngineLoop(self.scheduler, self.worker, tokenizer=tokenizer,
                                generator=self.generator, steps_schedule=steps_schedule,
                                trace_file=trace_file, log_interval_s=cfg.log_interval_s)
        self._lock = threading.Lock()
        self._started = self._closed = False
        self.policy_cache = PolicyCache.disabled("n/a: an engine built from modules")
        # an Engine dropped without shutdown(): its loop thread exits and frees the buffers
        weakref.finalize(self, _release_loop, self._loop)

    @staticmethod
    def _graph_mode(cfg: EngineConfig, device: torch.device) -> str | None:
        """The GraphPool mode of ``cfg`` on ``device``, or None for eager passes without
        runners. ``ConfigError`` for ``cuda_graph_mode='cuda'`` off CUDA."""
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

    def _startup_profile(self, config: AdaptiveConfig) -> list[ProfilePoint]:
        """The config's startup profiling run (SGLang's ``profile_run_*`` keys): times every
        (steps, batch size) its slots can reach and feeds the policy (the ``throughput_aware``
        cost table, or the ``goodput`` cost model's seed). Batch sizes: ``profile_run_batch_sizes``,
        else the CUDA-graph sizes, else (no graphs, where SGLang would profile nothing) the
        default capture sizes of ``max_running_requests``; at most
        ``max_profile_run_batch_size``."""
        p = config.profile
        assert p is not None
        sizes = p["profile_run_batch_sizes"] or self.cuda_graph_bs or default_cuda_graph_bs(
            self.max_running_requests)
        if p["max_profile_run_batch_size"] is not None:
            sizes = [b for b in sizes if b <= p["max_profile_run_batch_size"]]
        steps = [k for k in config.candidate_steps
                 if k > 0 or config.strategy != "throughput_aware"]
        slots = json.loads(config.to_json())
        bounds = config.slot_lower_bounds

        def reachable(k: int, bs: int) -> bool:
            padded = next((g for g in self.cuda_graph_bs or [] if g >= bs), bs)
            bound = max([b for b in bounds if b <= padded], default=bounds[0])
            return k in slots[str(bound)]["candidate_steps"]

        n = p["profile_run_n_warmup"] + p["profile_run_n_measure"]
        seq = p["profile_run_seq_len"] or default_seq_len(self.context_length, n, max(steps))
        started = time.perf_counter()
        points = self.profile_costs(sizes, steps, n_warmup=p["profile_run_n_warmup"],
                                    n_measure=p["profile_run_n_measure"], seq_len=seq,
                                    reachable=reachable)
        for pt in points:
            self.scheduler.set_profiled_cost(pt.batch_size, pt.steps, pt.seconds,
                                             int(pt.context_per_request * pt.batch_size))
        logger.info("startup profiling (%s): %d points in %.1f s", config.strategy, len(points),
                    time.perf_counter() - started)
        return points

    def profile_costs(self, batch_sizes: list[int], steps: list[int], *, n_warmup: int = 5,
                      n_measure: int = 10, seq_len: int = 128,
                      reachable: Any = None) -> list[ProfilePoint]:
        """Times decode iterations on this engine's real path per (steps, batch size)
        (:func:`specdial.profiling.profile_decode`; seconds per iteration, ``seq_len`` prompt
        tokens per request). Each steps value must have a runtime state (a candidate of the
        config, or the fixed steps). Only before the first request: raises ``RuntimeError``
        once the engine has started serving."""
        if self._dp is not None:
            raise NotImplementedError("profile_costs of a data-parallel Engine: call it on "
                                      "each of engine.replicas")
        if getattr(self, "_started", False) or getattr(self, "_closed", False):
            raise RuntimeError("profile_costs runs only before the engine serves its first request")
        return profile_decode(self.scheduler, self.worker, batch_sizes=batch_sizes,
                              steps_values=steps, n_warmup=n_warmup, n_measure=n_measure,
                              seq_len=seq_len, vocab_size=self.target.config.vocab_size,
                              generator=self.generator, reachable=reachable)

    def graph_stats(self) -> dict[str, Any]:
        """CUDA-graph counters: ``replays`` per pass, ``eager`` fallbacks per reason,
        ``captured`` graphs (all zero without graphs). Read while no request runs."""
        if self._dp is not None:
            raise NotImplementedError("graph_stats of a data-parallel Engine: read each of "
                                      "engine.replicas")
        worker = self.worker
        if worker is None:
            return {"replays": {}, "eager": {}, "captured": 0}
        return worker.graph_stats()

    @staticmethod
    def _adaptive_config(cfg: Any) -> AdaptiveConfig:
        if cfg is None:
            return AdaptiveConfig.default()
        if isinstance(cfg, AdaptiveConfig):
            return cfg
        if isinstance(cfg, dict):
            return AdaptiveConfig.from_dict(cfg)
        if isinstance(cfg, (str, os.PathLike)):
            return AdaptiveConfig.from_file(cfg)
        raise ConfigError("speculative_adaptive_config must be an AdaptiveConfig, a dict, a file "
                          f"path or None; got {type(cfg).__name__}")

    # ----------------------------------------------------------------- requests
    def _spec(self, prompt: Any, input_ids: Any, sampling_params: Any, stop: Any,
              label: str = "", logprobs: LogprobOptions | None = None) -> RequestSpec:
        return make_spec(prompt, input_ids, sampling_params, stop, tokenizer=self.tokenizer,
                         vocab_size=self.target.config.vocab_size,
                         context_length=self.context_length, eos_token_ids=self.eos_token_ids,
                         label=label, logprobs=logprobs)

    def _post(self, message: Message) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("Engine is shut down")
            if self._loop.dead is not None:
                raise RuntimeError(f"the engine loop failed: {self._loop.dead}")
            if not self._started:
                self._loop.start()
                self._started = True
            self._loop.post(message)

    def _decode_token(self, token: int) -> str:
        return str(self.tokenizer.decode([token]))

    def _batch(self, prompt: Any, sampling_params: Any, input_ids: Any,
               return_logprob: Any, logprob_start_len: Any, top_logprobs_num: Any,
               return_text_in_logprobs: Any
               ) -> tuple[bool, list[RequestSpec], list[OutputAccumulator]]:
        """Validate a ``generate`` / ``async_generate`` call: ``(single, specs, outputs)``."""
        if self._closed:
            raise RuntimeError("Engine is shut down")
        if (prompt is None) == (input_ids is None):
            raise RequestError("pass exactly one of prompt or input_ids", "prompt")
        if prompt is not None and not isinstance(prompt, (str, list, tuple)):
            raise RequestError("prompt must be a string or a list of strings, got "
                               f"{type(prompt).__name__}", "prompt")
        single = isinstance(prompt, str) or (prompt is None and (
            not input_ids or not isinstance(input_ids[0], (list, tuple))))
        items: list[Any] = [prompt if prompt is not None else input_ids] if single else list(
            prompt if prompt is not None else input_ids)  # type: ignore[arg-type]
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(items):
                raise RequestError(f"{len(sampling_params)} sampling_params for {len(items)} "
                                   "prompts", "sampling_params")
            sps = list(sampling_params)
        else:
            sps = [sampling_params] * len(items)
        lp = logprob_options(return_logprob, logprob_start_len, top_logprobs_num)
        if not isinstance(return_text_in_logprobs, bool):
            raise RequestError(f"return_text_in_logprobs must be a bool, got "
                               f"{return_text_in_logprobs!r}", "return_text_in_logprobs")
        if return_text_in_logprobs and self.tokenizer is None:
            raise RequestError("return_text_in_logprobs needs a tokenizer", "return_text_in_logprobs")
        specs = [self._spec(x if prompt is not None else None,
                            x if prompt is None else None, sp, None,
                            "" if single else f"prompt {i}: ", lp)
                 for i, (x, sp) in enumerate(zip(items, sps))]
        decode = self._decode_token if return_text_in_logprobs else None
        outs = [OutputAccumulator(s.prompt_ids, return_logprob=lp is not None, decode=decode)
                for s in specs]
        return single, specs, outs

    # ----------------------------------------------------------------- public API
    def generate(self, prompt: str | list[str] | None = None, sampling_params: Any = None,
                 input_ids: list[int] | list[list[int]] | None = None, *,
                 return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0, return_text_in_logprobs: bool = False,
                 stream: bool = False) -> Any:
        """Generate for one prompt (returns a dict) or a list (returns a list of dicts).

        ``prompt``: a str or list of str (needs a tokenizer), or ``input_ids``: a list of ints
        or a list of lists; exactly one of the two. ``sampling_params``: a dict (shared) or a
        list of dicts (one per prompt) with keys of :class:`SamplingParams`, plus SGLang's
        ``stop`` (a string or a list of strings). Blocks until every request finished;
        concurrent calls share the running batch; a full queue makes it wait.

        ``return_logprob`` (SGLang's): add ``output_token_logprobs`` / ``output_top_logprobs``
        (``top_logprobs_num`` alternatives, 0..20) and, with ``logprob_start_len >= 0``,
        ``input_token_logprobs`` / ``input_top_logprobs`` from that prompt position to
        ``meta_info`` (:mod:`specdial.engine.output`; the target's log-probabilities before
        sampling processors); ``return_text_in_logprobs`` fills their token texts.

        ``stream=True`` (one prompt only) returns an iterator of dicts of the same shape,
        cumulative (``text`` and ``output_ids`` so far), as SGLang's ``generate(...,
        stream=True)``; closing it early aborts the request.

        Raises :class:`RequestError` (a ``ValueError``) for an invalid request (nothing runs).
        """
        if self._dp is not None:
            return self._dp.generate(prompt, sampling_params, input_ids,
                                     return_logprob=return_logprob,
                                     logprob_start_len=logprob_start_len,
                                     top_logprobs_num=top_logprobs_num,
                                     return_text_in_logprobs=return_text_in_logprobs,
                                     stream=stream)
        single, specs, outs = self._batch(prompt, sampling_params, input_ids, return_logprob,
                                          logprob_start_len, top_logprobs_num,
                                          return_text_in_logprobs)
        if stream:
            if not single:
                raise RequestError("generate(stream=True) streams one prompt; call it once per "
                                   "prompt, or use async_stream", "prompt")
            return self._stream_dicts(specs[0], outs[0])
        out = collect(self._post, self._cancel, specs, outs)
        return out[0] if single else out

    def _stream_dicts(self, spec: RequestSpec, out: OutputAccumulator) -> Iterator[dict[str, Any]]:
        for chunk in sync_stream(self._post, self._cancel, spec):
            out.add(chunk)
            yield out.result()

    async def _astream_dicts(self, spec: RequestSpec,
                             out: OutputAccumulator) -> AsyncIterator[dict[str, Any]]:
        chunks = async_stream(self._post, self._cancel, spec)
        try:
            async for chunk in chunks:
                out.add(chunk)
                yield out.result()
        finally:
            await chunks.aclose()

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: Any = None,
                             input_ids: list[int] | list[list[int]] | None = None, *,
                             return_logprob: bool = False, logprob_start_len: int = -1,
                             top_logprobs_num: int = 0, return_text_in_logprobs: bool = False,
                             stream: bool = False) -> Any:
        """:meth:`generate` on an asyncio loop (SGLang's ``async_generate``): awaits the dict
        (or list of dicts); with ``stream=True`` (one prompt) returns an async iterator of
        cumulative dicts (``async for out in await engine.async_generate(..., stream=True)``).
        Raises :class:`RequestError` for an invalid request."""
        if self._dp is not None:
            return await self._dp.async_generate(
                prompt, sampling_params, input_ids, return_logprob=return_logprob,
                logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                return_text_in_logprobs=return_text_in_logprobs, stream=stream)
        single, specs, outs = self._batch(prompt, sampling_params, input_ids, return_logprob,
                                          logprob_start_len, top_logprobs_num,
                                          return_text_in_logprobs)
        if stream:
            if not single:
                raise RequestError("async_generate(stream=True) streams one prompt; call it "
                                   "once per prompt", "prompt")
            return self._astream_dicts(specs[0], outs[0])
        out = await async_collect(self._post, self._cancel, specs, outs)
        return out[0] if single else out

    def stream(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
               sampling_params: dict[str, Any] | None = None,
               stop: list[str] | None = None,
               logprobs: LogprobOptions | None = None) -> Iterator[StreamChunk]:
        """Stream one request (synchronous). Submitted on the first ``next()``, which raises
        :class:`RequestError` / :class:`QueueFullError`; closing the iterator early aborts
        the request. ``logprobs``: fills the chunks' logprob fields."""
        if self._dp is not None:
            yield from self._dp.stream(prompt, input_ids=input_ids,
                                       sampling_params=sampling_params, stop=stop,
                                       logprobs=logprobs)
            return
        yield from sync_stream(self._post, self._cancel,
                               self._spec(prompt, input_ids, sampling_params, stop,
                                          logprobs=logprobs))

    async def async_stream(self, prompt: str | None = None, *,
                           input_ids: list[int] | None = None,
                           sampling_params: dict[str, Any] | None = None,
                           stop: list[str] | None = None,
                           logprobs: LogprobOptions | None = None) -> AsyncIterator[StreamChunk]:
        """Stream one request (asyncio). Submitted on the first ``__anext__``, which raises
        :class:`RequestError` / :class:`QueueFullError` before any chunk; ``aclose()`` or
        cancelling the task awaiting a chunk aborts the request. ``logprobs``: fills the
        chunks' logprob fields."""
        chunks: Any
        if self._dp is not None:
            chunks = self._dp.async_stream(prompt, input_ids=input_ids,
                                           sampling_params=sampling_params, stop=stop,
                                           logprobs=logprobs)
        else:
            chunks = async_stream(self._post, self._cancel,
                                  self._spec(prompt, input_ids, sampling_params, stop,
                                             logprobs=logprobs))
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    def _cancel(self, spec: RequestSpec) -> None:
        if not self._closed:
            self._loop.post(Cancel(spec))

    def abort(self, request_id: int) -> None:
        """Abort a request (queued or running) by its id; its stream ends with finish reason
        ``abort``. Unknown or finished ids are ignored; a ``request_id`` that is not an int
        raises ``TypeError``."""
        try:
            if isinstance(request_id, bool):
                raise TypeError
            rid = operator.index(request_id)
        except TypeError:
            raise TypeError(f"request_id must be an int, got {request_id!r} "
                            f"({type(request_id).__name__})") from None
        if self._dp is not None:
            self._dp.abort(rid)
        elif not self._closed and self._started:
            self._loop.post(Abort(rid))

    def stats(self) -> EngineStats:
        """A snapshot of the gauges and counters (thread-safe; see :class:`EngineStats`); with
        ``dp_size > 1`` the replicas' aggregated
        (:func:`~specdial.distributed.data_parallel.aggregate_stats`)."""
        if self._dp is not None:
            return dataclasses.replace(self._dp.stats(),
                                       policy_cache=self.replicas[0].policy_cache.status)
        return dataclasses.replace(self._loop.stats(), policy_cache=self.policy_cache.status)

    def shutdown(self, drain: bool = True) -> None:
        """Stop admitting; ``drain=True`` lets every accepted request finish, ``False`` aborts
        them; joins the loop thread and releases the models' KV buffers. Idempotent; later
        submissions raise ``RuntimeError``."""
        if self._dp is not None:
            if not self._closed:
                self._closed = True
                self._dp.shutdown(drain)
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            started = self._started
            self._loop.post(Shutdown(drain))
        if started:
            self._loop.thread.join()
            self.policy_cache.save(self.scheduler)
        elif self._loop.trace_file is not None:
            self._loop.trace_file.close()
        self.worker = None  # type: ignore[assignment]
        if self._tp is not None:
            self._tp.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
