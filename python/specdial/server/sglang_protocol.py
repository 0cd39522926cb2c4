"""SGLang's native request bodies and their conversion to engine jobs (the routes:
:mod:`specdial.server.sglang_api`, whose docstring lists the fields).

- :class:`GenerateRequest`, :class:`TokenizeRequest`, :class:`DetokenizeRequest`: the bodies
  (strict: unknown fields are a 400 naming them); :func:`parse_body` validates one.
- :func:`sampling_from_sglang`: SGLang ``sampling_params`` -> the engine's sampling parameters
  (SGLang names renamed to the engine's, :class:`~specdial.worker.sampling.SamplingParams`).
- :func:`prepare_generate`: a ``/generate`` body -> jobs, with SGLang's parallel sampling
  (``sampling_params.n``) and the limits of :mod:`specdial.server.limits`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdial.engine.api import LogprobOptions
from specdial.server.jobs import choices, make_job
from specdial.server.limits import check_prompt_count, check_stop
from specdial.server.protocol import MAX_N, bad_request, error_field, json_object
from specdial.server.runs import Job
from specdial.server.state import ServerState
from specdial.worker.logprobs import MAX_TOP_LOGPROBS

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "DetokenizeRequest", "GenerateRequest", "TokenizeRequest",
           "parallel_n", "parse_body", "per_prompt", "prepare_generate", "sampling_from_sglang"]

#: SGLang's ``max_new_tokens`` default.
DEFAULT_MAX_NEW_TOKENS = 128

# SGLang sampling keys without an implementation -> (neutral values, what to use instead)
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "spaces_between_special_tokens": ((True,), "detokenize output_ids yourself"),
    "custom_params": ((None,), "no custom logit processors are implemented"),
}
_SAMPLING = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
             "presence_penalty", "repetition_penalty", "min_new_tokens", "stop",
             "stop_token_ids", "ignore_eos", "skip_special_tokens", "no_stop_trim",
             "sampling_seed", "seed", "logit_bias", "json_schema", "regex", "ebnf"}
#: SGLang names -> the engine's (:class:`~specdial.worker.sampling.SamplingParams`)
_RENAMED = {"min_new_tokens": "min_tokens", "no_stop_trim": "include_stop_str_in_output",
            "sampling_seed": "seed"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class GenerateRequest(_Strict):
    """``POST /generate`` body (see the module docstring)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    model: str | None = None  # accepted for clients that always send it


class TokenizeRequest(_Strict):
    """``POST /tokenize``: ``prompt`` (a string or a list) or chat ``messages``."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    """``POST /detokenize``: ``tokens`` (ids, or a list of id lists)."""

    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """``raw`` (a JSON object) validated as ``model``. Raises :class:`APIError` 400
    (``invalid_json``; or naming the first invalid field: ``unrecognized_parameter`` for an
    unknown one, else ``invalid_value``)."""
    body = json_object(raw)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        path, msg = error_field(e)
        loc = ".".join(path) or None
        code = "unrecognized_parameter" if first["type"] == "extra_forbidden" else "invalid_value"
        raise bad_request(f"Invalid value for '{loc}': {msg}", loc, code) from None


def sampling_from_sglang(params: dict[str, Any] | None, where: str) -> tuple[dict[str, Any],
                                                                             list[str] | None]:
    """SGLang ``sampling_params`` -> (engine sampling params, stop strings). Raises
    :class:`APIError` 400 naming ``where.key`` for an unknown key or a non-neutral value of an
    unimplemented one."""
    # unset sampling fields are left to the engine's defaults (the model's, then SGLang's)
    out: dict[str, Any] = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS}
    stop = None
    given: dict[str, str] = {}  # engine name -> the key that set it
    for key, value in (params or {}).items():
        name = f"{where}.{key}"
        if key in _NEUTRAL:
            neutral, instead = _NEUTRAL[key]
            if not any(value == v and type(value) is type(v) or value is v for v in neutral):
                raise bad_request(f"'{name}' = {json.dumps(value)} is not supported ({instead})",
                                  name, "unsupported_parameter")
        elif key not in _SAMPLING:
            raise bad_request(f"Unrecognized sampling parameter: '{name}'; supported: "
                              f"{', '.join(sorted(_SAMPLING))}", name, "unrecognized_parameter")
        elif key == "stop":
            if value is not None:
                stop = [value] if isinstance(value, str) else value
                if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
                    raise bad_request(f"'{name}' must be a string or a list of strings, got "
                                      f"{json.dumps(value)[:60]}", name, "invalid_type")
        elif value is not None:
            name = _RENAMED.get(key, key)
            if name in given:
                raise bad_request(f"'{where}' gives '{given[name]}' and '{key}', the same "
                                  "parameter; give it once", f"{where}.{key}", "invalid_value")
            given[name] = key
            out[name] = value
    return out, stop


def parallel_n(params: list[Any], single: bool) -> int:
    """SGLang's ``sampling_params.n`` (parallel samples per prompt): an int in 1..MAX_N, the
    same for every prompt (SGLang takes one ``parallel_sample_num`` per request). Raises
    :class:`APIError` 400 naming the field otherwise."""
    ns = []
    for i, sp in enumerate(params):
        name = "sampling_params.n" if single else f"sampling_params[{i}].n"
        n = (sp or {}).get("n", 1)
        n = 1 if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise bad_request(f"'{name}' = {json.dumps(n)} is not allowed; allowed: an integer "
                              f"in 1..{MAX_N}", name, "invalid_value")
        ns.append(n)
    if len(set(ns)) > 1:
        raise bad_request(f"'sampling_params' gives different 'n' per prompt ({ns}); give one "
                          "value for all prompts", "sampling_params.n", "invalid_value")
    return ns[0]


def per_prompt(value: Any, n: int, name: str) -> list[Any]:
    """``value`` for each of ``n`` prompts: a list as it is (400 naming ``name`` unless it has
    ``n`` entries), anything else repeated."""
    if isinstance(value, list):
        if len(value) != n:
            raise bad_request(f"'{name}' has {len(value)} entries for {n} prompts", name,
                              "invalid_value")
        return value
    return [value] * n


def prepare_generate(state: ServerState,
                     raw: bytes) -> tuple[GenerateRequest, bool, list[Job], list[Any]]:
    """Parse, check and tokenize a ``/generate`` request (in the parsing thread): the
    request, whether it was a single prompt, the jobs and the ``rid`` per prompt (per output
    with ``n`` > 1). Raises :class:`APIError` 400 naming the field."""
    req: GenerateRequest = parse_body(GenerateRequest, raw)
    single, prompts = _prompts(req)
    check_prompt_count(prompts, state.limits)
    lp = None
    if req.return_logprob:
        if req.return_text_in_logprobs:
            state.require_tokenizer()
        lp = LogprobOptions(req.top_logprobs_num, None if req.logprob_start_len == -1
                            else req.logprob_start_len)
    elif req.top_logprobs_num or req.logprob_start_len != -1:
        raise bad_request("'logprob_start_len' and 'top_logprobs_num' need "
                          "'return_logprob': true", "return_logprob", "invalid_value")
    params = per_prompt(req.sampling_params, len(prompts), "sampling_params")
    rids = per_prompt(req.rid, len(prompts), "rid")
    if any(r == "" for r in rids):  # "" could never be named to /abort_request
        raise bad_request("'rid' must be a non-empty string (the id /abort_request ends the "
                          "request by) or left out for a new one", "rid", "invalid_value")
    n = parallel_n(params, single)
    if n * len(prompts) > state.limits.max_prompts:
        raise bad_request(f"{len(prompts)} prompts x 'n' = {n} make {n * len(prompts)} "
                          f"sequences; at most {state.limits.max_prompts} are allowed per "
                          "request (--max-prompts)", "sampling_params.n", "too_many_prompts")
    jobs = [_job(state, i, prompt, sp, text=req.text is not None, single=single, lp=lp)
            for i, (prompt, sp) in enumerate(zip(prompts, params))]
    if n > 1:  # SGLang's parallel sampling: a list of n outputs per prompt, prompt-major
        jobs = choices(jobs, n)
        rids = [None if r is None else f"{r}-{j}" for r in rids for j in range(n)]
        single = False
    return req, single, jobs, rids


def _prompts(req: GenerateRequest) -> tuple[bool, list[Any]]:
    """Whether ``req`` gives a single prompt, and its prompts (texts or token id lists)."""
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("give exactly one of 'text' and 'input_ids'", "text",
                          "invalid_value")
    if req.text is not None:
        single = isinstance(req.text, str)
        prompts: list[Any] = [req.text] if single else list(req.text)
    else:
        ids = req.input_ids or []
        single = not ids or isinstance(ids[0], int)
        prompts = [list(ids)] if single else [list(p) for p in ids]
    if not prompts:
        raise bad_request("the prompt list is empty", "text", "invalid_value")
    return single, prompts


def _job(state: ServerState, i: int, prompt: Any, sp: dict[str, Any] | None, *, text: bool,
         single: bool, lp: LogprobOptions | None) -> Job:
    """The job of prompt ``i`` with its SGLang ``sampling_params`` ``sp`` (``n`` left out);
    ``text``: the prompts were given as ``text`` (else ``input_ids``)."""
    label = "sampling_params" if single else f"sampling_params[{i}]"
    sp = {k: v for k, v in (sp or {}).items() if k != "n"}
    sent = sp.get("max_new_tokens") is not None
    sampling, stop = sampling_from_sglang(sp, label)
    check_stop(stop, state.limits)
    max_new = sampling.pop("max_new_tokens")
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise bad_request(f"Invalid value for '{label}.max_new_tokens': "
                          f"{str(max_new)[:40]}; allowed: an int >= 1",
                          f"{label}.max_new_tokens", "invalid_value")
    field = "text" if text else "input_ids"
    job = make_job(state, i, prompt, templated=False, max_tokens=max_new,
                   max_tokens_param=f"{label}.max_new_tokens",
                   prompt_param=field, label=field if single else f"{field}[{i}]", chat=False,
                   sampling=sampling, stop=stop, max_tokens_sent=sent)
    if lp is not None and lp.prompt_start is not None and job.input_ids is not None \
            and lp.prompt_start >= len(job.input_ids):
        raise bad_request(f"'logprob_start_len' ({lp.prompt_start}) must be below the "
                          f"prompt's {len(job.input_ids)} tokens", "logprob_start_len",
                          "invalid_value")
    job.logprobs = lp
    return job
