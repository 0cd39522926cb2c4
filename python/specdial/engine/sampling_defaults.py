"""The sampling values a request gets when it leaves a field unset, per entry point.

One rule, written down here so every entry point states it the same way:

- Server routes (``/generate``, ``/v1/completions``, ``/v1/chat/completions``): SGLang's
  ``SamplingParams`` defaults, which are also OpenAI's: ``temperature`` 1.0, ``top_p`` 1.0,
  ``top_k`` -1 (off), ``min_p`` 0.0 (:data:`SGLANG_DEFAULTS`; source: SGLang
  ``docs/sampling_params.md``, ``class SamplingParams``).
- Benchmarks (``specdial bench``): greedy (:data:`BENCH_TEMPERATURE` = 0.0), as SGLang's
  ``bench_serving`` and ``vllm bench serve`` send ``temperature`` 0 unless told otherwise.
- Offline ``specdial.Engine`` and ``specdial generate``: SGLang's offline ``sgl.Engine``
  defaults, the same as the server's (:data:`OFFLINE_TEMPERATURE` = 1.0, applied by
  :func:`with_offline_defaults` where the engine validates a request). Pass ``temperature``
  0 for greedy decoding (output identical to target-only greedy decoding).
- :class:`~specdial.worker.sampling.SamplingParams` itself stays greedy when built with no
  ``temperature``: it is the engine's internal request type (warm-up and graph capture build
  it), not an entry point.

The model's ``generation_config.json`` sampling fields are not applied (the built-in target's
has none).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

__all__ = ["SGLANG_DEFAULTS", "SERVER_TEMPERATURE", "BENCH_TEMPERATURE", "OFFLINE_TEMPERATURE",
           "with_offline_defaults"]

#: SGLang's ``SamplingParams`` defaults for the fields specdial supports (read-only).
SGLANG_DEFAULTS: Mapping[str, float | int] = MappingProxyType(
    {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0})
#: ``temperature`` of a server request that leaves it unset (SGLang's and OpenAI's).
SERVER_TEMPERATURE: float = float(SGLANG_DEFAULTS["temperature"])
#: ``temperature`` of ``specdial bench`` requests unless ``--temperature`` is given (greedy,
#: as SGLang's ``bench_serving`` and ``vllm bench serve``).
BENCH_TEMPERATURE: float = 0.0
#: ``temperature`` of the offline Engine and ``specdial generate`` when unset (SGLang's
#: ``sgl.Engine``: 1.0).
OFFLINE_TEMPERATURE: float = float(SGLANG_DEFAULTS["temperature"])


def with_offline_defaults(sampling_params: Any) -> Any:
    """``sampling_params`` with ``temperature`` set to :data:`OFFLINE_TEMPERATURE` when unset.

    ``None`` becomes ``{"temperature": OFFLINE_TEMPERATURE}``; a mapping without a
    ``temperature`` key is copied with it added (the caller's dict is not changed); anything
    else (a mapping that names ``temperature``, or a wrong type, which
    ``SamplingParams.from_dict`` then refuses with a message naming it) is returned as is.
    Server routes always name ``temperature``, so this changes only offline requests."""
    if sampling_params is None:
        return {"temperature": OFFLINE_TEMPERATURE}
    if isinstance(sampling_params, Mapping) and "temperature" not in sampling_params:
        return {**sampling_params, "temperature": OFFLINE_TEMPERATURE}
    return sampling_params
