"""OpenAI's endpoints: the ``APIRouter`` :data:`router`, mounted by
:func:`~specdial.server.app.create_app`.

- ``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids or a
  list of such lists; each prompt gives ``n`` choices (``index`` = prompt position * n +
  choice), each its own engine request sharing nothing but the prompt, all running
  concurrently. With a ``seed``, choice ``i`` of a prompt uses
  :func:`~specdial.server.protocol.choice_seed` ``(seed, i)`` (choice 0: the seed itself).
  ``logprobs: N`` reports the target's log-probabilities (:mod:`specdial.server.logprob_format`);
  ``echo`` prepends the prompt to the text (and its tokens, with the prefill's prompt
  logprobs, to ``logprobs``): lm-evaluation-harness's loglikelihood payload.
- ``POST /v1/chat/completions``: ``messages`` rendered by the tokenizer's chat template, or by
  the simple template of :mod:`specdial.server.chat` when it has none; ``n`` choices, and
  ``logprobs`` / ``top_logprobs``.
- both: non-streaming JSON, or server-sent events (``stream: true``) in OpenAI's chunk format
  ending with ``data: [DONE]``; ``stream_options.include_usage`` adds a last chunk with empty
  ``choices`` and the ``usage`` (other chunks then carry ``"usage": null``). ``usage`` holds
  ``prompt_tokens``, ``completion_tokens`` and ``total_tokens``, summed over the choices, and
  ``prompt_tokens_details.cached_tokens`` (prompt tokens served by the prefix cache; bodies:
  :mod:`specdial.server.openai_responses`, the usage: :meth:`specdial.server.runs.Run.usage`).
- both: SGLang's ``rid`` field names the request for ``POST /abort_request``, which ends its
  choices with finish reason ``abort`` and the text generated until then
  (:mod:`specdial.server.ops_api`).
- ``GET /v1/models`` (and ``/v1/models/{id}``): the one served model (vLLM's card, with
  ``root`` and ``max_model_len``).

Supported request fields and their validation: :mod:`specdial.server.protocol`; the mapping
to the engine's sampling parameters: :mod:`specdial.server.jobs`. Parsing, checks, chat
templates and tokenization run in the server's parsing thread (``ServerState.offload``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from specdial.engine.api import LogprobOptions
from specdial.engine.ends import error_body
from specdial.server.big_json import json_response
from specdial.server.chat import render_chat
from specdial.server.errors import engine_error
from specdial.server.jobs import choices, make_job, openai_sampling, openai_stop
from specdial.server.limits import check_prompt_count, check_stop, request_id
from specdial.server.openai_responses import full_response, sse_events
from specdial.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                      bad_request, parse_request)
from specdial.server.runs import ClientGone, Job, RunStreamingResponse, watch_disconnect
from specdial.server.state import ServerState, StateDep

__all__ = ["model_card", "prepare_chat", "prepare_completion", "router", "serve"]

#: OpenAI's routes.
router = APIRouter()


def model_card(state: ServerState) -> dict[str, Any]:
    """The served model's ``/v1/models`` entry."""
    # "root": vLLM's model card field, which `vllm bench serve` reads without --model
    return {"id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "specdial", "root": state.model_name,
            "max_model_len": int(state.engine.context_length)}


@router.get("/v1/models")
async def models(state: StateDep) -> JSONResponse:
    """OpenAI's model list: the one served model."""
    return JSONResponse({"object": "list", "data": [model_card(state)]})


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, state: StateDep) -> JSONResponse:
    """One model's card; 404 (``model_not_found``) for a name other than the served one."""
    state.check_model(model_id)
    return JSONResponse(model_card(state))


def prepare_completion(state: ServerState, raw: bytes) -> tuple[CompletionRequest, list[Job]]:
    """Parse, check and tokenize a completion request (in the parsing thread). Raises
    :class:`APIError` (400 naming the field, 404 for another model)."""
    req = cast(CompletionRequest, parse_request(raw, "completion"))
    state.check_model(req.model)
    prompts = req.prompts()
    check_prompt_count(prompts, state.limits)
    sampling, stop = openai_sampling(req), openai_stop(req)
    check_stop(stop, state.limits)
    logprobs = None
    if req.logprobs is not None or req.echo:
        state.check_tokenizer("logprobs" if req.logprobs is not None else "echo")
    if req.logprobs is not None:
        logprobs = LogprobOptions(top_n=req.logprobs, prompt_start=0 if req.echo else None)
    jobs = []
    for i, p in enumerate(prompts):
        job = make_job(state, i, p, templated=False, max_tokens=req.max_tokens,
                       max_tokens_param="max_tokens", prompt_param="prompt",
                       label="prompt" if len(prompts) == 1 else f"prompt[{i}]",
                       chat=False, sampling=sampling, stop=stop)
        echo = (p if isinstance(p, str) else str(state.engine.tokenizer.decode(p))) if req.echo \
            else None
        jobs.append(dataclasses.replace(job, logprobs=logprobs, echo=echo))
    return req, choices(jobs, req.n or 1, whole=not req.stream)


@router.post("/v1/completions")
async def completions(request: Request, state: StateDep) -> Response:
    """OpenAI's completions (module docstring)."""
    arrival = time.perf_counter()
    state.check_admitting()
    req, jobs = await state.offload(prepare_completion, state, await request.body())
    return await serve(state, request, req, jobs, arrival, chat=False,
                       params={"max_new_tokens": "max_tokens", "input_ids": "prompt",
                               "prompt": "prompt"})


def prepare_chat(state: ServerState,
                 raw: bytes) -> tuple[ChatCompletionRequest, list[Job], str]:
    """Parse, check, render and tokenize a chat request (in the parsing thread); also
    returns the name of the max-tokens field used. Raises :class:`APIError` as
    :func:`prepare_completion`."""
    req = cast(ChatCompletionRequest, parse_request(raw, "chat"))
    state.check_model(req.model)
    stop = openai_stop(req)
    check_stop(stop, state.limits)
    messages = [{"role": m.role, "content": m.text(i), **({"name": m.name} if m.name else {})}
                for i, m in enumerate(req.messages)]
    try:
        text, templated = render_chat(state.engine.tokenizer, messages)
    except ValueError as e:
        raise bad_request(str(e), "messages", "invalid_value") from None
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    job = make_job(state, 0, text, templated=templated, max_tokens=max_tokens,
                   max_tokens_param=max_param, prompt_param="messages",
                   label="messages", chat=True, sampling=openai_sampling(req), stop=stop)
    if req.logprobs:
        state.check_tokenizer("logprobs")
        job.logprobs = LogprobOptions(top_n=req.top_logprobs or 0)
    return req, choices([job], req.n or 1), max_param


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: StateDep) -> Response:
    """OpenAI's chat completions (module docstring)."""
    arrival = time.perf_counter()
    state.check_admitting()
    req, jobs, max_param = await state.offload(prepare_chat, state, await request.body())
    return await serve(state, request, req, jobs, arrival, chat=True,
                       params={"max_new_tokens": max_param, "input_ids": "messages",
                               "prompt": "messages"})


async def serve(state: ServerState, request: Request,
                req: CompletionRequest | ChatCompletionRequest, jobs: list[Job], arrival: float,
                *, chat: bool, params: dict[str, str]) -> Response:
    """Run ``jobs`` and answer: a stream once every job started, else JSON when all finished
    (500 with the cause when a choice failed; 499, unread, when the client went away).
    ``params`` maps the engine's field names to the request's in error messages."""
    run = state.new_run(jobs, arrival, request_id(request.scope), whole=not req.stream,
                        # what /abort_request finds the request by (SGLang's rid)
                        job_rids=None if req.rid is None else [req.rid] * len(jobs))
    run.start()
    watcher = asyncio.create_task(watch_disconnect(request, run))
    streaming = False
    try:
        try:
            await run.wait_started()
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                streaming = True
                return RunStreamingResponse(sse_events(state, run, chat, include_usage), run)
            async for _ in run.events():
                pass
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - engine errors become API errors
            raise engine_error(e, params) from None
        failure = run.failure()
        if failure is not None:  # never 200 with the empty text of a failed choice
            status, body = error_body(failure)
            return JSONResponse(body, status_code=status)
        if any(j.logprobs is not None for j in run.jobs):  # maybe tens of MB (big_json)
            return await json_response(lambda: full_response(state, run, chat))
        return JSONResponse(full_response(state, run, chat))
    finally:
        watcher.cancel()
        if not streaming:
            run.close()
