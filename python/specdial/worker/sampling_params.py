"""One request's sampling options, validated: :class:`SamplingParams` and its bounds.

Request validation only (no tensors are built here): :mod:`specdial.worker.batch_sampling`
stacks a batch's options into tensors, :mod:`specdial.worker.sampling` holds the kernels
(processing, sampling, acceptance). The names and rules follow vLLM's ``SamplingParams``
(``min_p``, ``min_tokens``, ``repetition_penalty``, ``include_stop_str_in_output``,
``skip_special_tokens``), OpenAI's (``presence_penalty``, ``frequency_penalty``,
``logit_bias``) and SGLang's (``max_new_tokens``; the aliases ``min_new_tokens`` and
``no_stop_trim``). Bad values raise ``ValueError`` naming the field and the allowed values;
nothing is clamped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch

from specdial.worker.grammar_spec import StructuredSpec, structured_from_sampling
from specdial.worker.logit_bias import normalize_logit_bias

__all__ = ["MAX_ABS_PENALTY", "MAX_REPETITION_PENALTY", "MAX_TEMPERATURE", "MAX_TOP_K",
           "MIN_REPETITION_PENALTY", "MIN_TEMPERATURE", "SamplingParams"]

#: Smallest non-zero temperature accepted. Below it ``logits / T`` is numerically a one-hot
#: anyway; send ``0`` for greedy decoding instead (rejected, never rounded to 0 silently).
MIN_TEMPERATURE = 1e-5

#: Largest temperature accepted: the largest finite float32 (temperatures are float32 tensors;
#: above it the value would become ``inf`` and every distribution a uniform one silently).
MAX_TEMPERATURE = float(torch.finfo(torch.float32).max)

#: Range of ``repetition_penalty`` (``1`` = off). vLLM accepts any finite value > 0; the bounds
#: keep ``logit / r`` and ``logit * r`` far from float32 overflow (an infinite logit would make
#: the softmax NaN) while covering every useful value (1.0 to 2.0 in practice; SGLang allows
#: [0, 2]).
MIN_REPETITION_PENALTY = 1e-4
MAX_REPETITION_PENALTY = 1e4

#: Range of ``presence_penalty`` and ``frequency_penalty`` (OpenAI's and vLLM's).
MAX_ABS_PENALTY = 2.0

#: Largest ``top_k`` accepted before the vocabulary is known (it becomes an int64 tensor; the
#: engine then bounds it by the vocabulary size, :func:`specdial.engine.requests.make_spec`).
MAX_TOP_K = 2**31 - 1

#: Largest seed accepted (``torch.Generator.manual_seed`` takes 64-bit unsigned values).
_MAX_SEED = 2**64 - 1

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """An int or float (not bool) that a float can hold (an int past float's range is not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _bad(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"SamplingParams.{name}: invalid value {value!r}; allowed: {allowed}")


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling options, validated at construction (``__post_init__``).

    - ``max_new_tokens``: int >= 1 (default 128).
    - ``temperature``: float, ``0.0`` = greedy (default), else in
      ``[MIN_TEMPERATURE, MAX_TEMPERATURE]`` (float32's finite range); ints are accepted and
      stored as float.
    - ``top_p``: float in ``(0, 1]`` (default ``1.0`` = off); the most likely token is always
      kept, however small ``top_p`` is (even below float32's smallest positive value).
    - ``top_k``: int, ``-1`` or ``0`` = off (default ``-1``), else ``1..MAX_TOP_K``; a value
      ``>= V`` keeps the whole vocabulary (the engine refuses one above ``V``).
    - ``min_p``: float in ``[0, 1]`` (default ``0`` = off; vLLM's and HF transformers'
      ``min_p``): drop the tokens whose probability after temperature is below ``min_p`` times
      the most likely token's.
    - ``repetition_penalty``: float in ``[MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY]``
      (default ``1`` = off; vLLM's rule over prompt and generated tokens).
    - ``presence_penalty`` / ``frequency_penalty``: floats in ``[-2, 2]`` (default ``0`` = off;
      OpenAI's rule over the generated tokens). Rules of the three penalties:
      :mod:`specdial.worker.processors`. They apply to greedy requests too.
    - ``min_tokens``: int in ``0..max_new_tokens`` (default 0; vLLM's): EOS and
      ``stop_token_ids`` cannot be sampled, and stop strings do not match, before the output
      holds ``min_tokens`` tokens.
    - ``stop_token_ids``: tuple of ints ``>= 0`` (a list is accepted and stored as a tuple).
    - ``ignore_eos``: bool (default False).
    - ``include_stop_str_in_output``: bool (default False; vLLM's): keep the matched stop
      string, or the text of the matched stop token, at the end of the text.
    - ``skip_special_tokens``: bool (default True; vLLM's): leave special tokens out of the
      detokenized text (the token ids are reported either way).
    - ``logit_bias``: token id -> bias added to its logit (OpenAI's and vLLM's
      ``logit_bias``): a mapping (JSON object, string or int keys) or pairs, values in
      ``[-100, 100]``, at most 300 entries; stored as sorted ``(id, bias)`` pairs
      (:mod:`specdial.worker.logit_bias`; ids are checked against the vocabulary by the
      engine). Applied to greedy requests too.
    - ``seed``: ``None`` (default) or int in ``[0, 2**64 - 1]``. A seeded sampling request
      draws every random number from :mod:`specdial.worker.seeded_noise`, keyed by (seed,
      position of the token decided), instead of the engine's generator, and its drafts are
      verified with coupled draws (:func:`speculative_accept`): its tokens are the ones plain
      decoding draws with these keys, so they depend only on its prompt, seed and these
      options, not on the other requests of the batch, the drafter or the steps. Ignored for
      greedy requests.
    - ``structured``: ``None`` (default) or a
      :class:`~specdial.worker.grammar_spec.StructuredSpec`: the output is constrained to a
      JSON schema, regex, EBNF grammar or choice (structured outputs; masks applied to the
      drafts and every verify position, :mod:`specdial.worker.grammar_masks`). ``from_dict``
      builds it from SGLang's ``json_schema`` / ``regex`` / ``ebnf`` keys (one at most).

    ``from_dict`` also takes SGLang's names ``min_new_tokens`` (= ``min_tokens``) and
    ``no_stop_trim`` (= ``include_stop_str_in_output``). Raises ``ValueError`` naming the
    field, the value and the allowed range for a wrong type or an out-of-range value; ``bool``
    is never accepted as a number and nothing is clamped. ``top_k``, ``top_p`` and ``min_p``
    are ignored for greedy requests, which always take the argmax of the processed logits.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    logit_bias: Any = ()
    structured: StructuredSpec | None = None

    def _real(self, name: str, low: float, high: float, allowed: str) -> None:
        v = getattr(self, name)
        if not _is_real(v) or not math.isfinite(v) or not low <= v <= high:
            raise _bad(name, v, allowed)
        object.__setattr__(self, name, float(v))

    def __post_init__(self) -> None:
        v: Any = self.max_new_tokens
        if not _is_int(v) or v < 1:
            raise _bad("max_new_tokens", v, "int >= 1")
        v = self.temperature
        if not _is_real(v) or not (v == 0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE):
            raise _bad("temperature", v, f"0 (greedy) or a float in [{MIN_TEMPERATURE}, "
                       f"{MAX_TEMPERATURE:.7g}] (float32's finite range)")
        object.__setattr__(self, "temperature", float(v))
        v = self.top_p
        if not _is_real(v) or not math.isfinite(v) or not 0 < v <= 1:
            raise _bad("top_p", v, "float in (0, 1]")
        object.__setattr__(self, "top_p", float(v))
        v = self.top_k
        if not _is_int(v) or not -1 <= v <= MAX_TOP_K:
            raise _bad("top_k", v, f"int: -1 or 0 (off), or 1..{MAX_TOP_K}")
        self._real("min_p", 0.0, 1.0, "float in [0, 1] (0: off)")
        self._real("repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY,
                   f"float in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1: off)")
        for name in ("presence_penalty", "frequency_penalty"):
            self._real(name, -MAX_ABS_PENALTY, MAX_ABS_PENALTY, "float in [-2, 2] (0: off)")
        v = self.min_tokens
        if not _is_int(v) or not 0 <= v <= self.max_new_tokens:
            raise _bad("min_tokens", v, f"int in 0..max_new_tokens ({self.max_new_tokens})")
        v = self.stop_token_ids
        if not isinstance(v, (tuple, list)) or not all(_is_int(t) and t >= 0 for t in v):
            raise _bad("stop_token_ids", v, "tuple (or list) of ints >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(v))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "bool")
        v = self.seed
        if v is not None and (not _is_int(v) or not 0 <= v <= _MAX_SEED):
            raise _bad("seed", v, "None or int in [0, 2**64 - 1]")
        object.__setattr__(self, "logit_bias", normalize_logit_bias(self.logit_bias))
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            raise _bad("structured", self.structured, "None or a StructuredSpec")
        if self.structured is not None and self.min_tokens:
            raise ValueError(f"SamplingParams.min_tokens: {self.min_tokens} is not allowed with "
                             f"a structured-output constraint ({self.structured.field}); the "
                             "grammar decides where the output ends; allowed: 0")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """Build from API input; ``None`` or ``{}`` gives the defaults.

        Raises ``ValueError`` for a non-mapping, for an unknown key (naming it and listing the
        allowed keys), for an SGLang alias given together with its field, and for any invalid
        value (see the class docstring).
        """
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"SamplingParams: expected a dict, got {type(d).__name__}")
        allowed = [f.name for f in fields(cls)]
        d = dict(d)
        for alias, name in _ALIASES.items():
            if alias in d:
                if name in d:
                    raise ValueError(f"SamplingParams.{name}: given twice, as {name!r} and as "
                                     f"its SGLang name {alias!r}; allowed: one of them")
                d[name] = d.pop(alias)
        d["structured"] = structured_from_sampling(d)  # SGLang's json_schema / regex / ebnf
        for key in d:
            if key not in allowed:
                raise ValueError(f"SamplingParams: unknown key {key!r}; "
                                 f"allowed keys: {', '.join(allowed + list(_ALIASES))}")
        return cls(**d)

    @property
    def is_greedy(self) -> bool:
        """True when ``temperature == 0``: the request always takes the target argmax."""
        return self.temperature == 0.0

    @property
    def has_penalty(self) -> bool:
        """True when a repetition, presence or frequency penalty is on (the request's token
        counts are then kept by the worker)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


#: SGLang's sampling-parameter names accepted by :meth:`SamplingParams.from_dict`.
_ALIASES = {"min_new_tokens": "min_tokens", "no_stop_trim": "include_stop_str_in_output"}
