"""The sampling values a request gets when it leaves a field unset, per entry point.

One rule, written down here so every entry point states it the same way:

- Server routes (``/generate``, ``/v1/completions``, ``/v1/chat/completions``): SGLang's
  ``SamplingParams`` defaults, which are also OpenAI's: ``temperature`` 1.0, ``top_p`` 1.0,
  ``top_k`` -1 (off), ``min_p`` 0.0 (:data:`SGLANG_DEFAULTS`; source: SGLang
  ``docs/sampling_params.md``, ``class SamplingParams``). The routes send only the fields a
  request sets; the engine fills the rest (:func:`with_defaults`), as for offline requests.
- Benchmarks (``specdial bench``): greedy (:data:`BENCH_TEMPERATURE` = 0.0), as SGLang's
  ``bench_serving`` and ``vllm bench serve`` send ``temperature`` 0 unless told otherwise.
- Offline ``specdial.Engine`` and ``specdial generate``: SGLang's offline ``sgl.Engine``
  defaults, the same as the server's (:data:`DEFAULT_TEMPERATURE` = 1.0, applied by
  :func:`with_defaults` where the engine validates a request). Pass ``temperature``
  0 for greedy decoding (output identical to target-only greedy decoding).
- :class:`~specdial.worker.sampling.SamplingParams` itself stays greedy when built with no
  ``temperature``: it is the engine's internal request type (warm-up and graph capture build
  it), not an entry point.

Under both the server's and the offline rule, the target model's ``generation_config.json``
comes first (SGLang's ``--sampling-defaults model``, its default, and vLLM's
``--generation-config auto``): :func:`model_sampling_defaults` reads the sampling fields the
model's authors recommend, and :func:`request_defaults` puts them over SGLang's. ``openai``
ignores the file. The built-in target's file sets no sampling field.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from specdial.config.engine import SAMPLING_DEFAULTS_CHOICES
from specdial.worker.sampling_params import SamplingParams

__all__ = ["SGLANG_DEFAULTS", "DEFAULT_TEMPERATURE", "BENCH_TEMPERATURE",
           "SAMPLING_DEFAULTS_CHOICES", "model_sampling_defaults", "request_defaults",
           "with_defaults"]

#: SGLang's ``SamplingParams`` defaults for the fields specdial supports (read-only).
SGLANG_DEFAULTS: Mapping[str, float | int] = MappingProxyType(
    {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0})
#: ``temperature`` of a request that leaves it unset, server and offline alike, when the
#: model's ``generation_config.json`` does not set one (SGLang's ``sgl.Engine`` and server,
#: OpenAI's API: 1.0).
DEFAULT_TEMPERATURE: float = float(SGLANG_DEFAULTS["temperature"])
#: ``temperature`` of ``specdial bench`` requests unless ``--temperature`` is given (greedy,
#: as SGLang's ``bench_serving`` and ``vllm bench serve``).
BENCH_TEMPERATURE: float = 0.0


#: The ``generation_config.json`` fields taken as request defaults (SGLang's list).
MODEL_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(model_dir: str | Path | None,
                            mode: str = "model") -> dict[str, float | int]:
    """The sampling defaults the target model's ``generation_config.json`` recommends.

    ``mode`` ``"model"`` (SGLang's default): the fields of :data:`MODEL_SAMPLING_FIELDS`
    that the file sets to a value (not ``null``), and ``temperature`` 0.0 (greedy) when it
    says ``"do_sample": false`` (what Hugging Face ``generate`` does with that file, and
    SGLang); a file that does not mention ``do_sample`` keeps its sampling fields. No file, or
    ``model_dir`` None (the built-in models), gives ``{}``. ``"openai"`` gives ``{}``.

    Raises ``ValueError`` naming ``sampling_defaults`` for another ``mode``, and naming the
    file for one that is not a JSON object or holds a value ``SamplingParams`` refuses (the
    message gives the field and its allowed values)."""
    if mode not in SAMPLING_DEFAULTS_CHOICES:
        raise ValueError(f"sampling_defaults: invalid value {mode!r}; allowed: "
                         f"{', '.join(SAMPLING_DEFAULTS_CHOICES)}")
    if mode == "openai" or model_dir is None:
        return {}
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    out = {k: data[k] for k in MODEL_SAMPLING_FIELDS if data.get(k) is not None}
    if data.get("do_sample") is False:
        out["temperature"] = 0.0
    try:  # SamplingParams holds the one validation of the values
        SamplingParams(**out)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    return out


def request_defaults(model_defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What a request that leaves a field unset gets, server and offline alike:
    ``temperature`` :data:`DEFAULT_TEMPERATURE` (1.0) under
    ``model_defaults`` (from :func:`model_sampling_defaults`)."""
    return {"temperature": DEFAULT_TEMPERATURE, **(model_defaults or {})}


def with_defaults(sampling_params: Any, defaults: Mapping[str, Any]) -> Any:
    """``sampling_params`` with every key of ``defaults`` it does not name added.

    ``None`` becomes a copy of ``defaults``; a mapping is copied (the caller's dict is not
    changed); anything else (a wrong type, which ``SamplingParams.from_dict`` then refuses
    with a message naming it) is returned as is. An SGLang alias counts as its field:
    nothing here has one."""
    if sampling_params is None:
        return dict(defaults)
    if isinstance(sampling_params, Mapping):
        return {**{k: v for k, v in defaults.items() if k not in sampling_params},
                **sampling_params}
    return sampling_params

