"""``specdial.Engine``: speculative decoding with adaptive steps over continuous batching.

The Rust :class:`specdial._core.Scheduler` owns the requests, the queue, the KV pages and the
``steps`` of every decode iteration (the adaptive policy, SGLang PRs #21599 / #24055, or fixed);
a background loop thread (:mod:`specdial.engine.loop`) runs plan -> passes
(:class:`~specdial.worker.worker.SpecWorker`) -> report. Every front end shares that one running
batch: :meth:`Engine.generate` (blocking, from any number of threads), :meth:`Engine.stream`
(a synchronous iterator of :class:`~specdial.engine.api.StreamChunk`) and
:meth:`Engine.async_stream` (asyncio); the contract is :mod:`specdial.engine.api`.

Output dicts of ``generate`` follow SGLang's offline ``Engine.generate``
(:mod:`specdial.engine.output` says each key; finish reasons: :mod:`specdial.engine.ends`).
"""

from __future__ import annotations

import logging
import operator
import threading
import weakref
from typing import Any, AsyncIterator, Callable, Iterator

import torch

from specdial.config import EngineConfig, config_of_call
from specdial.engine import readings as _readings
from specdial.engine.api import LogprobOptions, StreamChunk
from specdial.engine.bounds import context_label
from specdial.engine.build import (adaptive_config_of, build_parts, modules_config,
                                   start_tensor_parallel)
from specdial.engine.cache_ops import flush_cache as _flush_cache
from specdial.engine.front import LocalFront
from specdial.engine.loading import resolve_models
from specdial.engine.loop import EngineLoop
from specdial.engine.messages import Abort, Cancel, Message, RequestSpec, Shutdown
from specdial.engine.parts import EngineParts, remote_parts
from specdial.engine.policy_cache import PolicyCache, engine_key
from specdial.engine.requests import make_spec
from specdial.engine.sampling_defaults import model_sampling_defaults, request_defaults
from specdial.engine.startup_profile import profile_costs
from specdial.launch.data_parallel import DataParallelEngine
from specdial.launch.tp_engine import TensorParallelRuntime
from specdial.models import LlamaForCausalLM, load_engine_modules
from specdial.profiling import ProfilePoint
from specdial.worker.drafters import Drafter

logger = logging.getLogger("specdial.engine")


def _part(name: str, doc: str, settable: bool = False) -> property:
    """An Engine attribute read from (``settable``: also written to) its :class:`EngineParts`."""
    fset = (lambda self, value: setattr(self._parts, name, value)) if settable else None
    return property(lambda self: getattr(self._parts, name), fset, doc=doc)


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
    - ``speculative_algorithm``: ``"EAGLE"``, ``"EAGLE3"``, ``"DRAFT"`` or ``None`` (SGLang's
      ``"STANDALONE"`` and ``"NONE"`` are accepted as ``"DRAFT"`` and ``None``). Default:
      inferred from ``draft_model_path`` (none: no speculation); the built-in models use EAGLE.
      Naming EAGLE or EAGLE3 loads a head labelled ``LlamaForCausalLM`` as that kind of head,
      as SGLang and vLLM do.
    - ``speculative_num_steps``: adaptive: the upper bound of adaptation, never exceeded
      (candidates above it removed from every slot; :mod:`specdial.engine.policy_setup`);
      fixed: the steps (default 3). ``ConfigError`` above the drafter's ``max_steps``.
    - ``speculative_eagle_topk``, ``speculative_num_draft_tokens``: SGLang's tree (EngineConfig).
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
      submissions raise :class:`~specdial.engine.api.QueueFullError`; ``generate`` waits instead),
      ``kv_cache_tokens`` (KV slots; default ``max_running_requests * context_length`` capped
      at 65536), ``page_size``, ``context_length`` (an int >= 1; default the target's
      ``max_position_embeddings``, cut to the KV cache with a warning when that is smaller),
      ``max_prefill_tokens`` (prompt tokens per prefill iteration; longer prompts are chunked),
      ``record_trace`` (a path: the per-verify trace of ``specdial policy replay`` is appended
      to it), ``log_interval_s`` (seconds between log lines while decoding; None: off),
      ``stream_interval`` (an int >= 1, SGLang's ``--stream-interval``: a request's chunks
      after its first carry at least this many tokens, except its final one;
      :mod:`specdial.engine.loop`),
      ``seed`` (the engine's sampling generator, used by requests without a ``seed`` only),
      ``drafter_max_steps``, and the
      test hook ``steps_schedule``: a sequence (decode iteration ``i`` uses
      ``schedule[i % len]``) or a callable ``(iteration, batch_size) -> steps`` replacing the
      policy (runtime states for ``0..drafter_max_steps``).
    - ``sampling_defaults``: ``"model"`` (default, SGLang's) or ``"openai"``: whether the
      target's ``generation_config.json`` gives a request's unset sampling fields
      (:mod:`specdial.engine.sampling_defaults`; otherwise ``temperature`` 1.0).
    - Per-request ``seed`` (sampling params): the request's tokens are the ones plain decoding
      samples with its seed (counter-based noise keyed by seed and position,
      :mod:`specdial.worker.seeded_noise`; drafts verified with coupled draws,
      :func:`~specdial.worker.sampling.speculative_accept`), whatever its batch, the steps,
      the drafter or speculation; at a lower acceptance than rejection sampling's
      (BENCHMARKS.md). Caveat: logits are not bitwise invariant to the batch and the verify
      width, so a draw within rounding of a tie can very rarely flip. Requests without a seed
      share the engine generator and are not reproducible per request.
    - CUDA graphs (keyword-only): ``cuda_graph_bs`` (batch sizes to capture, per steps value;
      None: :func:`~specdial.worker.graph_tables.default_cuda_graph_bs` of
      ``max_running_requests``) and ``disable_cuda_graph`` (default False). Graphs are used on
      CUDA devices only (captured at start; the adaptive config prunes the sizes per steps
      value); on the CPU the passes run eagerly. Test hook ``cuda_graph_mode``: ``"emulate"``
      (the runner path on the CPU, graphs emulated), ``"eager"`` (runners without graphs) or
      ``"cuda"``; None: ``"cuda"`` on CUDA, no runners otherwise.
      :meth:`Engine.graph_stats` reports replays and eager fallbacks.
    - Tensor parallelism (keyword-only): ``tp_size`` (ranks that shard the target and drafter
      Megatron-style; default 1), ``nnodes``, ``node_rank`` (an Engine is node 0),
      ``dist_init_addr`` (node 0's rendezvous ``host:port``), ``dist_timeout`` (seconds a rank
      waits for a peer, default 60). The Engine starts its node's other ranks
      (``python -m specdial.launch.rank``), owns the scheduler and sends each iteration's
      worker input to them once (:mod:`specdial.launch.tp_engine`); it takes requests once
      every rank has built its engine (:mod:`specdial.distributed.liveness`). A rank that dies
      or hangs fails the running requests (finish reason ``error`` naming the cause) within
      ``dist_timeout`` and sets :attr:`failure`. ``ValueError`` for sizes that do not split
      over ``tp_size`` or bad parallel options.
    - Data parallelism (keyword-only): ``dp_size`` replicas (default 1), each its own process
      (``data_parallel_backend="mp"``; ``"inprocess"``: Engines in this process) with its own
      scheduler, policy, worker and ``tp_size`` group, behind one front end
      (:class:`~specdial.launch.data_parallel.DataParallelEngine`, :attr:`data_parallel`):
      each request goes where ``load_balance_method`` says; :meth:`generate` with a list
      spreads it; :meth:`stats`, :attr:`loop_turns` and
      :meth:`graph_stats` sum them; :meth:`abort` takes the front end's ids; a failed
      replica is skipped (:attr:`degraded`). ``tokenizer`` and ``context_length`` are replica
      0's; :attr:`replicas` lists them (:mod:`specdial.launch.replica_setup`: devices, seeds).
    """

    _tp: TensorParallelRuntime | None = None
    _parts: EngineParts
    #: With ``dp_size > 1``: the replicas behind this Engine (each an Engine with its own
    #: scheduler and policy); every public call goes through it. None otherwise.
    _dp: DataParallelEngine | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.config = cfg = config_of_call(args, kwargs)
        parallel = cfg.parallel_options()
        if parallel.node_rank != 0:
            raise ValueError(f"node_rank={parallel.node_rank}: an Engine runs on node 0; "
                             "other nodes only run worker ranks (specdial serve --node-rank N, "
                             "specdial.launch.node.run_worker_node)")
        if cfg.dp_size > 1:
            self._start_replicas(cfg)
            return
        if cfg.cpu_threads is not None:
            torch.set_num_threads(cfg.cpu_threads)  # process-wide; the loop thread inherits it
        # validated before any model loads
        adaptive_config = (None if cfg.speculative_adaptive_config is None
                           else adaptive_config_of(cfg.speculative_adaptive_config))
        model_dir, draft_dir, algo, dev, dtype = resolve_models(cfg)
        sampling_defaults = request_defaults(
            model_sampling_defaults(model_dir, cfg.sampling_defaults))
        tp = None
        if parallel.distributed:
            self._tp, dev = start_tensor_parallel(cfg, adaptive_config, model_dir, draft_dir,
                                                  algo, dtype, dev)
            tp = self._tp.tp
        try:
            target, drafter_module, tokenizer = load_engine_modules(
                model_dir, draft_dir, algo, dtype=dtype, device=dev, tp=tp)
            if self._tp is not None:  # no collective before every rank has loaded
                self._tp.barrier("loaded")
            self._setup(target, drafter_module, tokenizer, algo, cfg, adaptive_config)
            self._parts.sampling_defaults = sampling_defaults
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
        """``dp_size`` replicas of this engine (each ``dp_size=1``: processes, or Engines here
        with ``data_parallel_backend="inprocess"``) behind one
        :class:`~specdial.launch.data_parallel.DataParallelEngine`, which routes every request
        and aggregates their stats. The tokenizer and limits read from this Engine are replica
        0's (in-process: its models too)."""
        self._closed = False
        self._dp = DataParallelEngine.build(
            cfg, lambda **kw: Engine(**cfg.replace(dp_size=1, **kw).to_dict()))
        first = self._dp.replicas[0]
        self._parts = first._parts if isinstance(first, Engine) else remote_parts(cfg, first.info)

    def _setup(self, target: LlamaForCausalLM, drafter: Any, tokenizer: Any,
               algorithm: str | None, cfg: EngineConfig, loaded_config: Any) -> None:
        """The parts over built modules (:func:`~specdial.engine.build.build_parts`) and the
        serving state (not started; a finalizer joins the loop of an Engine never shut down)."""
        self._parts = build_parts(target, drafter, tokenizer, algorithm, cfg, loaded_config)
        self._lock = threading.Lock()
        self._started = self._closed = False
        self.policy_cache = PolicyCache.disabled("n/a: an engine built from modules")
        self._local = LocalFront(self._post, self._cancel, self._spec, self.tokenizer,
                                 lambda: self._closed)
        weakref.finalize(self, _release_loop, self._loop)

    @property
    def _front(self) -> Any:
        """Where the serving calls go: the data-parallel front, or this replica's."""
        return self._local if self._dp is None else self._dp

    target = _part("target", "The target model (a LlamaForCausalLM).")
    drafter = _part("drafter", "The Drafter, or None without speculation.")
    tokenizer = _part("tokenizer", "The tokenizer, or None (token ids only).")
    speculative_algorithm = _part("speculative_algorithm", "EAGLE, EAGLE3, DRAFT or None.")
    adaptive_config = _part("adaptive_config", "The adaptive policy's config, or None.")
    steps_schedule = _part("steps_schedule", "The ``steps_schedule`` test hook, or None.")
    cuda_graph_bs = _part("cuda_graph_bs", "Captured batch sizes, or None without graphs.")
    scheduler = _part("scheduler", "The Rust Scheduler (call it only from the loop thread).")
    device = _part("device", "The torch device the passes run on.")
    generator = _part("generator", "The sampling generator of requests without a seed.")
    eos_token_ids = _part("eos_token_ids", "EOS ids new requests stop at.", settable=True)
    max_running_requests = _part("max_running_requests", "Requests admitted at once.")
    profile_points = _part("profile_points", "The start-up profiling run's points.")
    record_trace = _part("record_trace", "The per-verify trace file's path, or None.")
    sampling_defaults = _part("sampling_defaults", "What unset sampling fields of a request get.")
    vocab_size = _part("vocab_size", "Token ids taken: ``[0, vocab_size)`` (replicas' too).")
    loop_turns = property(_readings.loop_turns, doc=_readings.loop_turns.__doc__)

    @property
    def _loop(self) -> EngineLoop:
        loop = self._parts.loop
        assert loop is not None
        return loop

    @property
    def worker(self) -> Any:
        """The SpecWorker, or rank 0's tensor-parallel wrapper of it; None after shutdown."""
        return self._parts.worker

    @worker.setter
    def worker(self, worker: Any) -> None:
        self._parts.worker = worker

    @property
    def context_length(self) -> int:
        """Tokens a request may hold in all (prompt and output); the smallest replica's with
        ``dp_size > 1``."""
        return self._parts.context_length if self._dp is None else self._dp.context_length

    @property
    def context_label(self) -> str:
        """How errors name the context limit: by the option that set it
        (:func:`specdial.engine.bounds.context_label`: ``context_length``, or
        ``kv_cache_tokens`` when the KV cache cut the model's context)."""
        return context_label(self.config, self.context_length)

    @property
    def data_parallel(self) -> DataParallelEngine | None:
        """The front end over the replicas when ``dp_size > 1`` (routing counts,
        :meth:`~specdial.launch.data_parallel.DataParallelEngine.replica_stats`), else
        None."""
        return self._dp

    @property
    def replicas(self) -> list["Engine"]:
        """The engines that serve: ``dp_size`` replicas, or ``[self]``."""
        return [self] if self._dp is None else list(self._dp.replicas)

    failure = property(_readings.failure, doc=_readings.failure.__doc__)
    degraded = property(_readings.degraded, doc=_readings.degraded.__doc__)

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
        cfg, wrapped, inferred = modules_config(target, drafter, kwargs)
        self = cls.__new__(cls)
        self.config = cfg
        self._setup(target, wrapped, tokenizer, inferred, cfg,
                    None if cfg.speculative_adaptive_config is None
                    else adaptive_config_of(cfg.speculative_adaptive_config))
        return self

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
        return profile_costs(self._parts, batch_sizes, steps, n_warmup=n_warmup,
                             n_measure=n_measure, seq_len=seq_len, reachable=reachable)

    graph_stats = _readings.graph_stats

    # ----------------------------------------------------------------- requests
    def _spec(self, prompt: Any, input_ids: Any, sampling_params: Any, stop: Any,
              label: str = "", logprobs: LogprobOptions | None = None) -> RequestSpec:
        return make_spec(prompt, input_ids, sampling_params, stop, tokenizer=self.tokenizer,
                         vocab_size=self.vocab_size,
                         context_length=self.context_length, eos_token_ids=self.eos_token_ids,
                         label=label, logprobs=logprobs, defaults=self.sampling_defaults,
                         context_label=self.context_label)

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
        return self._front.generate(prompt, sampling_params, input_ids,
                                    return_logprob=return_logprob,
                                    logprob_start_len=logprob_start_len,
                                    top_logprobs_num=top_logprobs_num,
                                    return_text_in_logprobs=return_text_in_logprobs,
                                    stream=stream)

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
        return await self._front.async_generate(
            prompt, sampling_params, input_ids, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs, stream=stream)

    def stream(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
               sampling_params: dict[str, Any] | None = None,
               stop: list[str] | None = None,
               logprobs: LogprobOptions | None = None) -> Iterator[StreamChunk]:
        """Stream one request (synchronous). Submitted on the first ``next()``, which raises
        :class:`RequestError` / :class:`QueueFullError`; closing the iterator early aborts
        the request. ``logprobs``: fills the chunks' logprob fields."""
        yield from self._front.stream(prompt, input_ids=input_ids,
                                      sampling_params=sampling_params, stop=stop,
                                      logprobs=logprobs)

    async def async_stream(self, prompt: str | None = None, *,
                           input_ids: list[int] | None = None,
                           sampling_params: dict[str, Any] | None = None,
                           stop: list[str] | None = None,
                           logprobs: LogprobOptions | None = None,
                           whole: bool = False,
                           on_submitted: Callable[[int], None] | None = None
                           ) -> AsyncIterator[StreamChunk]:
        """Stream one request (asyncio). Submitted on the first ``__anext__``, which raises
        :class:`RequestError` / :class:`QueueFullError` before any chunk; ``aclose()`` or
        cancelling the task awaiting a chunk aborts the request. ``logprobs``: fills the
        chunks' logprob fields. ``whole=True``: the caller wants the output only at the end
        (the server's non-streaming responses): the same chunks come together once the
        request ends, each stamped with its ``emitted_s``, which spares the caller's event
        loop (and, with ``dp_size > 1``, the router) one wake-up per decode iteration.
        ``on_submitted``: called (on the caller's event loop) with the request's id once the
        engine (with ``dp_size > 1``: its replica) accepted it, so that :meth:`abort` can end
        it with what it generated so far (a ``whole`` stream shows no id before its end)."""
        extra: dict[str, Any] = {}
        if on_submitted is not None:
            extra["on_submitted"] = on_submitted
        chunks = self._front.async_stream(prompt, input_ids=input_ids,
                                          sampling_params=sampling_params, stop=stop,
                                          logprobs=logprobs, whole=whole, **extra)
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

    flush_cache = _flush_cache  # SGLang's /flush_cache on the loop thread (cache_ops.py)

    stats = _readings.stats

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
