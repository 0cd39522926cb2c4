"""The bounds of a request's numeric fields that depend on the model (the vocabulary size).

:class:`~specdial.worker.sampling.SamplingParams` checks what it can alone (types, finite
floats, absolute ranges); :func:`check_vocab_bounds`, called by
:func:`specdial.engine.requests.make_spec`, adds the vocabulary's: a token id outside the
vocabulary is refused wherever a request carries one (the prompt already is), so no value
reaches the scheduler or a tensor that it does not fit (an id of ``2**63`` would overflow the
scheduler's int64; one past the vocabulary would silently never match).
"""

from __future__ import annotations

from typing import Any

from specdial.engine.api import RequestError
from specdial.worker.sampling import SamplingParams

__all__ = ["MAX_STOP_TOKEN_IDS", "check_vocab_bounds", "context_label"]

#: Most ``stop_token_ids`` of one request (each is compared with every emitted token).
MAX_STOP_TOKEN_IDS = 1024


def check_vocab_bounds(params: SamplingParams, vocab_size: int, label: str = "") -> None:
    """Raise :class:`RequestError` naming the field and its range when ``stop_token_ids``
    holds an id outside ``[0, vocab_size)`` or more than :data:`MAX_STOP_TOKEN_IDS` ids, or
    ``top_k`` is above ``vocab_size`` (``top_k`` is -1 or 0 (off, SGLang and vLLM) or
    ``1..vocab_size``)."""
    ids = params.stop_token_ids
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(f"{label}stop_token_ids: {len(ids)} ids; allowed: at most "
                           f"{MAX_STOP_TOKEN_IDS}", "stop_token_ids")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"{label}stop_token_ids: invalid id {bad}; allowed: token ids in "
                           f"[0, {vocab_size}) (the vocabulary)", "stop_token_ids")
    if params.top_k > vocab_size:
        raise RequestError(f"{label}top_k: invalid value {params.top_k}; allowed: -1 or 0 "
                           f"(off), or 1..{vocab_size} (the vocabulary size)", "top_k")


def context_label(cfg: Any, ctx: int) -> str:
    """How a request's error names the context limit of ``ctx`` tokens: by the option that
    set it. ``context_length N`` when the user gave it; when the model's context length was cut
    to a smaller KV cache (:func:`specdial.engine.build.kv_limits`), ``kv_cache_tokens``, the
    page rounding and how to allow more; else the model's context length. ``cfg``: the
    engine's :class:`~specdial.config.engine.EngineConfig`."""
    if cfg.context_length is not None:
        return f"context_length {ctx}"
    kv, ps = cfg.kv_cache_tokens, cfg.page_size
    if kv is not None and ctx == -(-kv // ps) * ps:
        return (f"the context of {ctx} tokens that kv_cache_tokens={kv} leaves ({ctx // ps} "
                f"page(s) of page_size {ps}; the model's context length is cut to the KV "
                f"cache, so a larger kv_cache_tokens allows more)")
    return f"context_length {ctx} (the model's, as no context_length was given)"
