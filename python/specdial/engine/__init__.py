"""The engine package: :class:`~specdial.engine.core.Engine` and what it is made of.

- :class:`EngineConfig`, the engine's options, their defaults and their validation, lives in
  the bottom layer, :mod:`specdial.config` (re-exported here and by ``specdial.engine.config``);
- :mod:`specdial.engine.args`: :class:`EngineArgs`, the command-line view of the config
  (``serve``, ``generate``, ``bench``) and the argparse glue;
- :mod:`specdial.engine.core`: :class:`Engine` (models, its parts; the public API);
- :mod:`specdial.engine.build`: the wiring (scheduler, worker, policy, loop from a config);
- :mod:`specdial.engine.loop`: the loop thread (plan -> passes -> report); its messages in
  :mod:`specdial.engine.messages`, stop strings in :mod:`specdial.engine.stops`;
- :mod:`specdial.engine.requests`: request validation and the stream drivers;
- :mod:`specdial.engine.api`: the serving contract (:class:`StreamChunk`, :class:`EngineStats`);
- :mod:`specdial.engine.output`: SGLang-shaped output dicts.

``Engine`` is imported lazily (it needs torch), so the light modules (``args``, ``api``) load
without it.
"""

from typing import TYPE_CHECKING

from specdial.config import EngineConfig

__all__ = ["Engine", "EngineConfig"]

if TYPE_CHECKING:
    from specdial.engine.core import Engine


def __getattr__(name: str) -> object:
    if name == "Engine":
        from specdial.engine.core import Engine

        return Engine
    raise AttributeError(f"module 'specdial.engine' has no attribute {name!r}")
