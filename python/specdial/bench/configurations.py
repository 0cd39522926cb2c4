"""The configurations of ``specdial bench compare`` and the engine of each.

:func:`parse_configurations` turns ``--configs`` (``no-spec``, ``fixed-K``, ``adaptive``,
``adaptive-user``, optionally with ``+skip``/``+noskip``; see :mod:`specdial.bench.compare`) into
:class:`Configuration` values; :class:`EngineFactory` builds one engine per configuration, the
models loaded once and shared. Split out of :mod:`specdial.bench.compare` (which re-exports these
names) so that what is compared stays apart from how it is run and reported.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from specdial.engine.config import AUTO

__all__ = ["ADAPTIVE", "ADAPTIVE_USER", "DEFAULT_FIXED_STEPS", "NOSKIP_SUFFIX", "NO_SPEC",
           "SKIP_SUFFIX", "Configuration", "EngineFactory", "default_config_names",
           "parse_configurations"]

logger = logging.getLogger("specdial.bench")

NO_SPEC = "no-spec"
ADAPTIVE = "adaptive"
ADAPTIVE_USER = "adaptive-user"
SKIP_SUFFIX = "+skip"
NOSKIP_SUFFIX = "+noskip"
DEFAULT_FIXED_STEPS = (1, 3, 5, 7)


@dataclass(frozen=True)
class Configuration:
    """One engine configuration of a comparison (see the module docstring)."""

    name: str
    kind: str  # "none", "fixed" or "adaptive"
    steps: int | None = None
    adaptive_config: str | None = None
    skip_zero_step_draft_extend: bool | None = None  # None: the engine option as given

    def engine_overrides(self) -> dict[str, Any]:
        """The speculation options of :class:`specdial.Engine` for this configuration
        (``speculative_algorithm=None`` for ``no-spec`` is handled by the factory)."""
        out: dict[str, Any] = {}
        if self.kind == "fixed":
            out = {"speculative_adaptive": False, "speculative_num_steps": self.steps}
        elif self.kind == "adaptive":
            out = {"speculative_adaptive": True, "speculative_num_steps": None,
                   "speculative_adaptive_config": self.adaptive_config}
        if self.skip_zero_step_draft_extend is not None:
            out["skip_zero_step_draft_extend"] = self.skip_zero_step_draft_extend
        return out


def default_config_names(adaptive_config: str | None = None) -> list[str]:
    """``no-spec``, ``fixed-1/3/5/7``, ``adaptive`` and, with a user config, ``adaptive-user``."""
    names = [NO_SPEC, *(f"fixed-{k}" for k in DEFAULT_FIXED_STEPS), ADAPTIVE]
    return names + ([ADAPTIVE_USER] if adaptive_config else [])


def parse_configurations(spec: str | None, adaptive_config: str | None = None
                         ) -> list[Configuration]:
    """The configurations named in ``spec`` (comma-separated; None = the default list).
    Raises ``ValueError`` for an unknown or repeated name, or ``adaptive-user`` without
    ``adaptive_config``."""
    names = default_config_names(adaptive_config) if not spec else [
        s.strip() for s in spec.split(",") if s.strip()]
    out: list[Configuration] = []
    for name in names:
        base, skip = name, None
        for suffix, value in ((SKIP_SUFFIX, True), (NOSKIP_SUFFIX, False)):
            if name.endswith(suffix):
                base, skip = name[:-len(suffix)], value
        m = re.fullmatch(r"fixed-(\d+)", base)
        if base == NO_SPEC and skip is None:
            out.append(Configuration(name, "none", 0))
        elif m:
            out.append(Configuration(name, "fixed", int(m.group(1)),
                                     skip_zero_step_draft_extend=skip))
        elif base == ADAPTIVE:
            out.append(Configuration(name, "adaptive", skip_zero_step_draft_extend=skip))
        elif base == ADAPTIVE_USER:
            if not adaptive_config:
                raise ValueError("configuration 'adaptive-user' needs --adaptive-config FILE")
            out.append(Configuration(name, "adaptive", adaptive_config=str(adaptive_config),
                                     skip_zero_step_draft_extend=skip))
        else:
            raise ValueError(f"unknown configuration {name!r}; use no-spec, fixed-K, adaptive "
                             f"or adaptive-user, the last three optionally with {SKIP_SUFFIX} or "
                             f"{NOSKIP_SUFFIX}")
    if len({c.name for c in out}) != len(out):
        raise ValueError(f"a configuration is repeated in {spec!r}")
    if not out:
        raise ValueError("no configuration to compare")
    return out


class EngineFactory:
    """Builds the engine of each configuration from the engine options ``args``
    (:class:`specdial.engine.args.EngineArgs`; the speculation options are replaced per
    configuration). The models are loaded once, on the first :meth:`build`, and shared through
    ``Engine.from_modules``; if that is not possible (no ``from_modules``, or the modules cannot
    be loaded here), each configuration builds its own ``Engine(...)`` (loading the models once
    per configuration, not per run). ``max_running_requests`` defaults to
    ``default_max_running`` (the largest concurrency)."""

    def __init__(self, args: Any, default_max_running: int | None = None) -> None:
        self.args = args
        self.default_max_running = default_max_running
        self._modules: tuple[Any, Any, Any] | None = None
        self._shared: bool | None = None

    def _algorithm(self) -> str | None:
        """The engine's ``speculative_algorithm`` (None, ``"auto"`` or a name)."""
        return self.args.engine_config().speculative_algorithm

    def _load_modules(self) -> tuple[Any, Any, Any]:
        from specdial.models import load_engine_modules, resolve_draft_algorithm
        from specdial.engine.loading import resolve_placement
        from specdial.engine.resolve import resolve_model_dir

        a = self.args
        algo = self._algorithm()
        draft_dir = (resolve_model_dir(a.draft_model_path, a.flag("draft_model_path"))
                     if a.draft_model_path else None)
        if a.model_path is None:
            from specdial.builtin import builtin_model_path

            model_dir = builtin_model_path("target")
            algo = algo if algo != AUTO else "EAGLE"
            if draft_dir is None and algo in ("EAGLE", "DRAFT"):
                draft_dir = builtin_model_path("eagle" if algo == "EAGLE" else "draft")
        else:
            model_dir = resolve_model_dir(a.model_path, a.flag("model_path"))
            if algo == AUTO:
                algo = None if draft_dir is None else resolve_draft_algorithm(draft_dir)
        device, dtype = resolve_placement(a.device, a.dtype, model_dir)
        return load_engine_modules(model_dir, draft_dir, algo, dtype=dtype, device=device)

    def _kwargs(self, conf: Configuration) -> dict[str, Any]:
        kw: dict[str, Any] = self.args.engine_kwargs()
        for k in ("speculative_num_steps", "speculative_adaptive", "speculative_adaptive_config",
                  "record_trace"):
            kw.pop(k, None)
        kw.update(conf.engine_overrides())
        if kw.get("speculative_adaptive_config") is None:
            kw.pop("speculative_adaptive_config", None)
        if self.args.max_running_requests is None and self.default_max_running:
            kw["max_running_requests"] = self.default_max_running
        return kw

    def build(self, conf: Configuration) -> Any:
        """The engine of ``conf``. Raises what the Engine raises for bad options, and
        ``ValueError`` when a speculative configuration has no drafter."""
        from specdial.engine import Engine

        kw = self._kwargs(conf)
        if self._shared is None:
            self._shared = hasattr(Engine, "from_modules")
            if self._shared:
                try:
                    self._modules = self._load_modules()
                except Exception as e:  # noqa: BLE001 - fall back to Engine(...) per config
                    logger.warning("cannot load the models once for all configurations (%s); "
                                   "each configuration loads its own", e)
                    self._shared = False
        if self._shared and self._modules is not None:
            target, drafter, tokenizer = self._modules
            if conf.kind != "none" and drafter is None:
                raise ValueError(f"configuration {conf.name!r} needs a drafter: pass "
                                 "--draft-model-path (or use the built-in models)")
            for k in ("model_path", "draft_model_path", "speculative_algorithm", "device",
                      "dtype"):
                kw.pop(k, None)
            return Engine.from_modules(target, None if conf.kind == "none" else drafter,
                                       tokenizer, **kw)
        if conf.kind == "none":
            kw["speculative_algorithm"] = None
            kw.pop("draft_model_path", None)
        return Engine(**kw)
