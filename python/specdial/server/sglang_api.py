"""SGLang's native endpoints (and vLLM's tokenizer endpoints): the ``APIRouter``
:data:`router`, mounted by :func:`~specdial.server.app.create_app`; the request bodies and
their conversion: :mod:`specdial.server.sglang_protocol`.

- ``POST /generate`` (SGLang's request and response shapes): ``text`` (a string or a list) or
  ``input_ids`` (token ids or a list of such lists), ``sampling_params`` (a dict, or one per
  prompt), ``stream``, ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``,
  ``return_text_in_logprobs``, ``rid``. Answers ``{"text", "output_ids", "meta_info"}`` per
  prompt (a list for a list input); ``meta_info`` holds ``id``, ``finish_reason``,
  ``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` (prompt tokens served by the
  prefix cache; 0 on a miss or with ``--disable-radix-cache``),
  ``spec_verify_ct``, ``spec_accept_length``, ``spec_steps_histogram``, ``e2e_latency``
  (seconds) and, with ``return_logprob``, SGLang's logprob lists
  (:mod:`specdial.engine.output`; the output entries follow the text, as the OpenAI routes'). Streaming: server-sent events of the same object with
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
  neutral value only (``spaces_between_special_tokens: true``) and are otherwise a 400 naming
  what to use instead; the structured-output keys ``json_schema``, ``regex`` and ``ebnf`` are
  served (:mod:`specdial.worker.grammar_spec`).
- ``GET /server_info`` (also ``/get_server_info``): the server's options, ``version`` and
  ``internal_states``: one entry (one engine) with ``speculative_num_steps`` (the current steps
  of the slot serving the current batch, or the latest batch when idle), ``avg_spec_accept_length``
  (``1 + accepted drafts / request-verifies with drafts``, since start; None before any),
  ``slots`` (every slot's state from the engine's ``slot_states``) and the counters, the
  prefix cache's among them (``cached_tokens``, ``prompt_tokens``, ``cache_hit_rate``,
  ``cached_pages``: as ``/metrics``). ``speculative_eagle_topk`` and
  ``speculative_num_draft_tokens`` (SGLang's counting, the root included: the configured tree's,
  or ``speculative_num_steps + 1`` of the current steps for chains) are reported at the top level
  and in the entry.
- ``GET /get_model_info``; ``POST /tokenize`` (also ``/v1/tokenize``; ``prompt`` or chat
  ``messages``) -> ``{"tokens", "count", "max_model_len"}``; ``POST /detokenize`` (also
  ``/v1/detokenize``) -> ``{"text", "prompt"}`` (SGLang's and vLLM's key for the same text;
  ids outside ``[0, vocab_size)`` are a 400, as ``/generate``'s ``input_ids``);
  ``GET /tokenizer_info`` (vLLM's; what lm-evaluation-harness's remote tokenizer reads);
  ``GET /version``.

A prompt ended by ``POST /abort_request`` (its ``rid``, or ``abort_all``) answers what it
generated until then (``text``, ``output_ids``, logprobs, ``meta_info`` counts of those tokens)
with ``meta_info.finish_reason`` ``{"type": "abort", "message", "cause": "client"}``, as SGLang
answers an aborted request; a stream's last event is that output.

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

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from specdial.engine.ends import error_body, is_failure
from specdial.engine.output import OutputAccumulator
from specdial.server.big_json import json_response
from specdial.server.chat import render_chat
from specdial.server.errors import engine_error
from specdial.server.jobs import check_token_ids, encode
from specdial.server.limits import check_detokenize_tokens, check_tokenize_chars, request_id
from specdial.server.protocol import APIError, bad_request
from specdial.server.runs import DONE, ClientGone, Run, RunStreamingResponse, watch_disconnect
from specdial.server.sglang_protocol import (DetokenizeRequest, TokenizeRequest, parse_body,
                                             prepare_generate)
from specdial.server.state import ServerState, StateDep

__all__ = ["check_token_ids", "do_detokenize", "do_tokenize", "router", "server_info"]

#: SGLang's native routes (and vLLM's tokenizer routes).
router = APIRouter()


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


def _draft_tree(state: ServerState, steps: int) -> dict[str, int]:
    """``speculative_eagle_topk`` and ``speculative_num_draft_tokens`` (SGLang's counting) of
    the engine's options: a tree's as configured, a chain's ``steps + 1``."""
    options = getattr(state.engine, "config", None)
    get = ((lambda k: getattr(options, k, None)) if options is not None
           else state.server_args.get)
    topk = get("speculative_eagle_topk") or 1
    count = get("speculative_num_draft_tokens") if topk > 1 else None
    return {"speculative_eagle_topk": int(topk),
            "speculative_num_draft_tokens": int(count) if count is not None else steps + 1}


def server_info(state: ServerState) -> dict[str, Any]:
    """The ``/server_info`` body (module docstring)."""
    from specdial import __version__

    s = state.engine.stats()
    engine = state.engine
    tree = _draft_tree(state, _slot_steps(s))
    internal = {
        "speculative_num_steps": _slot_steps(s), **tree,
        "avg_spec_accept_length": (1 + s.num_accepted_tokens / s.num_drafts
                                   if s.num_drafts else None),
        "slots": [dict(d) for d in s.slot_states],
        "last_decode_steps": s.last_decode_steps,
        "last_decode_batch_size": s.last_decode_batch_size,
        "num_running_reqs": s.running, "num_queued_reqs": s.queued,
        "kv_pages_used": s.kv_pages_used, "kv_pages_total": s.kv_pages_total,
        "spec_num_drafts": s.num_drafts, "spec_num_accepted_tokens": s.num_accepted_tokens,
        "step_switches": s.step_switches,
        "cached_tokens": s.cached_tokens, "prompt_tokens": s.prompt_tokens,
        "cache_hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
        "cached_pages": s.cached_pages,
    }
    interval = getattr(getattr(engine, "config", None), "stream_interval", None)
    known = {"stream_interval": interval} if isinstance(interval, int) else {}  # the engine's
    return {**state.server_args, **known, **tree, "served_model_name": state.model_name,
            "speculative_algorithm": getattr(engine, "speculative_algorithm", None),
            "context_length": int(engine.context_length), "version": __version__,
            "internal_states": [internal]}


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request, state: StateDep) -> Response:
    """SGLang's ``/generate`` (module docstring)."""
    arrival = time.perf_counter()
    state.check_admitting()
    req, single, jobs, rids = await state.offload(prepare_generate, state,
                                                  await request.body())
    decode = state.decode if req.return_text_in_logprobs else None
    token_bytes = None if state.engine.tokenizer is None else state.token_bytes
    outs = [OutputAccumulator(j.input_ids or [], return_logprob=req.return_logprob,
                              decode=decode, token_bytes=token_bytes,
                              skip_special=j.sampling_params.get("skip_special_tokens")
                              is not False) for j in jobs]
    ids_ = [r or uuid.uuid4().hex for r in rids]
    run = state.new_run(jobs, arrival, request_id(request.scope), whole=not req.stream,
                        n_param="sampling_params.n",
                        prompt_param="text" if req.text is not None else "input_ids",
                        job_rids=ids_)  # what /abort_request finds them by
    run.start()
    watcher = asyncio.create_task(watch_disconnect(request, run))
    streaming = False

    def body(i: int) -> dict[str, Any]:
        out = outs[i].result()
        out["meta_info"].update(id=ids_[i],
                                cached_tokens=int(outs[i].meta.get("cached_tokens", 0) or 0),
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
                return RunStreamingResponse(_events(run, outs, body), run)
            async for c, chunk in run.events():
                outs[c.index].add(chunk)
        except ClientGone:
            return Response(status_code=499)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - engine errors become API errors
            raise engine_error(e, {"max_new_tokens": "sampling_params.max_new_tokens",
                                    "min_tokens": "sampling_params.min_new_tokens",
                                    "prompt": "text"}) from None
        failure = run.failure()
        status = 200 if failure is None else error_body(failure)[0]

        def results() -> Any:
            out = [body(i) for i in range(len(jobs))]
            for r in out:
                r.pop("index", None)
            return out[0] if single else out
        if req.return_logprob:  # maybe tens of MB: off the event loop (big_json)
            return await json_response(results, status)
        return JSONResponse(results(), status_code=status)
    finally:
        watcher.cancel()
        if not streaming:
            run.close()


async def _events(run: Run, outs: list[OutputAccumulator],
                  body: Callable[[int], dict[str, Any]]) -> AsyncIterator[str]:
    """``/generate``'s events: ``body(i)`` of output ``i`` after its chunks, then
    ``[DONE]``; a failed output's event (its ``error``) ends the stream. Per wake-up
    (:meth:`Run.batches`): an output whose chunks arrived together gets one event (its body
    after all of them; SGLang's events are cumulative), and the events go in one write."""
    try:
        async for batch in run.batches():  # one write per wake-up, one event per output
            touched: dict[int, bool] = {}
            for c, chunk in batch:
                outs[c.index].add(chunk)
                failed = chunk.finished and is_failure(chunk.finish_reason)
                touched[c.index] = touched.get(c.index, False) or failed
            yield "".join(f"data: {json.dumps(body(i), ensure_ascii=False)}\n\n"
                          for i in sorted(touched, key=touched.__getitem__))  # failed last
            if any(touched.values()):
                break  # that event carried the error; the others are aborted on close
    except ClientGone:
        return
    except Exception as e:  # noqa: BLE001 - reported in-band once streaming started
        yield f"data: {json.dumps(engine_error(e, {}).body())}\n\n"
    yield DONE


@router.get("/server_info")
@router.get("/get_server_info")
async def get_server_info(state: StateDep) -> JSONResponse:
    """:func:`server_info` (the engine's stats read off the event loop)."""
    return JSONResponse(await asyncio.to_thread(server_info, state))


@router.get("/get_model_info")
async def get_model_info(state: StateDep) -> JSONResponse:
    """SGLang's model info: the model path the server was started with and the served
    name."""
    path = state.server_args.get("model_path")
    return JSONResponse({"model_path": path, "tokenizer_path": path,
                         "served_model_name": state.model_name, "is_generation": True})


@router.get("/version")
async def version() -> JSONResponse:
    """``{"version": specdial's version}``."""
    from specdial import __version__

    return JSONResponse({"version": __version__})


def do_tokenize(state: ServerState, raw: bytes) -> dict[str, Any]:
    """The ``/tokenize`` answer (in the parsing thread). Raises :class:`APIError` 400 naming
    the field (and ``no_tokenizer`` without a tokenizer)."""
    req: TokenizeRequest = parse_body(TokenizeRequest, raw)
    tok = state.require_tokenizer()
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
        check_tokenize_chars([text], state.tokenize_chars, param="messages")
        ids = encode(tok, text, add_special_tokens=not templated)
        return {"tokens": ids, "count": len(ids),
                "max_model_len": int(state.engine.context_length)}
    assert req.prompt is not None
    texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    check_tokenize_chars(texts, state.tokenize_chars, param="prompt")
    tokens = [encode(tok, t, add_special_tokens=req.add_special_tokens) for t in texts]
    single = isinstance(req.prompt, str)
    return {"tokens": tokens[0] if single else tokens,
            "count": len(tokens[0]) if single else [len(t) for t in tokens],
            "max_model_len": int(state.engine.context_length)}


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(request: Request, state: StateDep) -> JSONResponse:
    """SGLang's and vLLM's ``/tokenize`` (:func:`do_tokenize`)."""
    return JSONResponse(await state.offload(do_tokenize, state, await request.body()))


def do_detokenize(state: ServerState, raw: bytes) -> dict[str, Any]:
    """The ``/detokenize`` answer (in the parsing thread). Raises :class:`APIError` 400 as
    :func:`do_tokenize`, for an id outside the vocabulary (:func:`check_token_ids`) and for
    ids the tokenizer cannot decode."""
    req: DetokenizeRequest = parse_body(DetokenizeRequest, raw)
    tok = state.require_tokenizer()
    single = not req.tokens or isinstance(req.tokens[0], int)
    lists: list[list[int]] = [req.tokens] if single else req.tokens  # type: ignore[list-item]
    check_detokenize_tokens(sum(len(ids) for ids in lists), state.limits)
    check_token_ids(lists, state.vocab_size, "tokens")
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


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(request: Request, state: StateDep) -> JSONResponse:
    """SGLang's and vLLM's ``/detokenize`` (:func:`do_detokenize`)."""
    return JSONResponse(await state.offload(do_detokenize, state, await request.body()))


@router.get("/tokenizer_info")
async def tokenizer_info(state: StateDep) -> JSONResponse:
    """vLLM's tokenizer info (what lm-evaluation-harness's remote tokenizer reads)."""
    tok = state.require_tokenizer()
    info = {"tokenizer_class": type(tok).__name__,
            "model_max_length": int(state.engine.context_length)}
    for name in ("eos_token", "bos_token", "pad_token", "chat_template"):
        value = getattr(tok, name, None)
        info[name] = value if isinstance(value, str) or value is None else str(value)
    return JSONResponse(info)
