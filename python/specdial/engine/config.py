"""Moved: the engine's options live in :mod:`specdial.config.engine` (the bottom layer, which
every layer may import; docs/ARCHITECTURE.md, "Layers").

This module only re-exports them so that code written against the old path keeps working;
new code imports :mod:`specdial.config`. Only modules of the engine layer and above may import
this path (``lint-imports`` checks it), so the worker and lower layers use the new one.
"""

from specdial.config.engine import (ALGORITHMS, AUTO, DTYPES, ENGINE_OPTIONS, FIXED_DEFAULT_STEPS,
                                    GRAPH_MODES, POSITIONAL, EngineConfig, check_choice,
                                    config_of_call, option)

__all__ = ["ALGORITHMS", "AUTO", "DTYPES", "ENGINE_OPTIONS", "EngineConfig", "FIXED_DEFAULT_STEPS",
           "GRAPH_MODES", "POSITIONAL", "check_choice", "config_of_call", "option"]
