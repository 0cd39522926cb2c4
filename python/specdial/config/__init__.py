"""The bottom layer: the typed settings every other layer reads, and nothing else.

- :mod:`specdial.config.engine`: :class:`EngineConfig`, every option of :class:`specdial.Engine`
  with its default and its check (:func:`config_of_call` maps ``Engine(*args, **kwargs)`` to
  one; :func:`option` declares a field with its command-line metadata);
- :mod:`specdial.config.parallel`: :class:`ParallelOptions` (``tp_size``, ``dp_size``,
  ``nnodes``, ... with SGLang's names) and :class:`DistConfig` (one rank's place in a
  tensor-parallel group);
- :mod:`specdial.config.cuda_graph`: the ``cuda_graph_bs`` option's defaults and check.

These modules import only the Rust core (``specdial._core``) and each other: no torch, and no
module above them (docs/ARCHITECTURE.md, "Layers"; checked by ``lint-imports``).
"""

from specdial.config.cuda_graph import default_cuda_graph_bs, normalize_graph_bs
from specdial.config.engine import (ALGORITHMS, AUTO, DTYPES, ENGINE_OPTIONS, FIXED_DEFAULT_STEPS,
                                    GRAPH_MODES, POSITIONAL, EngineConfig, check_choice,
                                    config_of_call, option)
from specdial.config.parallel import (DEFAULT_STARTUP_TIMEOUT_S, DEFAULT_TIMEOUT_S, DistConfig,
                                      ParallelOptions, free_port, parse_addr)

__all__ = ["ALGORITHMS", "AUTO", "DEFAULT_STARTUP_TIMEOUT_S", "DEFAULT_TIMEOUT_S", "DTYPES",
           "DistConfig", "ENGINE_OPTIONS", "EngineConfig", "FIXED_DEFAULT_STEPS", "GRAPH_MODES",
           "POSITIONAL", "ParallelOptions", "check_choice", "config_of_call",
           "default_cuda_graph_bs", "free_port", "normalize_graph_bs", "option", "parse_addr"]
