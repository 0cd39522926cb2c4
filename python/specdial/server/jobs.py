"""Requests -> engine jobs: tokenizing, the context-length checks, ``n`` choices and the
OpenAI fields -> the engine's sampling parameters.

Mapping to the engine: ``max_tokens`` / ``max_completion_tokens`` -> ``max_new_tokens``
(default: 16 for completions, as OpenAI's; the rest of the context for chat), ``temperature``
(default 1.0, as OpenAI's; 0 = greedy), ``top_p``, ``seed``, ``ignore_eos`` (the vLLM/SGLang
extension: generate ``max_tokens`` past EOS), ``stop`` (strings, matched by the
engine on the detokenized text and not included in the output unless
``include_stop_str_in_output``), and under the same names ``presence_penalty``,
``frequency_penalty`` and vLLM's extras ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``
(:data:`~specdial.server.protocol.SAMPLING_EXTRAS`; rules in
:class:`~specdial.worker.sampling.SamplingParams`). With a tokenizer the server
encodes the prompt itself (to check it against ``engine.context_length`` and to fill in the
default ``max_tokens``) and submits token ids; text from a tokenizer's chat template is encoded
without adding special tokens again. SGLang's ``/generate`` reuses :func:`make_job` and
:func:`choices` (:mod:`specdial.server.sglang_protocol`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specdial.server.limits import check_prompt_chars
from specdial.server.protocol import (SAMPLING_EXTRAS, ChatCompletionRequest, CompletionRequest,
                                      bad_request, choice_seed)
from specdial.server.runs import Job
from specdial.server.structured import structured_sampling
from specdial.server.state import ServerState

__all__ = ["DEFAULT_COMPLETION_MAX_TOKENS", "check_token_ids", "choices", "encode",
           "make_job", "openai_sampling", "openai_stop"]

#: ``max_tokens`` default of ``/v1/completions`` (OpenAI's).
DEFAULT_COMPLETION_MAX_TOKENS = 16


def encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """``text`` -> token ids (Python ints) with a Hugging Face tokenizer, a ``tokenizers``
    one (``.ids``) or one whose ``encode`` takes no ``add_special_tokens``."""
    try:
        enc = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except TypeError:
        enc = tokenizer.encode(text)
    return [int(t) for t in getattr(enc, "ids", enc)]


def check_token_ids(lists: list[list[int]], vocab_size: int | None, param: str,
                    where: str | None = None) -> None:
    """Raises :class:`APIError` 400 (``invalid_value``, naming ``param``, or ``where`` in the
    message, e.g. ``prompt[1]``, and the range) for a token id outside ``[0, vocab_size)``, the
    range the engine allows a prompt's ids (:func:`specdial.engine.requests.make_spec`);
    ``vocab_size`` None (an engine that does not say it) checks nothing here, and the
    tokenizer's own refusal still answers 400."""
    if vocab_size is None:
        return
    for ids in lists:
        if ids and 0 <= min(ids) and max(ids) < vocab_size:
            continue
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"'{where or param}': invalid token id {bad}; allowed: token ids "
                              f"in [0, {vocab_size}) (the vocabulary)", param, "invalid_value")


def check_context(engine: Any, n: int, max_tokens: int | None, *, label: str, prompt_param: str,
                  max_tokens_param: str, max_tokens_sent: bool = True) -> None:
    """Raises :class:`APIError` 400 ``context_length_exceeded`` when ``n`` prompt tokens leave
    no room in the engine's context, or with ``max_tokens`` exceed it, naming what the client
    sent: ``max_tokens_param`` when it sent it, else the prompt (``prompt_param``; the default
    overflows). The message names the option that set the limit when the engine says
    (``engine.context_label``, e.g. ``kv_cache_tokens`` cutting the model's context) and the
    allowed values."""
    ctx = int(engine.context_length)
    origin = getattr(engine, "context_label", None)
    limit = f"This model's maximum context length is {ctx} tokens" + (
        f" ({origin})" if isinstance(origin, str) and origin else "")
    if n >= ctx:
        raise bad_request(f"{limit}; the prompt ({label}) has {n} tokens, leaving no room for "
                          f"a completion; allowed: at most {ctx - 1} prompt tokens",
                          prompt_param, "context_length_exceeded")
    if max_tokens is None or n + max_tokens <= ctx:
        return
    if max_tokens_sent:
        raise bad_request(
            f"{limit}; you requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} "
            f"for the completion). Reduce '{max_tokens_param}' (allowed: <= {ctx - n} for "
            "this prompt) or the prompt", max_tokens_param, "context_length_exceeded")
    raise bad_request(
        f"{limit}; the prompt ({label}) has {n} tokens, and with the default "
        f"'{max_tokens_param}' {max_tokens} (not sent) they exceed it; allowed: at most "
        f"{max(ctx - max_tokens, 0)} prompt tokens, or send '{max_tokens_param}' <= {ctx - n}",
        prompt_param, "context_length_exceeded")


def make_job(state: ServerState, index: int, prompt: str | list[int], *, templated: bool,
             max_tokens: int | None, max_tokens_param: str, prompt_param: str, label: str,
             chat: bool, sampling: dict[str, Any], stop: list[str] | None,
             max_tokens_sent: bool = True) -> Job:
    """One engine request for ``prompt`` (text, or token ids); ``label`` names it in error
    messages. Raises :class:`APIError` 400 for an empty prompt, a token id outside the
    vocabulary (:func:`check_token_ids`) or a prompt that does not fit the context
    (:func:`check_context`; ``max_tokens_sent`` False: ``max_tokens`` is a default the client
    did not send)."""
    engine = state.engine
    ctx = int(engine.context_length)
    tokenizer = engine.tokenizer
    if isinstance(prompt, list):
        ids = prompt
        # here, before anything decodes them (echo): an id past the vocabulary is the
        # request's fault (400 naming the prompt), and one past int64 must not reach a tokenizer
        check_token_ids([ids], state.vocab_size, prompt_param, label)
    elif tokenizer is None:  # the engine reports what it cannot do (RequestError)
        n = DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
        return Job(index, prompt, None, {**sampling, "max_new_tokens": n}, stop)
    else:
        check_prompt_chars(prompt, state.prompt_chars, label=label, param=prompt_param,
                           context_length=ctx)
        ids = encode(tokenizer, prompt, add_special_tokens=not templated)
    if not ids:
        raise bad_request(f"'{label}' is empty (0 tokens)", prompt_param, "invalid_value")
    check_context(engine, len(ids), max_tokens, label=label, prompt_param=prompt_param,
                  max_tokens_param=max_tokens_param, max_tokens_sent=max_tokens_sent)
    if max_tokens is None:
        max_tokens = ctx - len(ids) if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, ctx - len(ids))
    return Job(index, None, ids, {**sampling, "max_new_tokens": max_tokens}, stop)


def choices(jobs: list[Job], n: int, whole: bool = False) -> list[Job]:
    """``n`` choices per job (choice ``i`` of prompt ``p``: index ``p * n + i``), seeded
    choices with :func:`choice_seed`. ``whole`` (a non-streaming response): choices ``i >= 1``
    of a job with prompt logprobs (``echo``) ask the engine for none and report choice 0's
    (``Job.prompt_logprobs_from``): they are the same numbers, and each engine request with
    prompt logprobs prefills its whole prompt without the prefix cache, so ``n`` choices cost
    ``n`` full prefills (one request held the engine, and the requests behind it, for ``n``
    times as long). A stream keeps them per choice (each choice's first event carries them)."""
    if n == 1:
        return jobs
    out = []
    for job in jobs:
        first = job.index * n
        shared = (whole and job.logprobs is not None and job.logprobs.prompt_start is not None)
        for i in range(n):
            params = dict(job.sampling_params)
            if "seed" in params:
                params["seed"] = choice_seed(int(params["seed"]), i)
            extra: dict[str, Any] = {}
            if shared and i:
                assert job.logprobs is not None
                extra = dict(logprobs=dataclasses.replace(job.logprobs, prompt_start=None),
                             prompt_logprobs_from=first)
            out.append(dataclasses.replace(job, index=first + i, sampling_params=params,
                                           counts_prompt=i == 0, **extra))
    return out


def openai_sampling(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """The engine's sampling parameters of an OpenAI request (without ``max_new_tokens``,
    which :func:`make_job` adds). A field left unset or null is left out: the engine applies
    its sampling defaults (the target's ``generation_config.json``, then SGLang's and
    OpenAI's: ``temperature`` :data:`~specdial.engine.sampling_defaults.DEFAULT_TEMPERATURE`; see
    :mod:`specdial.engine.sampling_defaults`)."""
    params: dict[str, Any] = {}
    for name in ("temperature", "top_p"):
        value = getattr(req, name)
        if value is not None:
            params[name] = value
    if req.seed is not None:
        params["seed"] = req.seed
    if req.ignore_eos:
        params["ignore_eos"] = True
    for name in SAMPLING_EXTRAS:  # same names as the engine's; null: the engine's default
        value = getattr(req, name)
        if value is not None:
            params[name] = value
    params.update(structured_sampling(req))  # response_format, guided_*, structured_outputs
    return params


def openai_stop(req: CompletionRequest | ChatCompletionRequest) -> list[str] | None:
    """The request's ``stop`` as a list of strings (None: none)."""
    if req.stop is None:
        return None
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)
