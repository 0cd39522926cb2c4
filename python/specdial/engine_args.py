"""Typed engine options of every ``specdial`` command: :class:`EngineArgs`, and the argparse
glue that turns a dataclass into command-line options.

Every engine option is a field of :class:`EngineArgs`; ``specdial serve`` / ``generate``
(:mod:`specdial.server.config`) and ``specdial bench`` extend or embed it, so the engine's options
are defined once and no command imports the HTTP server to get them. The argparse options are
generated from the fields (:func:`add_dataclass_arguments`): the flag is the field name with
dashes, the help text is the field's ``help`` metadata, the type comes from the annotation,
booleans get ``--x/--no-x``. :meth:`EngineArgs.engine_kwargs` is the one place that turns the
options into :class:`specdial.Engine` keyword arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["BUILTIN_MODEL_NAME", "NO_SPECULATION", "EngineArgs", "add_dataclass_arguments",
           "config_from_args"]

#: The name under which the built-in models (``model_path`` None) are served.
BUILTIN_MODEL_NAME = "specdial-default"

#: ``--speculative-algorithm`` value meaning "no speculation" (Engine ``speculative_algorithm=None``).
NO_SPECULATION = "NONE"

#: EngineArgs fields that configure the process, not the Engine.
_NOT_ENGINE_KWARGS = frozenset({"log_level", "cpu_threads", "chat_template", "dp_size"})


def _opt(help: str, default: Any = None, **extra: Any) -> Any:
    """A dataclass field with argparse metadata (``help``, optional ``choices``, ``metavar``,
    ``positional``)."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class EngineArgs:
    """Engine options shared by ``serve`` and ``generate`` (see :class:`specdial.Engine`)."""

    model_path: str | None = _opt(
        "target model: a local Hugging Face Llama/Qwen2 checkpoint directory; default: the "
        "built-in models", metavar="DIR")
    draft_model_path: str | None = _opt(
        "drafter: a draft model directory sharing the target's tokenizer, or an EAGLE or "
        "EAGLE-3 head directory (specdial's, SGLang's or vLLM's layout); default: none for a "
        "user model, the built-in drafter for the built-in models", metavar="DIR")
    speculative_algorithm: str | None = _opt(
        f"EAGLE, EAGLE3, DRAFT (STANDALONE: SGLang's name for it) or {NO_SPECULATION} "
        "(plain decoding); default: inferred from --draft-model-path (the built-in models use "
        "EAGLE)",
        choices=("EAGLE", "EAGLE3", "DRAFT", "STANDALONE", NO_SPECULATION))
    speculative_num_steps: int | None = _opt(
        "draft tokens per request per decode iteration. With --speculative-adaptive: the "
        "initial steps (default: the middle candidate); without: the fixed steps (default 3)",
        metavar="K")
    speculative_adaptive: bool = _opt(
        "adapt the steps every decode iteration per batch-size slot (default strategy "
        "goodput: the steps with the most expected tokens per measured second; ema: SGLang's "
        "EMA of accepted drafts with hysteresis); --no-speculative-adaptive keeps them fixed",
        default=True)
    speculative_adaptive_config: str | None = _opt(
        "adaptive policy config, a JSON file in SGLang's format (strategy goodput, ema or "
        "throughput_aware; slots, candidate steps and the strategy's keys); default: the "
        "built-in goodput config", metavar="FILE")
    skip_zero_step_draft_extend: bool = _opt(
        "at steps 0, skip the drafter's extend pass (it catches up in one batched pass when "
        "drafting resumes)", default=False)
    device: str = _opt("cpu, cuda or cuda:N", default="cpu")
    dtype: str = _opt("model dtype; auto: the checkpoint's torch_dtype on CUDA, float32 on the "
                      "CPU", default="float32", choices=("auto", "float32", "bfloat16"))
    max_running_requests: int | None = _opt(
        "most requests decoded together (the batch capacity); default: the engine's (32)",
        metavar="N")
    max_queued_requests: int | None = _opt(
        "most new requests waiting for admission beyond the free running slots; beyond it new "
        "requests are refused (HTTP 503); default: the engine's", metavar="N")
    kv_cache_tokens: int | None = _opt(
        "KV cache size in tokens; default: the engine's (on CPU, max running requests x "
        "context length, capped)", metavar="N")
    page_size: int | None = _opt("tokens per KV cache page; default: the engine's (16)",
                                 metavar="N")
    max_prefill_tokens: int | None = _opt(
        "prompt tokens per prefill iteration (longer prompts are prefilled in chunks); default: "
        "the engine's (4096)", metavar="N")
    cuda_graph_bs: list[int] | None = _opt(
        "batch sizes to capture CUDA graphs for (space- or comma-separated); default: SGLang's "
        "sizes up to --max-running-requests", metavar="N")
    disable_cuda_graph: bool = _opt("run the decode passes eagerly on CUDA (no graphs)",
                                    default=False)
    chat_template: str | None = _opt(
        "chat template for /v1/chat/completions: a Jinja file, or the template text itself; "
        "replaces the tokenizer's", metavar="FILE|TEMPLATE")
    context_length: int | None = _opt(
        "most tokens per request, prompt plus completion; default: the target's "
        "max_position_embeddings, cut to --kv-cache-tokens (with a warning) when that is "
        "smaller", metavar="N")
    record_trace: str | None = _opt(
        "write the per-verify trace (JSONL) that `specdial policy replay` reads", metavar="FILE")
    log_interval_s: float | None = _opt(
        "seconds between the engine's log lines while decoding (running/queued requests, KV "
        "usage, tokens/s, acceptance length, steps per slot); 0 turns them off; default: the "
        "engine's (10)", metavar="SECONDS")
    cpu_threads: int | None = _opt(
        "torch intra-op threads of this process (torch.set_num_threads); default: torch's "
        "(the physical cores). Small models at small batch sizes can run faster on fewer "
        "threads, especially on a shared machine (see BENCHMARKS.md)", metavar="N")
    tp_size: int | None = _opt(
        "tensor parallelism: ranks that shard the target and drafter (gloo on the CPU, NCCL on "
        "CUDA); alias --tensor-parallel-size (vLLM); default 1", metavar="N")
    dp_size: int | None = _opt(
        "data parallelism: engine replicas behind one front end, each request to the least "
        "loaded; default 1", metavar="N")
    nnodes: int | None = _opt("nodes the --tp-size ranks spread over (SGLang); default 1",
                              metavar="N")
    node_rank: int | None = _opt(
        "this node's index (SGLang); node 0 serves, the others only run their ranks; "
        "default 0", metavar="K")
    dist_init_addr: str | None = _opt(
        "host:port of node 0's rendezvous (SGLang); default 127.0.0.1 and a free port, one "
        "node only", metavar="HOST:PORT")
    dist_timeout: float | None = _opt(
        "seconds a rank waits for a peer before the engine fails its requests and /health "
        "answers 503 (SGLang's name); default 60", metavar="SECONDS")
    log_level: str = _opt("log level of specdial (and of the HTTP server)", default="info",
                          choices=("critical", "error", "warning", "info", "debug"))

    # ------------------------------------------------------------------ conversion
    def check(self) -> None:
        """Validate the options that are not the Engine's to check. Raises ``ValueError``
        naming the option."""
        if self.cpu_threads is not None and (isinstance(self.cpu_threads, bool)
                                             or self.cpu_threads < 1):
            raise ValueError(f"--cpu-threads must be an integer >= 1, got {self.cpu_threads}")
        if self.log_interval_s is not None and not (self.log_interval_s >= 0
                                                    and math.isfinite(self.log_interval_s)):
            raise ValueError(f"--log-interval-s must be a finite number >= 0 (0: off), got "
                             f"{self.log_interval_s}")
        self._check_files()

    def _check_files(self) -> None:
        """The files the options name, read and validated before any model loads: model
        directories hold a config.json, the adaptive config parses (and knows the initial
        steps), the chat template is readable. Raises ``ValueError`` naming the option."""
        from pathlib import Path

        for flag, path in (("--model-path", self.model_path),
                           ("--draft-model-path", self.draft_model_path)):
            if path is not None and not (Path(path) / "config.json").is_file():
                raise ValueError(f"{flag} {path}: not a model directory (no config.json)")
        if self.speculative_adaptive_config is not None:
            from specdial._core import AdaptiveConfig, validate_initial_steps

            config = AdaptiveConfig.from_file(self.speculative_adaptive_config)
            if self.speculative_adaptive and self.speculative_num_steps is not None:
                validate_initial_steps(config, self.speculative_num_steps)
        self.chat_template_text()

    def chat_template_text(self) -> str | None:
        """``--chat-template`` as template text: the file's content, or the value itself when
        it is a template (contains ``{{`` or ``{%``). Raises ``ValueError`` otherwise."""
        value = self.chat_template
        if value is None:
            return None
        from pathlib import Path

        if "{{" in value or "{%" in value:
            return value
        try:
            return Path(value).read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"--chat-template {value}: neither a readable file nor a Jinja "
                             f"template ({e.strerror})") from None

    def configure_process(self) -> None:
        """Apply the process-wide options (``cpu_threads``) before building engines; the
        engine's loop thread takes the thread count of the thread that builds it."""
        self.check()
        if self.cpu_threads is not None:
            import torch

            torch.set_num_threads(self.cpu_threads)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``specdial.Engine(...)``.

        Options left at None are omitted (the Engine's own default applies), so options that
        an Engine version does not know yet (``max_queued_requests``, ``record_trace``) reach
        it only when the user sets them. ``--speculative-algorithm NONE`` becomes
        ``speculative_algorithm=None``.
        """
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(EngineArgs):
            value = getattr(self, f.name)
            if value is None or f.name in _NOT_ENGINE_KWARGS:
                continue
            if f.name == "speculative_algorithm" and value == NO_SPECULATION:
                value = None
            if f.name == "log_interval_s" and value == 0:
                value = None  # the Engine's "off"
            if f.name == "disable_cuda_graph" and not value:
                continue  # the Engine's default
            kwargs[f.name] = value
        return kwargs

    def build_engine(self) -> Any:
        """Construct the :class:`specdial.Engine` (loads the models; slow). Raises what the
        Engine raises for bad options: ``ValueError``, :class:`specdial.ConfigError`,
        ``FileNotFoundError``, ``NotImplementedError``."""
        from specdial.engine import Engine

        self.configure_process()
        dp = self.parallel_options().dp_size
        if dp > 1:
            if (self.tp_size or 1) > 1:
                raise ValueError("--dp-size > 1 with --tp-size > 1 is not supported yet: the "
                                 "replicas share one process, which holds one "
                                 "tensor-parallel group")
            from specdial.distributed.data_parallel import DataParallelEngine

            replicas: list[Any] = []
            try:
                for _ in range(dp):
                    replicas.append(Engine(**self.engine_kwargs()))
            except BaseException:
                for r in replicas:
                    r.shutdown(drain=False)
                raise
            engine: Any = DataParallelEngine(replicas)
        else:
            engine = Engine(**self.engine_kwargs())
        template = self.chat_template_text()
        if template is not None:
            if not hasattr(engine.tokenizer, "apply_chat_template"):
                engine.shutdown()
                raise ValueError("--chat-template needs a transformers tokenizer; this model's "
                                 "tokenizer has none")
            engine.tokenizer.chat_template = template
        return engine

    def parallel_options(self) -> Any:
        """The :class:`~specdial.distributed.options.ParallelOptions` of these options
        (validated: ``ValueError`` naming the option)."""
        from specdial.distributed.options import ParallelOptions

        given = {k: getattr(self, k) for k in ("tp_size", "dp_size", "nnodes", "node_rank",
                                               "dist_init_addr", "dist_timeout")}
        return ParallelOptions(**{k: v for k, v in given.items() if v is not None})

    def default_model_name(self) -> str:
        """The model name clients use: :data:`BUILTIN_MODEL_NAME` for the built-in models,
        else ``model_path`` as given (vLLM's convention)."""
        return BUILTIN_MODEL_NAME if self.model_path is None else str(self.model_path)


# ---------------------------------------------------------------------- argparse glue
_C = TypeVar("_C")


def _int_list(text: str) -> list[int]:
    """One command-line word of a list of ints: ``"8"`` or ``"1,2,4"``."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers, got {text!r}") from None


class _ExtendInts(argparse.Action):
    """``--x 1 2 4`` or ``--x 1,2,4`` -> ``[1, 2, 4]``."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, [v for part in values for v in part])


def _scalar_type(annotation: Any) -> type:
    """``int | None`` -> ``int``; ``str`` -> ``str``; ``list[int]`` stays."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported option type {annotation!r}")
        return typing.cast(type, args[0])
    return typing.cast(type, annotation)


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one argparse option per field of the dataclass ``cls`` (see the module docstring).

    Fields marked ``positional`` become positional arguments. Defaults are shown in the help.
    """
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta, kind = f.metadata, _scalar_type(hints[f.name])
        help_text = meta.get("help", "")
        if f.default is not None and not meta.get("positional"):
            help_text += f" (default: {f.default})"
        if meta.get("positional"):
            parser.add_argument(f.name, type=kind, help=help_text)
            continue
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            state = "on" if f.default else "off"
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=f.default, help=f"{meta.get('help', '')} (default: {state})")
            continue
        extra: dict[str, Any] = {}
        if typing.get_origin(kind) is list:
            extra.update(type=_int_list, nargs="+", action=_ExtendInts)
        if "choices" in meta:
            extra["choices"] = meta["choices"]
        if "metavar" in meta:
            extra["metavar"] = meta["metavar"]
        extra.setdefault("type", kind)
        parser.add_argument(flag, dest=f.name, default=f.default, help=help_text, **extra)


def config_from_args(cls: type[_C], args: argparse.Namespace) -> _C:
    """Build the dataclass ``cls`` from parsed arguments (fields only; other attributes of
    ``args``, such as the subcommand, are ignored)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]
