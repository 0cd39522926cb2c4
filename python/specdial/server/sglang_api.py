"""SGLang's native endpoints (and vLLM's tokenizer endpoints) on the specdial server.

- ``POST /generate`` (SGLang's request and response shapes): ``text`` (a string or a list) or
  ``input_ids`` (token ids or a list of such lists), ``sampling_params`` (a dict, or one per
  prompt), ``stream``, ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``,
  ``return_text_in_logprobs``, ``rid``. Answers ``{"text", "output_ids", "meta_info"}`` per
  prompt (a list for a list input); ``meta_info`` holds ``id``, ``finish_reason``,
  ``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` (0: no prefix cache),
  ``spec_verify_ct``, ``spec_accept_length``, ``spec_steps_histogram``, ``e2e_latency``
  (seconds) and, with ``return_logprob``, SGLang's logprob lists
  (:mod:`specdial.engine.output`). Streaming: server-sent events of the same object with
  ``text`` and ``output_ids`` cumulative (SGLang's default), ``index`` added for a list input,
  ending with ``data: [DONE]``.
  ``sampling_params`` keys: ``max_new_tokens`` (default 128), ``temperature`` (1.0),
  ``top_p``, ``top_k``, ``min_p``, ``frequency_penalty``, ``presence_penalty``,
  ``repetition_penalty``, ``min_new_tokens``, ``stop``, ``stop_token_ids``, ``ignore_eos``,
  ``skip_special_tokens``, ``no_stop_trim`` (keep the matched stop string or token text),
  ``sampling_seed`` (or ``seed``), ``logit_bias`` (token id -> bias, OpenAI's rule:
  :mod:`specdial.worker.logit_bias`) and ``n`` (SGLang's parallel sampling, 1..MAX_N, the same
  for every prompt: the answer is a list of ``n`` outputs per prompt, prompt-major, each with
  ``index``; a seeded request's sample ``j`` uses
  :func:`~specdial.server.protocol.choice_seed` ``(seed, j)`` as ``/v1/completions`` does, and
  its ``rid`` becomes ``rid-j``). SGLang keys without an implementation are accepted at their
  neutral value only (``spaces_between_special_tokens: true``, no constrained decoding) and are
  otherwise a 400 naming what to use instead.
- ``GET /server_info`` (also ``/get_server_info``): the server's options, ``version`` and
  ``internal_states``: one entry (one engine) with ``speculative_num_steps`` (the current steps
  of the slot serving the current batch, or the latest batch when idle), ``avg_spec_accept_length``
  (``1 + accepted drafts / request-verifies with drafts``, since start; None before any),
  ``slots`` (every slot's state from the engine's ``slot_states``) and the counters.
- ``GET /get_model_info``; ``POST /tokenize`` (also ``/v1/tokenize``; ``prompt`` or chat
  ``messages``) -> ``{"tokens", "count", "max_model_len"}``; ``POST /detokenize`` (also
  ``/v1/detokenize``) -> ``{"text", "prompt"}`` (SGLang's and vLLM's key for the same text);
  ``GET /tokenizer_info`` (vLLM's; what lm-evaluation-harness's remote tokenizer reads);
  ``GET /version``.

Errors are the server's JSON errors (``{"error": {"message", "type", "param", "code"}}``). A
prompt the engine failed (finish reason ``error``, :mod:`specdial.engine.ends`) makes
``/generate`` answer 500 with the usual body, its ``meta_info.finish_reason`` carrying the cause
and an ``error`` object added to that prompt's output; a stream ends with that output as its
last event (``error`` added), then ``data: [DONE]``.
Parsing, tokenizing and detokenizing run in the server's parsing thread
(``ServerState.offload``), and ``/generate`` applies the prompt-count, stop-string and
prompt-character limits of :mod:`specdial.server.limits`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdial.engine.api import LogprobOptions
from specdial.engine.ends import error_body, is_failure
from specdial.engine.output import OutputAccumulator
from specdial.server.app import (_DONE, ServerState, _choices, _ClientGone, _encode,
                                 _engine_error, _Job, _make_job, _Run, _RunStreamingResponse,
                                 _watch_disconnect)
from specdial.server.chat import render_chat
from specdial.server.limits import (check_detokenize_tokens, check_prompt_count, check_stop,
                                    check_tokenize_chars, request_id, tokenize_char_limit)
from specdial.server.protocol import MAX_N, APIError, bad_request
from specdial.worker.logprobs import MAX_TOP_LOGPROBS

__all__ = ["GenerateRequest", "add_sglang_routes", "sampling_from_sglang", "server_info"]

#: SGLang's ``max_new_tokens`` default.
DEFAULT_MAX_NEW_TOKENS = 128

# SGLang sampling keys without an implementation -> (neutral values, what to use instead)
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "spaces_between_special_tokens": ((True,), "detokenize output_ids yourself"),
    "regex": ((None,), "no constrained decoding is implemented"),
    "json_schema": ((None,), "no constrained decoding is implemented"),
    "ebnf": ((None,), "no constrained decoding is implemented"),
    "custom_params": ((None,), "no custom logit processors are implemented"),
}
_SAMPLING = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
             "presence_penalty", "repetition_penalty", "min_new_tokens", "stop",
             "stop_token_ids", "ignore_eos", "skip_special_tokens", "no_stop_trim",
             "sampling_seed", "seed", "logit_bias"}
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


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object", None, "invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or None
        code = "unrecognized_parameter" if first["type"] == "extra_forbidden" else "invalid_value"
        raise bad_request(f"Invalid value for '{loc}': {first['msg']}", loc, code) from None


def sampling_from_sglang(params: dict[str, Any] | None, where: str) -> tuple[dict[str, Any],
                                                                             list[str] | None]:
    """SGLang ``sampling_params`` -> (engine sampling params, stop strings). Raises
    :class:`APIError` 400 naming ``where.key`` for an unknown key or a non-neutral value of an
    unimplemented one."""
    out: dict[str, Any] = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, "temperature": 1.0}
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
        elif value is not None:
            name = _RENAMED.get(key, key)
            if name in given:
                raise bad_request(f"'{where}' gives '{given[name]}' and '{key}', the same "
                                  "parameter; give it once", f"{where}.{key}", "invalid_value")
            given[name] = key
            out[name] = value
    return out, stop


def _parallel_n(params: list[Any], single: bool) -> int:
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


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise bad_request(f"'{name}' has {len(value)} entries for {n} prompts", name,
                              "invalid_value")
        return value
    return [value] * n


def _slot_steps(stats: Any) -> int:
    """Steps of the slot serving the current (else the latest, else a size-1) batch."""
    states = stats.slot_states
    bs = stats.last_decode_batch_size or 1
    if states:
        serving = [s for s in states if s["lower_bound"] <= bs] or states[:1]
        return int(serving[-1]["steps"])
    if stats.last_decode_steps is not None:
        return int(stats.last_decode_steps)
    return int(next(iter(stats.steps_per_slot.values()), 0))


def server_info(state: ServerState) -> dict[str, Any]:
    """The ``/server_info`` body (module docstring)."""
    from specdial import __version__

    s = state.engine.stats()
    engine = state.engine
    internal = {
        "speculative_num_steps": _slot_steps(s),
        "avg_spec_accept_length": (1 + s.num_accepted_tokens / s.num_drafts
                                   if s.num_drafts else None),
        "slots": [dict(d) for d in s.slot_states],
        "last_decode_steps": s.last_decode_steps,
        "last_decode_batch_size": s.last_decode_batch_size,
        "num_running_reqs": s.running, "num_queued_reqs": s.queued,
        "kv_pages_used": s.kv_pages_used, "kv_pages_total": s.kv_pages_total,
        "spec_num_drafts": s.num_drafts, "spec_num_accepted_tokens": s.num_accepted_tokens,
        "step_switches": s.step_switches,
    }
    return {**state.server_args, "served_model_name": state.model_name,
            "speculative_algorithm": getattr(engine, "speculative_algorithm", None),
            "context_length": int(engine.context_length), "version": __version__,
            "internal_states": [internal]}


def add_sglang_routes(app: FastAPI, state: ServerState,
                      check_admitting: Callable[[], None]) -> None:
    """Register the module's endpoints on ``app`` (called by :func:`create_app`)."""
    engine = state.engine
    tokenize_chars = tokenize_char_limit(state.limits, state.prompt_chars)

    def tokenizer() -> Any:
        if engine.tokenizer is None:
            raise APIError(400, "this server has no tokenizer", code="no_tokenizer")
        return engine.tokenizer

    def prepare_generate(raw: bytes) -> tuple[GenerateRequest, bool, list[_Job], list[Any]]:
        """Parse, check and tokenize a ``/generate`` request (in the parsing thread): the
        request, whether it was a single prompt, the jobs and the ``rid`` per prompt."""
        req: GenerateRequest = _parse(GenerateRequest, raw)
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
        check_prompt_count(prompts, state.limits)
        lp = None
        if req.return_logprob:
            if req.return_text_in_logprobs:
                tokenizer()
            lp = LogprobOptions(req.top_logprobs_num, None if req.logprob_start_len == -1
                                else req.logprob_start_len)
        elif req.top_logprobs_num or req.logprob_start_len != -1:
            raise bad_request("'logprob_start_len' and 'top_logprobs_num' need "
                              "'return_logprob': true", "return_logprob", "invalid_value")
        params = _per_prompt(req.sampling_params, len(prompts), "sampling_params")
        rids = _per_prompt(req.rid, len(prompts), "rid")
        n = _parallel_n(params, single)
        if n * len(prompts) > state.limits.max_prompts:
            raise bad_request(f"{len(prompts)} prompts x 'n' = {n} make {n * len(prompts)} "
                              f"sequences; at most {state.limits.max_prompts} are allowed per "
                              "request (--max-prompts)", "sampling_params.n", "too_many_prompts")
        jobs: list[_Job] = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            label = "sampling_params" if single else f"sampling_params[{i}]"
            sp = {k: v for k, v in (sp or {}).items() if k != "n"}
            sampling, stop = sampling_from_sglang(sp, label)
            check_stop(stop, state.limits)
            max_new = sampling.pop("max_new_tokens")
            if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
                raise bad_request(f"Invalid value for '{label}.max_new_tokens': "
                                  f"{str(max_new)[:40]}; allowed: an int >= 1",
                                  f"{label}.max_new_tokens", "invalid_value")
            job = _make_job(state, i, prompt, templated=False, max_tokens=max_new,
                            max_tokens_param=f"{label}.max_new_tokens",
                            prompt_param="text" if req.text is not None else "input_ids",
                            label="text" if single else f"text[{i}]", chat=False,
                            sampling=sampling, stop=stop)
            if lp is not None and lp.prompt_start is not None and job.input_ids is not None \
                    and lp.prompt_start >= len(job.input_ids):
                raise bad_request(f"'logprob_start_len' ({lp.prompt_start}) must be below the "
                                  f"prompt's {len(job.input_ids)} tokens", "logprob_start_len",
                                  "invalid_value")
            job.logprobs = lp
            jobs.append(job)
        if n > 1:  # SGLang's parallel sampling: a list of n outputs per prompt, prompt-major
            jobs = _choices(jobs, n)
            rids = [None if r is None else f"{r}-{j}" for r in rids for j in range(n)]
            single = False
        return req, single, jobs, rids

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        arrival = time.perf_counter()
        check_admitting()
        req, single, jobs, rids = await state.offload(prepare_generate, await request.body())
        decode = state.decode if req.return_text_in_logprobs else None
        outs = [OutputAccumulator(j.input_ids or [], return_logprob=req.return_logprob,
                                  decode=decode) for j in jobs]
        ids_ = [r or uuid.uuid4().hex for r in rids]
        run = _Run(state, jobs, arrival, request_id(request.scope))
        run.start()
        watcher = asyncio.create_task(_watch_disconnect(request, run))
        streaming = False

        def body(i: int) -> dict[str, Any]:
            out = outs[i].result()
            out["meta_info"].update(id=ids_[i], cached_tokens=0,
                                    e2e_latency=time.perf_counter() - arrival)
            if not single:
                out["index"] = i
            if is_failure(outs[i].finish_reason):
                out["error"] = error_body(outs[i].finish_reason)[1]["error"]
            return out

        try:
            try:
                await run.wait_started()
                if req.stream:
                    streaming = True
                    return _RunStreamingResponse(_events(run, outs, body), run)
                async for c, chunk in run.events():
                    outs[c.index].add(chunk)
            except _ClientGone:
                return Response(status_code=499)
            except APIError:
                raise
            except Exception as e:  # noqa: BLE001 - engine errors become API errors
                raise _engine_error(e, {"max_new_tokens": "sampling_params.max_new_tokens",
                                        "min_tokens": "sampling_params.min_new_tokens",
                                        "prompt": "text"}) from None
            results = [body(i) for i in range(len(jobs))]
            for r in results:
                r.pop("index", None)
            failure = run.failure()
            status = 200 if failure is None else error_body(failure)[0]
            return JSONResponse(results[0] if single else results, status_code=status)
        finally:
            watcher.cancel()
            if not streaming:
                run.close()

    async def _events(run: _Run, outs: list[OutputAccumulator],
                      body: Callable[[int], dict[str, Any]]) -> AsyncIterator[str]:
        try:
            async for c, chunk in run.events():
                outs[c.index].add(chunk)
                yield f"data: {json.dumps(body(c.index), ensure_ascii=False)}\n\n"
                if chunk.finished and is_failure(chunk.finish_reason):
                    break  # that event carried the error; the others are aborted on close
        except _ClientGone:
            return
        except Exception as e:  # noqa: BLE001 - reported in-band once streaming started
            yield f"data: {json.dumps(_engine_error(e, {}).body())}\n\n"
        yield _DONE

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info() -> JSONResponse:
        return JSONResponse(await asyncio.to_thread(server_info, state))

    @app.get("/get_model_info")
    async def get_model_info() -> JSONResponse:
        path = state.server_args.get("model_path")
        return JSONResponse({"model_path": path, "tokenizer_path": path,
                             "served_model_name": state.model_name, "is_generation": True})

    @app.get("/version")
    async def version() -> JSONResponse:
        from specdial import __version__

        return JSONResponse({"version": __version__})

    def do_tokenize(raw: bytes) -> dict[str, Any]:
        """The ``/tokenize`` answer (in the parsing thread)."""
        req: TokenizeRequest = _parse(TokenizeRequest, raw)
        tok = tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt",
                              "invalid_value")
        if req.messages is not None:
            try:
                text, templated = render_chat(tok, req.messages)
            except (ValueError, KeyError, TypeError) as e:
                raise bad_request(str(e), "messages", "invalid_value") from None
            if not req.add_generation_prompt:
                raise bad_request("'add_generation_prompt': false is not supported; the chat "
                                  "prompt always opens the assistant's turn",
                                  "add_generation_prompt", "unsupported_parameter")
            check_tokenize_chars([text], tokenize_chars, param="messages")
            ids = _encode(tok, text, add_special_tokens=not templated)
            return {"tokens": ids, "count": len(ids), "max_model_len": int(engine.context_length)}
        assert req.prompt is not None
        texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        check_tokenize_chars(texts, tokenize_chars, param="prompt")
        tokens = [_encode(tok, t, add_special_tokens=req.add_special_tokens) for t in texts]
        single = isinstance(req.prompt, str)
        return {"tokens": tokens[0] if single else tokens,
                "count": len(tokens[0]) if single else [len(t) for t in tokens],
                "max_model_len": int(engine.context_length)}

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return JSONResponse(await state.offload(do_tokenize, await request.body()))

    def do_detokenize(raw: bytes) -> dict[str, Any]:
        """The ``/detokenize`` answer (in the parsing thread)."""
        req: DetokenizeRequest = _parse(DetokenizeRequest, raw)
        tok = tokenizer()
        single = not req.tokens or isinstance(req.tokens[0], int)
        lists: list[list[int]] = [req.tokens] if single else req.tokens  # type: ignore[list-item]
        check_detokenize_tokens(sum(len(ids) for ids in lists), state.limits)
        texts = []
        for ids in lists:
            try:
                texts.append(str(tok.decode(ids, skip_special_tokens=req.skip_special_tokens)))
            except TypeError:
                texts.append(str(tok.decode(ids)))
            except Exception as e:  # noqa: BLE001 - ids the tokenizer cannot decode
                raise bad_request(f"cannot decode tokens: {e}", "tokens", "invalid_value") from None
        text: Any = texts[0] if single else texts
        return {"text": text, "prompt": text}

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return JSONResponse(await state.offload(do_detokenize, await request.body()))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        tok = tokenizer()
        info = {"tokenizer_class": type(tok).__name__,
                "model_max_length": int(engine.context_length)}
        for name in ("eos_token", "bos_token", "pad_token", "chat_template"):
            value = getattr(tok, name, None)
            info[name] = value if isinstance(value, str) or value is None else str(value)
        return JSONResponse(info)
