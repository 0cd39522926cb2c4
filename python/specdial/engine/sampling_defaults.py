"""The sampling values a request gets when it leaves a field unset, per entry point.

One rule, written down here so every entry point states it the same way:

- Server routes (``/generate``, ``/v1/completions``, ``/v1/chat/completions``): SGLang's
  ``SamplingParams`` defaults, which are also OpenAI's: ``temperature`` 1.0, ``top_p`` 1.0,
  ``top_k`` -1 (off), ``min_p`` 0.0 (:data:`SGLANG_DEFAULTS`; source: SGLang
  ``docs/sampling_params.md``, ``class SamplingParams``).
- Benchmarks (``specdial bench``): greedy (:data:`BENCH_TEMPERATURE` = 0.0), as SGLang's
  ``bench_serving`` and ``vllm bench serve`` send ``temperature`` 0 unless told otherwise.
- Offline ``specdial.Engine`` and ``specdial generate``: greedy (:data:`OFFLINE_TEMPERATURE`
  = 0.0) today. This differs from SGLang's offline ``sgl.Engine`` (which samples at 1.0); the
  ``--help`` of ``generate`` and ``bench`` says so. Moving the offline default to SGLang's is
  issue 26 item 2 (not done yet: many callers rely on greedy).

The model's ``generation_config.json`` sampling fields are not applied (the built-in target's
has none).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

__all__ = ["SGLANG_DEFAULTS", "SERVER_TEMPERATURE", "BENCH_TEMPERATURE", "OFFLINE_TEMPERATURE"]

#: SGLang's ``SamplingParams`` defaults for the fields specdial supports (read-only).
SGLANG_DEFAULTS: Mapping[str, float | int] = MappingProxyType(
    {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0})
#: ``temperature`` of a server request that leaves it unset (SGLang's and OpenAI's).
SERVER_TEMPERATURE: float = float(SGLANG_DEFAULTS["temperature"])
#: ``temperature`` of ``specdial bench`` requests unless ``--temperature`` is given (greedy,
#: as SGLang's ``bench_serving`` and ``vllm bench serve``).
BENCH_TEMPERATURE: float = 0.0
#: ``temperature`` of the offline Engine and ``specdial generate`` when unset (greedy).
OFFLINE_TEMPERATURE: float = 0.0
