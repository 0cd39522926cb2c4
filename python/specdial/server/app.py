"""The OpenAI-compatible HTTP app (FastAPI) over an engine implementing
:mod:`specdial.engine.api`.

Endpoints:

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
- SGLang's native endpoints (``/generate``, ``/server_info``, ``/tokenize``, ...):
  :mod:`specdial.server.sglang_api`.
- both: non-streaming JSON, or server-sent events (``stream: true``) in OpenAI's chunk format
  ending with ``data: [DONE]``; ``stream_options.include_usage`` adds a last chunk with empty
  ``choices`` and the ``usage`` (other chunks then carry ``"usage": null``). ``usage`` holds
  ``prompt_tokens``, ``completion_tokens`` and ``total_tokens``, summed over the choices.
- ``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health`` (200, or 503 while shutting
  down or once the engine reports a fatal failure in its optional ``failure`` attribute, e.g.
  a tensor-parallel rank died; generation requests then get the same 503), ``GET /metrics``
  (Prometheus, :mod:`specdial.server.metrics`).

Supported request fields and the validation rules are in :mod:`specdial.server.protocol`.
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
without adding special tokens again.

Before a route runs, :mod:`specdial.server.security` checks the Host, CORS, the API key and the
content type, and :mod:`specdial.server.limits` reads the body (size, read time, JSON depth).
Parsing, limit checks, chat templates and tokenization then run in a one-thread pool
(``ServerState.offload``, as vLLM tokenizes in its own thread), never on the event loop, so one
large request does not stall the others; detokenization happens in the engine's loop thread.

Status codes: 400 invalid request (JSON error naming ``param``), 401 missing or wrong API key,
404 unknown model or route, 408 body not received in time, 413 body too large, 415 not JSON,
503 full queue (with ``Retry-After``) or shutting down, 500 engine failure or any other
unexpected error (also a JSON error, code ``internal_error``). Finish reasons:
``stop``, ``length``, or ``abort`` (the client's request was aborted, or the server's shutdown
ended it: :meth:`ServerState.abort_runs`). A request the engine *failed* (a pass raised, a
tensor-parallel rank died, the engine loop stopped: finish reason ``error``,
:mod:`specdial.engine.ends`) is never a 200: it is answered 500 with an OpenAI error body naming
the cause (code ``engine_error``), or, once streaming, with an error event
(``data: {"error": {...}}``) and then ``data: [DONE]``. A client that disconnects aborts its engine requests
(streaming: through the cancelled response body; non-streaming: a task waits for
``http.disconnect`` while the request runs), logged once at INFO with the request id.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, TypeVar, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from specdial.engine.api import LogprobOptions, QueueFullError, RequestError, StreamChunk
from specdial.engine.ends import error_body, is_failure, shut_down
from specdial.engine.sampling_defaults import SERVER_TEMPERATURE
from specdial.server.chat import render_chat
from specdial.server.config import BUILTIN_MODEL_NAME
from specdial.server.limits import (BodyLimitMiddleware, ServerLimits, check_prompt_chars,
                                    check_prompt_count, check_stop, prompt_char_limit,
                                    request_id)
from specdial.server.logprob_format import TokenDecoder, chat_logprobs, completion_logprobs
from specdial.server.token_align import TokenAligner, TokenBytes
from specdial.server.metrics import CONTENT_TYPE, ServerMetrics
from specdial.server.protocol import (SAMPLING_EXTRAS, APIError, ChatCompletionRequest,
                                      CompletionRequest, bad_request, choice_seed, parse_request)
from specdial.server.security import SecurityConfig, SecurityMiddleware

__all__ = ["ServerState", "create_app"]

logger = logging.getLogger("specdial.server")

#: ``max_tokens`` default of ``/v1/completions`` (OpenAI's).
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: ``temperature`` default (SGLang's and OpenAI's; see :mod:`specdial.engine.sampling_defaults`).
DEFAULT_TEMPERATURE = SERVER_TEMPERATURE

_DONE = "data: [DONE]\n\n"
_END = object()  # a pump finished its stream
_CLOSED = object()  # the run was closed (client gone)
_BACKGROUND: set[asyncio.Task[Any]] = set()  # strong references to pump tasks
_T = TypeVar("_T")

# engine-level names (RequestError.param or words of its message) -> OpenAI field
_ENGINE_PARAMS = ("max_new_tokens", "input_ids", "prompt", "temperature", "top_p", "top_k",
                  "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                  "min_tokens", "seed", "stop_token_ids", "stop", "logit_bias")


class ServerState:
    """What the routes share: the engine, the served name, the metrics, the draining flag, the
    limits, the open runs and the thread that parses and tokenizes.

    ``shutdown_engine_on_exit``: call ``engine.shutdown(drain=False)`` at the app's lifespan
    shutdown (after uvicorn let running requests finish or cancelled them). ``limits``: the
    :class:`~specdial.server.limits.ServerLimits`; ``prompt_chars`` its prompt character
    bound for this engine's tokenizer and context (None: none).
    """

    def __init__(self, engine: Any, model_name: str, shutdown_engine_on_exit: bool,
                 limits: ServerLimits | None = None) -> None:
        self.engine, self.model_name = engine, model_name
        self.metrics = ServerMetrics(engine, model_name)
        self.created = int(time.time())
        self.decode = TokenDecoder(engine.tokenizer)
        self.token_bytes = TokenBytes(engine.tokenizer)
        self.server_args: dict[str, Any] = {}
        self.draining = False
        self.shutdown_engine_on_exit = shutdown_engine_on_exit
        self._engine_shut_down = False
        self.limits = limits or ServerLimits()
        self.prompt_chars = prompt_char_limit(self.limits, engine.tokenizer,
                                              int(engine.context_length))
        self.runs: set[_Run] = set()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="specdial-tokenize")

    async def offload(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in the parsing/tokenizing thread (blocking work off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def abort_runs(self, message: str) -> None:
        """End every open HTTP request now: its engine requests are aborted and each choice
        still running finishes with ``finish_reason`` ``abort`` (a final SSE event and
        ``[DONE]`` for streams). Used at shutdown, past the graceful timeout."""
        if self.runs:
            logger.info("aborting %d open requests: %s", len(self.runs), message)
        for run in list(self.runs):
            run.abort(message)

    def begin_drain(self) -> None:
        """Stop admitting: from now on generation requests and ``/health`` answer 503."""
        if not self.draining:
            logger.info("shutting down: new requests are refused (503)")
        self.draining = True

    def shutdown_engine(self) -> None:
        """``engine.shutdown(drain=False)`` once (idempotent); a no-op unless the app owns the
        engine. Also stops the parsing thread."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.shutdown_engine_on_exit and not self._engine_shut_down:
            self._engine_shut_down = True
            self.engine.shutdown(drain=False)
            logger.info("engine shut down")


# ---------------------------------------------------------------------------- engine runs
@dataclass
class _Job:
    """One engine request of an HTTP request."""

    index: int
    prompt: str | None
    input_ids: list[int] | None
    sampling_params: dict[str, Any]
    stop: list[str] | None
    logprobs: LogprobOptions | None = None
    counts_prompt: bool = True  # the first choice of its prompt (usage counts prompts once)
    echo: str | None = None  # prompt text prepended to the choice's text


@dataclass
class _Choice:
    index: int
    parts: list[str] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    first_token_s: float | None = None
    last_token_s: float | None = None
    completion_tokens: int = 0
    done: bool = False
    token_ids: list[int] = field(default_factory=list)  # every emitted token
    # with logprobs: each token's logprob and top alternatives; the prompt's
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[Any] | None = None

    @property
    def reason(self) -> str | None:
        return None if self.finish_reason is None else str(self.finish_reason.get("type"))


class _ClientGone(Exception):
    pass


class _Run:
    """The engine requests of one HTTP request: one pump task per job, merged into a queue.

    Cancelling a pump task (``close``) cancels its ``await stream.__anext__()``, which aborts the
    engine request (the :mod:`specdial.engine.api` contract); the pump then also calls
    ``aclose()``.
    """

    def __init__(self, state: ServerState, jobs: list[_Job], arrival: float,
                 rid: str | None = None) -> None:
        self.state, self.jobs, self.arrival = state, jobs, arrival
        self.rid = rid or uuid.uuid4().hex  # the request id of the log lines
        self.choices = [_Choice(j.index) for j in jobs]
        self.queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False
        self.complete = False  # every choice delivered its last chunk to the consumer
        self._ended = 0
        self._buffer: list[tuple[int, Any]] = []  # read by wait_started, replayed by events

    def start(self) -> None:
        self.state.runs.add(self)
        for job in self.jobs:
            task = asyncio.create_task(self._pump(job))
            _BACKGROUND.add(task)
            task.add_done_callback(_BACKGROUND.discard)
            self.tasks.append(task)

    async def _pump(self, job: _Job) -> None:
        stream: Any = None
        try:
            extra = {} if job.logprobs is None else {"logprobs": job.logprobs}
            stream = self.state.engine.async_stream(
                prompt=job.prompt, input_ids=job.input_ids,
                sampling_params=job.sampling_params, stop=job.stop, **extra)
            async for chunk in stream:
                self.queue.put_nowait((job.index, chunk, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            self.queue.put_nowait((job.index, None, e))
            return
        finally:
            aclose = getattr(stream, "aclose", None)  # None when async_stream() raised
            if aclose is not None:
                await aclose()
        self.queue.put_nowait((job.index, _END, None))

    def close(self) -> None:
        """Cancel every pump still running (aborting its engine request); idempotent and
        synchronous, so it is safe in ``finally`` blocks of cancelled tasks."""
        if self.closed:
            return
        self.closed = True
        self.state.runs.discard(self)
        for task in self.tasks:
            task.cancel()
        self.queue.put_nowait((-1, _CLOSED, None))

    def abort(self, message: str) -> None:
        """Cancel the pumps still running (aborting their engine requests) and finish their
        choices with ``finish_reason`` ``abort``; the consumer then ends normally."""
        if self.closed:
            return
        self.closed = True
        self.state.runs.discard(self)
        for job, task in zip(self.jobs, self.tasks):
            if not task.done():
                task.cancel()
                final = StreamChunk(-1, "", [], True, shut_down(message))
                self.queue.put_nowait((job.index, final, None))
                self.queue.put_nowait((job.index, _END, None))

    async def _next(self, buffered: bool = True) -> tuple[int, Any]:
        if buffered and self._buffer:
            return self._buffer.pop(0)
        i, item, err = await self.queue.get()
        if item is _CLOSED:
            raise _ClientGone
        if err is not None:
            self.close()
            raise err
        return i, item

    async def wait_started(self) -> None:
        """Wait until every engine request delivered its first chunk (or finished). Raises the
        first submission error (:class:`QueueFullError`, :class:`RequestError`, ...) after
        closing the run, or ``_ClientGone``."""
        started: set[int] = set()
        while len(started) < len(self.jobs):
            i, item = await self._next(buffered=False)
            started.add(i)
            self._buffer.append((i, item))

    async def events(self) -> AsyncIterator[tuple[_Choice, StreamChunk]]:
        """Every chunk, in arrival order, after updating its choice and the metrics."""
        while self._ended < len(self.jobs):
            i, item = await self._next()
            if item is _END:
                self._ended += 1
                continue
            yield self._account(self.choices[i], item), item
        self.complete = True

    def _account(self, c: _Choice, chunk: StreamChunk) -> _Choice:
        now = time.perf_counter() - self.arrival
        if chunk.text:
            c.parts.append(chunk.text)
        if chunk.token_ids:
            c.completion_tokens += len(chunk.token_ids)
            if c.first_token_s is None:
                c.first_token_s = now
                self.state.metrics.observe_first_token(now)
            else:
                assert c.last_token_s is not None
                self.state.metrics.observe_inter_token(now - c.last_token_s)
            c.last_token_s = now
        c.token_ids += chunk.token_ids
        if chunk.logprobs is not None:
            c.logprobs += chunk.logprobs
            c.top_logprobs += chunk.top_logprobs or [[] for _ in chunk.token_ids]
        if chunk.prompt_logprobs is not None:
            c.prompt_logprobs = chunk.prompt_logprobs
            c.prompt_top_logprobs = chunk.prompt_top_logprobs
        if chunk.meta_info and "queue_time_s" in chunk.meta_info and "queue_time_s" not in c.meta:
            self.state.metrics.observe_queue_time(float(chunk.meta_info["queue_time_s"]))
        if chunk.meta_info:
            c.meta = chunk.meta_info
            c.completion_tokens = int(chunk.meta_info.get("completion_tokens",
                                                          c.completion_tokens))
        if chunk.finished and not c.done:
            c.done, c.finish_reason = True, chunk.finish_reason
            self.state.metrics.observe_finished(
                reason=c.reason or "unknown", e2e_s=now, first_token_s=c.first_token_s,
                completion_tokens=c.completion_tokens)
        return c

    def failure(self) -> dict[str, Any] | None:
        """The finish reason of the first failed choice (:mod:`specdial.engine.ends`), or
        None."""
        return next((c.finish_reason for c in self.choices if is_failure(c.finish_reason)),
                    None)

    def usage(self) -> dict[str, int]:
        prompt = sum(int(c.meta.get("prompt_tokens", 0))
                     for c, j in zip(self.choices, self.jobs) if j.counts_prompt)
        completion = sum(c.completion_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}


async def _watch_disconnect(request: Request, run: _Run) -> None:
    """Close ``run`` when the client disconnects (for the time a response is not streaming)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            logger.info("request %s: the client disconnected; aborting it", run.rid)
            run.close()
            return


def _engine_error(e: BaseException, params: dict[str, str]) -> APIError:
    """Map an engine exception to an API error; ``params`` maps engine names to OpenAI's."""
    if isinstance(e, QueueFullError):
        # the core's message may already end with "retry later": say it once
        detail = re.sub(r"[\s;,.]*retry later[.!]?\s*$", "", str(e), flags=re.IGNORECASE)
        return APIError(503, f"The server is overloaded ({detail}); retry later",
                        type="server_overloaded", code="queue_full")
    if isinstance(e, RequestError):
        param = getattr(e, "param", None)
        if param is None:  # find the earliest engine field named in the message
            msg = str(e)
            hits = [(msg.find(p), p) for p in _ENGINE_PARAMS if p in msg]
            param = min(hits)[1] if hits else None
        return bad_request(str(e), params.get(param, param) if param else None, "invalid_value")
    logger.error("engine failure", exc_info=e)
    return APIError(500, f"internal engine error: {type(e).__name__}: {e}",
                    type="internal_error", code="internal_error")


class _InternalErrorMiddleware:
    """Answer an unexpected exception of a route with a JSON 500 (``{"error": {...}}``, code
    ``internal_error``) instead of Starlette's plain-text one, and without re-raising it, so
    that uvicorn keeps the connection open. An exception after the response started (a
    streaming body) cannot be answered any more and propagates."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:  # noqa: BLE001 - answered as JSON
            if started:
                raise
            logger.error("internal error in %s %s", scope.get("method"), scope.get("path"),
                         exc_info=e)
            err = APIError(500, f"internal server error: {type(e).__name__}: {e}",
                           type="internal_error", code="internal_error")
            await JSONResponse(err.body(), status_code=500)(scope, receive, send)


class _RunStreamingResponse(StreamingResponse):
    """A streaming response that closes its run whatever happens (client gone before the body
    started, cancellation at a ``yield``, normal end)."""

    def __init__(self, content: AsyncIterator[str], run: _Run) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not (self._run.closed or self._run.complete):
                logger.info("request %s: the client disconnected during the stream; aborting "
                            "it", self._run.rid)
            self._run.close()


# ---------------------------------------------------------------------------- request -> jobs
def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    try:
        enc = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except TypeError:
        enc = tokenizer.encode(text)
    return [int(t) for t in getattr(enc, "ids", enc)]


def _make_job(state: ServerState, index: int, prompt: str | list[int], *, templated: bool,
              max_tokens: int | None, max_tokens_param: str, prompt_param: str, label: str,
              chat: bool, sampling: dict[str, Any], stop: list[str] | None) -> _Job:
    """One engine request for ``prompt`` (text, or token ids); ``label`` names it in error
    messages. Raises :class:`APIError` 400 for an empty prompt or one that does not fit the
    context."""
    engine = state.engine
    ctx = int(engine.context_length)
    tokenizer = engine.tokenizer
    if isinstance(prompt, list):
        ids = prompt
    elif tokenizer is None:  # the engine reports what it cannot do (RequestError)
        n = DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
        return _Job(index, prompt, None, {**sampling, "max_new_tokens": n}, stop)
    else:
        check_prompt_chars(prompt, state.prompt_chars, label=label, param=prompt_param,
                           context_length=ctx)
        ids = _encode(tokenizer, prompt, add_special_tokens=not templated)
    if not ids:
        raise bad_request(f"'{label}' is empty (0 tokens)", prompt_param, "invalid_value")
    if len(ids) >= ctx:
        raise bad_request(
            f"This model's maximum context length is {ctx} tokens; the prompt ({label}) has "
            f"{len(ids)} tokens, leaving no room for a completion", prompt_param,
            "context_length_exceeded")
    if max_tokens is not None and len(ids) + max_tokens > ctx:
        raise bad_request(
            f"This model's maximum context length is {ctx} tokens; you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
            f"completion). Reduce '{max_tokens_param}' or the prompt", max_tokens_param,
            "context_length_exceeded")
    if max_tokens is None:
        max_tokens = ctx - len(ids) if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, ctx - len(ids))
    return _Job(index, None, ids, {**sampling, "max_new_tokens": max_tokens}, stop)


def _choices(jobs: list[_Job], n: int) -> list[_Job]:
    """``n`` choices per job (choice ``i`` of prompt ``p``: index ``p * n + i``), seeded
    choices with :func:`choice_seed`."""
    if n == 1:
        return jobs
    out = []
    for job in jobs:
        for i in range(n):
            params = dict(job.sampling_params)
            if "seed" in params:
                params["seed"] = choice_seed(int(params["seed"]), i)
            out.append(dataclasses.replace(job, index=job.index * n + i, sampling_params=params,
                                           counts_prompt=i == 0))
    return out


def _sampling(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    params: dict[str, Any] = {
        "temperature": DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p}
    if req.seed is not None:
        params["seed"] = req.seed
    if req.ignore_eos:
        params["ignore_eos"] = True
    for name in SAMPLING_EXTRAS:  # same names as the engine's; null: the engine's default
        value = getattr(req, name)
        if value is not None:
            params[name] = value
    return params


def _stop(req: CompletionRequest | ChatCompletionRequest) -> list[str] | None:
    if req.stop is None:
        return None
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


# ---------------------------------------------------------------------------- the app
def create_app(engine: Any, *, served_model_name: str = BUILTIN_MODEL_NAME,
               shutdown_engine_on_exit: bool = True,
               server_args: dict[str, Any] | None = None, limits: ServerLimits | None = None,
               security: SecurityConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (an :class:`specdial.engine.api.EngineProtocol`)
    under the model name ``served_model_name``. ``app.state.specdial`` is the
    :class:`ServerState` (``begin_drain()`` makes new requests 503). At lifespan shutdown the
    engine is shut down (``drain=False``) unless ``shutdown_engine_on_exit`` is False.
    ``server_args``: the options the server was started with, reported by ``/server_info``.
    ``limits`` (default: :class:`ServerLimits`' defaults) and ``security`` (default: no key,
    any Host, no CORS; JSON bodies required) configure the checks made before the routes."""
    state = ServerState(engine, served_model_name, shutdown_engine_on_exit, limits)
    state.server_args = dict(server_args or {})

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.begin_drain()
        await asyncio.to_thread(state.shutdown_engine)

    app = FastAPI(title="specdial", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.specdial = state
    # outermost last: JSON 500s around everything, then Host/CORS/key/type, then the body
    app.add_middleware(BodyLimitMiddleware, limits=state.limits)
    app.add_middleware(SecurityMiddleware, config=security or SecurityConfig())
    app.add_middleware(_InternalErrorMiddleware)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.code == "queue_full" else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail), code=str(exc.status_code))
        return JSONResponse(err.body(), status_code=exc.status_code)

    def check_admitting() -> None:
        if state.draining:
            raise APIError(503, "The server is shutting down", type="service_unavailable",
                           code="shutting_down")
        failure = getattr(engine, "failure", None)  # optional: a fatal engine failure
        if failure:
            raise APIError(503, f"The engine has failed: {failure}",
                           type="service_unavailable", code="engine_failed")

    def check_tokenizer(field: str) -> None:
        if engine.tokenizer is None:
            raise bad_request(f"'{field}' needs the model's tokenizer (token texts); this "
                              "server has none", field, "unsupported_parameter")

    def check_model(model: str | None) -> None:
        if model is not None and model != state.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                           f"'{state.model_name}'", param="model", code="model_not_found")

    @app.get("/health")
    async def health() -> JSONResponse:
        check_admitting()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    def model_card() -> dict[str, Any]:
        # "root": vLLM's model card field, which `vllm bench serve` reads without --model
        return {"id": state.model_name, "object": "model", "created": state.created,
                "owned_by": "specdial", "root": state.model_name,
                "max_model_len": int(engine.context_length)}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        check_model(model_id)
        return JSONResponse(model_card())

    def prepare_completion(raw: bytes) -> tuple[CompletionRequest, list[_Job]]:
        """Parse, check and tokenize a completion request (in the parsing thread)."""
        req = cast(CompletionRequest, parse_request(raw, "completion"))
        check_model(req.model)
        prompts = req.prompts()
        check_prompt_count(prompts, state.limits)
        sampling, stop = _sampling(req), _stop(req)
        check_stop(stop, state.limits)
        logprobs = None
        if req.logprobs is not None or req.echo:
            check_tokenizer("logprobs" if req.logprobs is not None else "echo")
        if req.logprobs is not None:
            logprobs = LogprobOptions(top_n=req.logprobs, prompt_start=0 if req.echo else None)
        jobs = []
        for i, p in enumerate(prompts):
            job = _make_job(state, i, p, templated=False, max_tokens=req.max_tokens,
                            max_tokens_param="max_tokens", prompt_param="prompt",
                            label="prompt" if len(prompts) == 1 else f"prompt[{i}]",
                            chat=False, sampling=sampling, stop=stop)
            echo = (p if isinstance(p, str) else str(engine.tokenizer.decode(p))) if req.echo \
                else None
            jobs.append(dataclasses.replace(job, logprobs=logprobs, echo=echo))
        return req, _choices(jobs, req.n or 1)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        check_admitting()
        req, jobs = await state.offload(prepare_completion, await request.body())
        return await _serve(request, req, jobs, arrival, chat=False,
                            params={"max_new_tokens": "max_tokens", "input_ids": "prompt",
                                    "prompt": "prompt"})

    def prepare_chat(raw: bytes) -> tuple[ChatCompletionRequest, list[_Job], str]:
        """Parse, check, render and tokenize a chat request (in the parsing thread); also
        returns the name of the max-tokens field used."""
        req = cast(ChatCompletionRequest, parse_request(raw, "chat"))
        check_model(req.model)
        stop = _stop(req)
        check_stop(stop, state.limits)
        messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(req.messages)]
        try:
            text, templated = render_chat(engine.tokenizer, messages)
        except ValueError as e:
            raise bad_request(str(e), "messages", "invalid_value") from None
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        job = _make_job(state, 0, text, templated=templated, max_tokens=max_tokens,
                        max_tokens_param=max_param, prompt_param="messages",
                        label="messages", chat=True, sampling=_sampling(req), stop=stop)
        if req.logprobs:
            check_tokenizer("logprobs")
            job.logprobs = LogprobOptions(top_n=req.top_logprobs or 0)
        return req, _choices([job], req.n or 1), max_param

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        check_admitting()
        req, jobs, max_param = await state.offload(prepare_chat, await request.body())
        return await _serve(request, req, jobs, arrival, chat=True,
                            params={"max_new_tokens": max_param, "input_ids": "messages",
                                    "prompt": "messages"})

    async def _serve(request: Request, req: CompletionRequest | ChatCompletionRequest,
                     jobs: list[_Job], arrival: float, *, chat: bool,
                     params: dict[str, str]) -> Response:
        run = _Run(state, jobs, arrival, request_id(request.scope))
        run.start()
        watcher = asyncio.create_task(_watch_disconnect(request, run))
        streaming = False
        try:
            try:
                await run.wait_started()
                if req.stream:
                    include_usage = bool(req.stream_options and req.stream_options.include_usage)
                    streaming = True
                    return _RunStreamingResponse(_sse(run, chat, include_usage), run)
                async for _ in run.events():
                    pass
            except _ClientGone:
                return Response(status_code=499)  # nobody reads it
            except APIError:
                raise
            except Exception as e:  # noqa: BLE001 - engine errors become API errors
                raise _engine_error(e, params) from None
            failure = run.failure()
            if failure is not None:  # never 200 with the empty text of a failed choice
                status, body = error_body(failure)
                return JSONResponse(body, status_code=status)
            return JSONResponse(_full_response(run, chat))
        finally:
            watcher.cancel()
            if not streaming:
                run.close()

    def _logprobs(c: _Choice, job: _Job, chat: bool, track: _LogprobTrack, text_chars: int,
                  final: bool) -> dict[str, Any] | None:
        """The ``logprobs`` of ``c``'s tokens not reported yet (the echoed prompt's first) whose
        text is within the first ``text_chars`` characters sent (the echo included); ``final``:
        the text is complete (:mod:`specdial.server.token_align`). None without logprobs, or
        when no entry is due (before the end)."""
        if job.logprobs is None:
            return None
        al = track.aligner
        if not track.prompt_done and c.token_ids:
            track.prompt_done = True
            if not chat and job.echo is not None and c.prompt_logprobs is not None:
                assert job.input_ids is not None and c.prompt_top_logprobs is not None
                al.push(job.input_ids, c.prompt_logprobs, c.prompt_top_logprobs)
        sent = track.tokens
        al.push(c.token_ids[sent:], c.logprobs[sent:], c.top_logprobs[sent:])  # type: ignore[arg-type]
        track.tokens = len(c.token_ids)
        entries = al.take(text_chars, final)
        if not entries and not (final and track.offset == 0 and not track.reported):
            return None
        track.reported = True
        if chat:
            return chat_logprobs(entries, state.decode,
                                 lambda t: state.token_bytes(t, skip_special=False))
        lp, track.offset = completion_logprobs(entries, state.decode, track.offset)
        return lp

    def _track(job: _Job) -> _LogprobTrack:
        skip = job.sampling_params.get("skip_special_tokens") is not False
        return _LogprobTrack(TokenAligner(state.token_bytes, skip))

    def _full_response(run: _Run, chat: bool) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for c, job in zip(run.choices, run.jobs):
            text = "".join(c.parts)
            logprobs = _logprobs(c, job, chat, _track(job), len((job.echo or "") + text), True)
            if chat:
                choices.append({"index": c.index, "logprobs": logprobs,
                                "finish_reason": c.reason,
                                "message": {"role": "assistant", "content": text}})
            else:
                choices.append({"index": c.index, "text": (job.echo or "") + text,
                                "logprobs": logprobs, "finish_reason": c.reason})
        return {"id": _response_id(run, chat),
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": state.model_name, "choices": choices,
                "usage": run.usage()}

    async def _sse(run: _Run, chat: bool, include_usage: bool) -> AsyncIterator[str]:
        rid, created = _response_id(run, chat), int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict[str, Any]], **extra: Any) -> str:
            body = {"id": rid, "object": kind, "created": created, "model": state.model_name,
                    "choices": choices, **extra}
            if include_usage and "usage" not in body:
                body["usage"] = None
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        jobs = {c.index: j for c, j in zip(run.choices, run.jobs)}
        tracks = {c.index: _track(j) for c, j in zip(run.choices, run.jobs)}

        def logprobs(c: _Choice, text: str, final: bool) -> dict[str, Any] | None:
            track = tracks[c.index]
            track.text_chars += len(text)
            return _logprobs(c, jobs[c.index], chat, track, track.text_chars, final)

        def choice(c: _Choice, text: str | None, reason: str | None,
                   role: bool = False, lp: dict[str, Any] | None = None) -> dict[str, Any]:
            if not chat:
                return {"index": c.index, "text": text or "", "logprobs": lp,
                        "finish_reason": reason}
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {} if text is None else {"content": text})
            return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": reason}

        try:
            if chat:
                for c in run.choices:
                    yield event([choice(c, None, None, role=True)])
            started: set[int] = set()
            async for c, chunk in run.events():
                text = chunk.text
                echo = jobs[c.index].echo
                if echo is not None and c.index not in started and (text or chunk.token_ids
                                                                     or chunk.finished):
                    text = echo + text
                started.add(c.index)
                lp = logprobs(c, text, chunk.finished)
                if chunk.finished and is_failure(chunk.finish_reason):
                    if text or lp:
                        yield event([choice(c, text, None, lp=lp)])
                    yield f"data: {json.dumps(error_body(chunk.finish_reason)[1])}\n\n"
                    break  # the other choices are aborted when the response closes its run
                if chunk.finished:
                    if chat and (text or lp):
                        yield event([choice(c, text, None, lp=lp)])
                        yield event([choice(c, None, c.reason)])
                    else:
                        yield event([choice(c, text if not chat else None, c.reason, lp=lp)])
                elif text or lp:
                    yield event([choice(c, text, None, lp=lp)])
            if include_usage:
                yield event([], usage=run.usage())
        except _ClientGone:
            return
        except Exception as e:  # noqa: BLE001 - reported in-band once streaming started
            yield f"data: {json.dumps(_engine_error(e, {}).body())}\n\n"
        yield _DONE

    from specdial.server.sglang_api import add_sglang_routes

    add_sglang_routes(app, state, check_admitting)
    return app


@dataclass
class _LogprobTrack:
    """Per choice: what its logprobs reported so far (``tokens`` pushed to ``aligner``, text
    characters sent, the completions text offset)."""

    aligner: TokenAligner
    tokens: int = 0
    text_chars: int = 0
    offset: int = 0
    prompt_done: bool = False
    reported: bool = False


def _response_id(run: _Run, chat: bool) -> str:
    """OpenAI-style response id carrying the request id of the log lines."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{run.rid}"

