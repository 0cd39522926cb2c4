"""The command-line view of :class:`~specdial.engine.config.EngineConfig`:
:class:`EngineArgs`, and the argparse glue that turns a dataclass into command-line options.

:class:`EngineArgs` is :class:`EngineConfig` (every engine option, with the engine's defaults,
defined there once) plus the options of the process (``cpu_threads``, ``log_level``,
``chat_template``); ``specdial serve`` / ``generate`` (:mod:`specdial.server.config`) and
``specdial bench`` extend it, so no command imports the HTTP server to get the engine's options.
The argparse options are generated from the fields (:func:`add_dataclass_arguments`): the flag
is the field name with dashes, the help text is the field's ``help`` metadata, the type comes
from the annotation (or the ``type`` metadata), booleans get ``--x/--no-x``; fields marked
``cli=False`` get none. :meth:`EngineArgs.engine_config` is the one place that turns the
options into the :class:`EngineConfig` of :class:`specdial.Engine` (the command line's own
spellings: ``--speculative-algorithm NONE`` / ``STANDALONE``, ``--log-interval-s 0``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

from specdial.config import EngineConfig, option as _opt

__all__ = ["BOOL_FLAGS_GIVEN", "BUILTIN_MODEL_NAME", "NO_SPECULATION", "BoolFlag", "EngineArgs",
           "add_dataclass_arguments", "config_from_args"]

#: The name under which the built-in models (``model_path`` None) are served.
BUILTIN_MODEL_NAME = "specdial-default"

#: ``--speculative-algorithm`` value meaning "no speculation" (Engine ``speculative_algorithm=None``).
NO_SPECULATION = "NONE"


@dataclass
class EngineArgs(EngineConfig):
    """Engine options shared by ``serve``, ``generate`` and ``bench``: the fields of
    :class:`EngineConfig` (validated when :meth:`engine_config` builds it) plus the process's."""

    chat_template: str | None = _opt(
        "chat template for /v1/chat/completions: a Jinja file, or the template text itself; "
        "replaces the tokenizer's", metavar="FILE|TEMPLATE")
    log_level: str = _opt("log level of specdial (and of the HTTP server)", default="info",
                          choices=("critical", "error", "warning", "info", "debug"))

    #: option attribute -> the flag the user actually passed for it (``MODEL``, ``--model``,
    #: ...), set by the command line after folding aliases; errors name that flag.
    flag_names: typing.ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        """Nothing: command-line spellings are converted and validated by
        :meth:`engine_config` (called by :meth:`check`)."""

    # ------------------------------------------------------------------ conversion
    def check(self) -> None:
        """Validate every option: the engine's (:meth:`engine_config`) and the process's.
        Raises ``ValueError`` naming the option."""
        if self.cpu_threads is not None and (isinstance(self.cpu_threads, bool)
                                             or self.cpu_threads < 1):
            raise ValueError(f"--cpu-threads must be an integer >= 1, got {self.cpu_threads}")
        if self.log_interval_s is not None and not (self.log_interval_s >= 0
                                                    and math.isfinite(self.log_interval_s)):
            raise ValueError(f"--log-interval-s must be a finite number >= 0 (0: off), got "
                             f"{self.log_interval_s}")
        self.engine_config()
        self._check_files()

    def _check_files(self) -> None:
        """The files the options name, read and validated before any model loads: models are
        directories holding a config.json or Hugging Face ids found in the local cache (or
        downloaded), the adaptive config parses (and takes ``--speculative-num-steps`` as its
        bound), the chat template is readable. Raises ``ValueError`` (``OSError`` for an
        unreadable config file) naming the option."""
        from specdial.engine.resolve import resolve_model_dir

        for dest in ("model_path", "draft_model_path"):
            path = getattr(self, dest)
            if path is not None:  # a directory, or a Hugging Face id found (or downloaded)
                resolve_model_dir(path, self.flag(dest))
        if self.speculative_adaptive_config is not None:
            from specdial._core import AdaptiveConfig
            from specdial.engine.policy_setup import cap_candidates

            config = AdaptiveConfig.from_file(self.speculative_adaptive_config)
            if self.speculative_adaptive and self.speculative_num_steps is not None:
                cap_candidates(config, self.speculative_num_steps)  # the bound fits the config
        self.chat_template_text()

    def flag(self, dest: str) -> str:
        """The flag that set the option ``dest``: the one the user passed (an alias such as
        ``--model`` or the positional ``MODEL``), else ``--dest-with-dashes``."""
        return self.flag_names.get(dest, "--" + dest.replace("_", "-"))

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

    def engine_config(self) -> EngineConfig:
        """The :class:`EngineConfig` of these options (validated; ``ValueError`` naming the
        field). ``--speculative-algorithm NONE`` / ``STANDALONE`` mean what they mean to the Engine
        (:data:`specdial.config.engine.ALGORITHM_ALIASES`), ``--log-interval-s 0`` ``None`` (the Engine's "off"). A command may widen a field to
        None ("derive it"); None there, for a field whose engine default is not None, means
        the engine's default. Python-only fields (``cli=False``: the test hooks) are passed
        when set from Python, else keep the engine's defaults."""
        values = {}
        for f in dataclasses.fields(EngineConfig):
            value = getattr(self, f.name)
            if f.metadata.get("cli") is False and value == f.default:
                continue  # a Python-only option left at the engine's default
            if value is None and f.default is not None:
                continue  # left to the engine's default by a command
            values[f.name] = value
        if values.get("log_interval_s") == 0:
            values["log_interval_s"] = None
        return EngineConfig(**values)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``specdial.Engine(...)``: every field of
        :meth:`engine_config`."""
        return self.engine_config().to_dict()

    def build_engine(self) -> Any:
        """Construct the :class:`specdial.Engine` (loads the models; slow; ``dp_size``
        replicas behind it when ``dp_size > 1``). Raises what the Engine raises for bad
        options: ``ValueError``, :class:`specdial.ConfigError`, ``FileNotFoundError``,
        ``NotImplementedError``."""
        from specdial.engine.core import Engine

        self.configure_process()
        engine = Engine(**self.engine_kwargs())
        template = self.chat_template_text()
        if template is not None:
            if not hasattr(engine.tokenizer, "apply_chat_template"):
                engine.shutdown()
                raise ValueError("--chat-template needs a transformers tokenizer; this model's "
                                 "tokenizer has none")
            engine.tokenizer.chat_template = template
        return engine

    def default_model_name(self) -> str:
        """The model name clients use: :data:`BUILTIN_MODEL_NAME` for the built-in models,
        else ``model_path`` as given (vLLM's convention)."""
        return BUILTIN_MODEL_NAME if self.model_path is None else str(self.model_path)


# ---------------------------------------------------------------------- argparse glue
_C = TypeVar("_C")


def int_list(text: str) -> list[int]:
    """One command-line word of a list of ints: ``"8"`` or ``"1,2,4"``."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers, got {text!r}") from None


class ExtendInts(argparse.Action):
    """``--x 1 2 4`` or ``--x 1,2,4`` -> ``[1, 2, 4]``."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, [v for part in values for v in part])


#: Namespace attribute where :class:`BoolFlag` records the flags given: ``{dest: [flag, ...]}``.
BOOL_FLAGS_GIVEN = "bool_flags_given"


class BoolFlag(argparse.BooleanOptionalAction):
    """``--x`` / ``--no-x`` (argparse's ``BooleanOptionalAction``). With ``record_given`` set
    (by the command that reads it, e.g. :func:`specdial.engine.cache_flags.add_prefix_cache_flags`)
    it also records each flag given under :data:`BOOL_FLAGS_GIVEN` of the namespace, so that
    the command can refuse contradicting ones rather than let the last one win unseen; that
    command removes the record again when it reads it, so ``vars(args)`` stays the fields."""

    record_given = False

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        if not self.record_given:
            return
        given = dict(getattr(namespace, BOOL_FLAGS_GIVEN, None) or {})
        given[self.dest] = [*given.get(self.dest, []), str(option_string)]
        setattr(namespace, BOOL_FLAGS_GIVEN, given)


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
        meta = f.metadata
        kind = meta["type"] if "type" in meta else _scalar_type(hints[f.name])
        help_text = meta.get("help", "")
        if f.default is not None and not meta.get("positional"):
            help_text += f" (default: {f.default})"
        if meta.get("cli") is False:
            continue
        if meta.get("positional"):
            parser.add_argument(f.name, type=kind, help=help_text)
            continue
        flag = "--" + f.name.replace("_", "-")
        if kind is bool and f.name.startswith("disable_") and not f.default:
            # SGLang's --disable-* switches: no confusing --no-disable-* negation
            parser.add_argument(flag, dest=f.name, action="store_true",
                                help=f"{meta.get('help', '')} (default: off)")
            continue
        if kind is bool:
            state = "on" if f.default else "off"
            parser.add_argument(flag, dest=f.name, action=BoolFlag,
                                default=f.default, help=f"{meta.get('help', '')} (default: {state})")
            continue
        extra: dict[str, Any] = {}
        if typing.get_origin(kind) is list:
            extra.update(type=int_list, nargs="+", action=ExtendInts)
        if "choices" in meta:
            extra["choices"] = meta["choices"]
        if "metavar" in meta:
            extra["metavar"] = meta["metavar"]
        extra.setdefault("type", kind)
        parser.add_argument(flag, dest=f.name, default=f.default, help=help_text, **extra)


def config_from_args(cls: type[_C], args: argparse.Namespace) -> _C:
    """Build the dataclass ``cls`` from parsed arguments (fields only; other attributes of
    ``args``, such as the subcommand, are ignored)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                  if f.metadata.get("cli") is not False})
