""":class:`EngineConfig`: every option of :class:`specdial.Engine`, its default and its check.

This is the only place the engine's defaults live. :class:`specdial.Engine` builds one from its
keyword arguments (same names), the command line reads its fields through
:class:`specdial.engine.args.EngineArgs` (``serve``, ``generate``, ``bench``), and the Rust
:class:`specdial.SchedulerConfig` gets every value it needs passed explicitly by the engine (its
own defaults serve direct Rust users only). Each field's ``help`` metadata is its command-line
help; ``cli=False`` marks Python-only options (test hooks, objects).

Validation (:meth:`EngineConfig.__post_init__`) runs once, when the config is built, before any
model loads. What depends on the models (the drafter's ``max_steps``, the target's context
length, whether CUDA exists) is checked where they are known, in :mod:`specdial.engine.core`.
No torch import here: the command line reads these defaults without loading it. This module is
the bottom layer (docs/ARCHITECTURE.md, "Layers"): it imports only the Rust core and the other
settings of :mod:`specdial.config`, so every layer may read it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from specdial._core import ConfigError, validate_draft_tree
from specdial.config.cuda_graph import normalize_graph_bs
from specdial.config.parallel import ParallelOptions

__all__ = ["ALGORITHMS", "AUTO", "DTYPES", "ENGINE_OPTIONS", "EngineConfig", "FIXED_DEFAULT_STEPS",
           "GRAPH_MODES", "POSITIONAL", "check_choice", "config_of_call", "option"]

#: ``speculative_algorithm`` (and ``dtype``) value "decide from the checkpoint".
AUTO = "auto"
#: Allowed ``speculative_algorithm`` values (None: no speculation).
ALGORITHMS = (AUTO, "EAGLE", "EAGLE3", "DRAFT", None)
#: SGLang's spellings the CLI and the Engine both accept, and what they mean here:
#: ``NONE`` is no speculation (None), ``STANDALONE`` a separate draft model (``DRAFT``).
ALGORITHM_ALIASES = {"NONE": None, "STANDALONE": "DRAFT"}
#: ``sampling_defaults`` values (SGLang's ``--sampling-defaults``; the rule:
#: :mod:`specdial.engine.sampling_defaults`).
SAMPLING_DEFAULTS_CHOICES = ("model", "openai")
#: ``load_balance_method`` values (SGLang's ``--load-balance-method`` names; the rules:
#: :mod:`specdial.launch.routing`).
LOAD_BALANCE_METHODS = ("minimum_tokens", "shortest_queue", "round_robin")
#: ``data_parallel_backend`` values (vLLM's ``--data-parallel-backend``; ``mp`` is its name for
#: one process per replica, ``inprocess`` keeps the replicas as threads of this process).
DP_BACKENDS = ("mp", "inprocess")
#: Allowed ``dtype`` names (vLLM's spellings; ``float`` is float32, ``half`` float16).
DTYPES = (AUTO, "float32", "bfloat16", "float16", "float", "half")
#: Allowed ``cuda_graph_mode`` values (test hook).
GRAPH_MODES = ("cuda", "eager", "emulate", None)
#: Steps of a fixed (non-adaptive) policy when ``speculative_num_steps`` is None.
FIXED_DEFAULT_STEPS = 3


def option(help: str, default: Any = None, **extra: Any) -> Any:
    """A dataclass field with argparse metadata (``help``, optional ``choices``, ``metavar``,
    ``positional``, ``type`` (the command-line type when the annotation is wider), ``cli``
    (False: no command-line option))."""
    return field(default=default, metadata={"help": help, **extra})


_opt = option  # the short name the fields below use


def _positive(name: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1{' or None' if optional else ''}, "
                          f"got {value!r}")


def check_choice(name: str, value: Any, allowed: Any) -> None:
    """``ValueError`` naming ``name`` and the ``allowed`` values unless ``value`` is one."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


@dataclass
class EngineConfig:
    """The options of :class:`specdial.Engine` (its docstring explains each), validated when
    built: ``ValueError`` (or :class:`specdial.ConfigError`, a ``ValueError``) naming the field
    and its allowed values."""

    model_path: str | None = _opt(
        "target model: a local Hugging Face Llama/Qwen2 checkpoint directory, or a Hugging "
        "Face id (org/name) found in the local Hugging Face cache or downloaded (unless "
        "HF_HUB_OFFLINE=1); default: the built-in models", metavar="DIR|ID", type=str)
    draft_model_path: str | None = _opt(
        "drafter: a draft model sharing the target's tokenizer, or an EAGLE or EAGLE-3 head "
        "(specdial's, SGLang's or vLLM's layout), as a directory or a Hugging Face id; "
        "default: none for a user model, the built-in drafter for the built-in models",
        metavar="DIR|ID", type=str)
    speculative_algorithm: str | None = _opt(
        "EAGLE, EAGLE3, DRAFT (STANDALONE: SGLang's name for it), NONE (plain decoding) or "
        "auto: inferred from --draft-model-path (the built-in models use EAGLE)",
        default=AUTO, choices=("auto", "EAGLE", "EAGLE3", "DRAFT", "STANDALONE", "NONE"))
    speculative_num_steps: int | None = _opt(
        "draft tokens per request per decode iteration. With --speculative-adaptive: the upper "
        "bound of adaptation (candidates above K are removed from every slot; the steps start "
        "at the largest candidate <= K; default: the config's candidates, starting at the "
        "middle one); without: the fixed steps (default "
        f"{FIXED_DEFAULT_STEPS})", metavar="K")
    speculative_adaptive: bool = _opt(
        "adapt the steps every decode iteration per batch-size slot (default strategy "
        "goodput: the steps with the most expected tokens per measured second; ema: SGLang's "
        "EMA of accepted drafts with hysteresis); --no-speculative-adaptive keeps them fixed",
        default=True)
    speculative_adaptive_config: Any = _opt(
        "adaptive policy config, a JSON file in SGLang's format (strategy goodput, ema or "
        "throughput_aware; slots, candidate steps and the strategy's keys; a file without a "
        "strategy key is SGLang's EMA format: strategy ema); default: the built-in goodput "
        "config", metavar="FILE", type=str)
    skip_zero_step_draft_extend: bool = _opt(
        "at steps 0, skip the drafter's extend pass: it catches up on the missed tokens in one "
        "batched pass when drafting resumes, so steps 0 costs what plain decoding costs (the "
        "per-iteration extend cost 5-7 percent on the CPU, BENCHMARKS.md section 12); "
        "--no-skip-zero-step-draft-extend runs it every iteration (SGLang's warm draft KV)",
        default=True)
    enable_prefix_caching: bool = _opt(
        "share the KV pages (target, drafter and EAGLE features) of a common token prefix "
        "between requests through a radix tree over pages, evicting unused ones least recently "
        "used first (SGLang's radix cache, vLLM's automatic prefix caching; both on by "
        "default); --no-enable-prefix-caching prefills every prompt in full",
        default=True)
    device: str = _opt("auto (CUDA when present, else the CPU), cpu, cuda or cuda:N",
                       default=AUTO, type=str)
    dtype: Any = _opt("model dtype: auto (on CUDA the checkpoint's torch_dtype, bfloat16 for a "
                      "float32 checkpoint, vLLM's rule; float32 on the CPU), float32 (float), "
                      "bfloat16, float16 (half)", default=AUTO, choices=DTYPES, type=str)
    speculative_eagle_topk: int = _opt(
        "draft tree width (SGLang's flag): children kept per frontier node, 1 = one chain per "
        "request; above 1 every drafting iteration verifies an EAGLE-2 tree of depth "
        "--speculative-num-steps (with --speculative-adaptive: the largest tree the policy may "
        "choose); at most 64, or 16 with --speculative-adaptive", default=1, metavar="K")
    speculative_num_draft_tokens: int | None = _opt(
        "tokens verified per request per iteration, SGLang's counting: the last token (the "
        "tree's root) plus the draft tokens, so a chain's is --speculative-num-steps + 1 (given "
        "alone it sets the steps) and a tree's is 1 + its nodes, in steps + 1 .. "
        "min(K + (steps - 1) * K**2, 64) + 1 at top-k K; required when "
        "--speculative-eagle-topk > 1", metavar="N")
    max_running_requests: int = _opt(
        "most requests decoded together (the batch capacity, prefilling included)", default=32,
        metavar="N")
    max_queued_requests: int = _opt(
        "most new requests waiting for admission beyond the free running slots; beyond it new "
        "requests are refused (HTTP 503)", default=4096, metavar="N")
    kv_cache_tokens: int | None = _opt(
        "KV cache size in tokens; default: max running requests x context length, capped at "
        "65536", metavar="N")
    page_size: int = _opt("tokens per KV cache page", default=16, metavar="N")
    context_length: int | None = _opt(
        "most tokens per request, prompt plus completion; default: the target's "
        "max_position_embeddings, cut to --kv-cache-tokens (with a warning) when that is "
        "smaller", metavar="N")
    max_prefill_tokens: int = _opt(
        "the prefill batch's token budget: prompt tokens per prefill iteration, over all its "
        "requests (SGLang's meaning)", default=4096, metavar="N")
    chunked_prefill_size: int | None = _opt(
        "most prompt tokens of one request per prefill iteration: longer prompts are "
        "prefilled in chunks of this size (SGLang's meaning); default: the budget "
        "(--max-prefill-tokens)", metavar="N")
    record_trace: Any = _opt(
        "write the per-verify trace (JSONL) that `specdial policy replay` reads",
        metavar="FILE", type=str)
    log_interval_s: float | None = _opt(
        "seconds between the engine's log lines while decoding (running/queued requests, KV "
        "usage, tokens/s, acceptance length, steps per slot); 0 turns them off",
        default=10.0, metavar="SECONDS")
    stream_interval: int = _opt(
        "output tokens per streamed chunk (SGLang's --stream-interval): a request's first "
        "tokens go out at once, then a chunk is sent once at least this many tokens are "
        "waiting, and the final chunk always; larger values cost less per token, smaller "
        "ones stream more smoothly", default=1, metavar="N")
    cuda_graph_bs: list[int] | None = _opt(
        "batch sizes to capture CUDA graphs for (space- or comma-separated); default: SGLang's "
        "sizes up to --max-running-requests", metavar="N")
    disable_cuda_graph: bool = _opt("run the decode passes eagerly on CUDA (no graphs)",
                                    default=False)
    tp_size: int = _opt(
        "tensor parallelism: ranks that shard the target and drafter (gloo on the CPU, NCCL on "
        "CUDA); alias --tensor-parallel-size (vLLM)", default=1, metavar="N")
    dp_size: int = _opt(
        "data parallelism: engine replicas (each its own scheduler and policy) behind one "
        "front end, each request to the least loaded (--load-balance-method); one process "
        "per replica (--data-parallel-backend mp), composing with --tp-size; alias "
        "--data-parallel-size (vLLM)", default=1,
        metavar="N")
    load_balance_method: str = _opt(
        "how the data-parallel router picks a replica per request (SGLang's flag): "
        "minimum_tokens = least outstanding work (prompt plus max_new_tokens of the requests "
        "in flight there), shortest_queue = fewest requests in flight, round_robin",
        default="minimum_tokens", choices=LOAD_BALANCE_METHODS)
    data_parallel_backend: str = _opt(
        "how --dp-size replicas run (vLLM's flag): mp = one process per replica behind a "
        "router in this process; inprocess = threads of this process (they share one GIL)",
        default="mp", choices=DP_BACKENDS)
    watchdog_timeout: float = _opt(
        "seconds a data-parallel replica process (--dp-size > 1, --data-parallel-backend mp) "
        "may go without progress (its engine loop stuck with requests in flight, or nothing "
        "heard from it) before the router kills it, fails its requests and stops routing to it "
        "(SGLang's flag and default)", default=300.0, metavar="SECONDS")
    nnodes: int = _opt("nodes the --tp-size ranks spread over (SGLang)", default=1,
                       metavar="N")
    node_rank: int = _opt(
        "this node's index (SGLang); node 0 serves, the others only run their ranks",
        default=0, metavar="K")
    dist_init_addr: str | None = _opt(
        "host:port of node 0's rendezvous (SGLang); default 127.0.0.1 and a free port, one "
        "node only", metavar="HOST:PORT")
    dist_timeout: float = _opt(
        "seconds a rank waits for a peer before the engine fails its requests and /health "
        "answers 503 (SGLang's name)", default=60.0, metavar="SECONDS")
    seed: int = _opt(
        "the engine's sampling seed: the generator of requests that give no seed of their own "
        "(vLLM's --seed; a request's own seed always wins)", default=0, metavar="N")
    cpu_threads: int | None = _opt(
        "torch intra-op threads of this process (torch.set_num_threads, process-wide, set "
        "before the engine builds); default: torch's (the physical cores). Small models at "
        "small batch sizes can run faster on fewer threads, especially on a shared machine "
        "(see BENCHMARKS.md)", metavar="N")
    policy_cache: bool = _opt(
        "seed the goodput policy with what it learned in earlier runs on this machine with the "
        "same model, drafter, dtype and threads, and save it at shutdown (a versioned JSON file "
        "per key; see specdial.engine.policy_cache); --no-policy-cache starts from nothing",
        default=True)
    policy_cache_dir: str | None = _opt(
        "directory of the policy cache; default: specdial/policy in the user cache directory "
        "($XDG_CACHE_HOME or ~/.cache on Linux)", metavar="DIR")
    sampling_defaults: str = _opt(
        "where the sampling fields a request leaves unset come from (SGLang's flag): model = "
        "the target's generation_config.json (temperature, top_p, top_k, min_p, "
        "repetition_penalty) over SGLang's defaults; openai = SGLang's (OpenAI's) defaults "
        "only (temperature 1.0)", default="model", choices=SAMPLING_DEFAULTS_CHOICES)
    # Python-only options (no command-line flag)
    speculative_initial_steps: int | None = _opt(
        "adaptive: the steps every slot starts at when they are among its candidates (else "
        "the slot's middle candidate); default: the largest candidate <= "
        "speculative_num_steps, or the middle of the candidates' union", cli=False)
    drafter_max_steps: int = _opt("most steps the drafter's runtime supports", default=16,
                                  cli=False)
    steps_schedule: Any = _opt("test hook: a steps sequence or callable replacing the policy",
                               cli=False)
    cuda_graph_mode: str | None = _opt("test hook: cuda, eager or emulate", cli=False)

    def __post_init__(self) -> None:
        if isinstance(self.speculative_algorithm, str) \
                and self.speculative_algorithm in ALGORITHM_ALIASES:
            self.speculative_algorithm = ALGORITHM_ALIASES[self.speculative_algorithm]
        check_choice("speculative_algorithm", self.speculative_algorithm,
                     ALGORITHMS + tuple(ALGORITHM_ALIASES))
        check_choice("sampling_defaults", self.sampling_defaults, SAMPLING_DEFAULTS_CHOICES)
        if (self.speculative_num_steps is not None
                and (isinstance(self.speculative_num_steps, bool)
                     or not isinstance(self.speculative_num_steps, int)
                     or self.speculative_num_steps < 0)):
            raise ConfigError(f"speculative_num_steps must be None or an int >= 0, "
                              f"got {self.speculative_num_steps!r}")
        if (self.speculative_initial_steps is not None
                and (isinstance(self.speculative_initial_steps, bool)
                     or not isinstance(self.speculative_initial_steps, int)
                     or self.speculative_initial_steps < 0)):
            raise ConfigError(f"speculative_initial_steps must be None or an int >= 0, "
                              f"got {self.speculative_initial_steps!r}")
        self._check_draft_tree()
        check_choice("dtype", str(self.dtype).removeprefix("torch."), DTYPES)
        for name in ("max_running_requests", "max_queued_requests", "page_size",
                     "max_prefill_tokens", "drafter_max_steps", "stream_interval"):
            _positive(name, getattr(self, name))
        _positive("chunked_prefill_size", self.chunked_prefill_size, optional=True)
        _positive("cpu_threads", self.cpu_threads, optional=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be an int >= 0, got {self.seed!r}")
        _positive("kv_cache_tokens", self.kv_cache_tokens, optional=True)
        _positive("context_length", self.context_length, optional=True)
        if not isinstance(self.policy_cache, bool):
            raise ConfigError(f"policy_cache must be a bool, got {self.policy_cache!r}")
        if self.policy_cache_dir is not None and not isinstance(self.policy_cache_dir,
                                                                (str, os.PathLike)):
            raise ConfigError(f"policy_cache_dir must be a directory path or None, got "
                              f"{self.policy_cache_dir!r}")
        if not isinstance(self.disable_cuda_graph, bool):
            raise ConfigError(f"disable_cuda_graph must be a bool, got {self.disable_cuda_graph!r}")
        if self.cuda_graph_mode not in GRAPH_MODES:
            raise ConfigError(f"cuda_graph_mode must be one of {GRAPH_MODES}, "
                              f"got {self.cuda_graph_mode!r}")
        if self.cuda_graph_bs is not None:
            try:
                self.cuda_graph_bs = list(normalize_graph_bs(self.cuda_graph_bs))
            except (TypeError, ValueError) as e:
                raise ConfigError(f"cuda_graph_bs: {e}") from e
        if self.record_trace is not None and not isinstance(self.record_trace, (str, os.PathLike)):
            raise ValueError(f"record_trace must be a file path or None, got {self.record_trace!r}")
        self.parallel_options()  # ValueError naming the parallel option
        check_choice("load_balance_method", self.load_balance_method, LOAD_BALANCE_METHODS)
        check_choice("data_parallel_backend", self.data_parallel_backend, DP_BACKENDS)
        if isinstance(self.watchdog_timeout, bool) or not isinstance(
                self.watchdog_timeout, (int, float)) or not self.watchdog_timeout > 0:
            raise ValueError(f"watchdog_timeout must be a positive number of seconds, "
                             f"got {self.watchdog_timeout!r}")
        if self.dp_size > 1 and self.tp_size > 1 and self.data_parallel_backend != "mp":
            raise ValueError("dp_size > 1 with tp_size > 1 needs data_parallel_backend='mp': "
                             "in-process replicas share one process, which holds one "
                             "tensor-parallel group")

    def _check_draft_tree(self) -> None:
        """SGLang's rules for ``speculative_eagle_topk`` / ``speculative_num_draft_tokens``
        (:func:`specdial._core.validate_draft_tree`, the Rust scheduler's own check) against the
        steps when they are known here; with adaptive steps left to the policy's config the
        scheduler checks its largest candidate when the engine builds. A chain's count alone
        sets the steps (``speculative_num_draft_tokens - 1``, as SGLang's flags read)."""
        _positive("speculative_eagle_topk", self.speculative_eagle_topk)
        _positive("speculative_num_draft_tokens", self.speculative_num_draft_tokens,
                  optional=True)
        steps = self.speculative_num_steps
        if steps is None and self.speculative_eagle_topk == 1:
            if self.speculative_num_draft_tokens is not None:
                self.speculative_num_steps = steps = self.speculative_num_draft_tokens - 1
        if steps is None and not self.speculative_adaptive:
            steps = FIXED_DEFAULT_STEPS
        if steps is not None:
            validate_draft_tree(steps, self.speculative_eagle_topk,
                                self.speculative_num_draft_tokens)

    def parallel_options(self) -> ParallelOptions:
        """The validated :class:`~specdial.config.parallel.ParallelOptions` of ``tp_size``,
        ``dp_size``, ``nnodes``, ``node_rank``, ``dist_init_addr``, ``dist_timeout``
        (``ValueError`` naming the option)."""
        return ParallelOptions(tp_size=self.tp_size, dp_size=self.dp_size, nnodes=self.nnodes,
                               node_rank=self.node_rank, dist_init_addr=self.dist_init_addr,
                               dist_timeout=self.dist_timeout)

    def replace(self, **changes: Any) -> "EngineConfig":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (shallow; values as given), the keyword arguments of
        ``specdial.Engine(**config.to_dict())``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)}


#: The names of :class:`EngineConfig`'s fields (the keyword options of ``specdial.Engine``).
ENGINE_OPTIONS = tuple(f.name for f in dataclasses.fields(EngineConfig))
#: The positional parameters of :class:`specdial.Engine`, in order (its first nine options).
POSITIONAL = ENGINE_OPTIONS[:9]


def config_of_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> EngineConfig:
    """The :class:`EngineConfig` of ``Engine(*args, **kwargs)`` (positional arguments in the
    order of :data:`POSITIONAL`). Raises ``TypeError`` for too many positional arguments, one
    given twice or an unknown keyword; what :class:`EngineConfig` raises for bad values."""
    if len(args) > len(POSITIONAL):
        raise TypeError(f"Engine takes at most {len(POSITIONAL)} positional arguments "
                        f"({', '.join(POSITIONAL)}), got {len(args)}")
    for name, value in zip(POSITIONAL, args):
        if name in kwargs:
            raise TypeError(f"Engine got multiple values for argument {name!r}")
        kwargs[name] = value
    unknown = sorted(set(kwargs) - set(ENGINE_OPTIONS))
    if unknown:
        raise TypeError(f"Engine got unexpected keyword argument(s) {', '.join(unknown)}; the "
                        "options are the fields of specdial.config.EngineConfig")
    return EngineConfig(**kwargs)
