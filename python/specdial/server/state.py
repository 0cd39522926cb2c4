"""What the server's routes share, and how a route gets it.

:class:`ServerState` holds the engine, the served model name, the metrics, the limits, the
draining flag, the open runs and the one thread that parses and tokenizes. :func:`create_app`
(:mod:`specdial.server.app`) puts one on ``app.state.specdial``; a route asks for it with the
FastAPI dependency :data:`StateDep` (``state: StateDep``), FastAPI's way of sharing application
state with module-level handlers (``Depends``), instead of closing over it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Callable, TypeVar

from fastapi import Depends, Request

from specdial.server.limits import ServerLimits, prompt_char_limit, tokenize_char_limit
from specdial.server.logprob_format import TokenDecoder
from specdial.server.metrics import ServerMetrics
from specdial.server.protocol import APIError, bad_request
from specdial.server.runs import Job, Run
from specdial.engine.token_align import TokenBytes

__all__ = ["ServerState", "StateDep", "admission_capacity", "get_state", "vocab_size_of"]

logger = logging.getLogger("specdial.server")

_T = TypeVar("_T")


def vocab_size_of(engine: Any) -> int | None:
    """The token ids ``engine`` takes, ``[0, vocab_size)``: its ``vocab_size`` attribute, else
    its target model's ``config.vocab_size`` (:class:`~specdial.engine.core.Engine`, which
    checks a prompt's ids against the same bound); None when it has neither."""
    size = getattr(engine, "vocab_size", None)
    if size is None:
        size = getattr(getattr(getattr(engine, "target", None), "config", None),
                       "vocab_size", None)
    return None if size is None else int(size)


def admission_capacity(engine: Any) -> int | None:
    """The most engine requests ``engine`` can hold at once: ``max_running_requests +
    max_queued_requests`` of its ``config`` (:class:`~specdial.config.engine.EngineConfig`),
    per data-parallel replica (each has its own scheduler and queue); None when the engine
    has no such config (nothing is checked). One HTTP request asking for more (``n`` choices
    times its prompts) can never be admitted: the scheduler would refuse it as a full queue
    (503, "retry later") even on an idle server."""
    cfg = getattr(engine, "config", None)
    try:
        per_replica = int(cfg.max_running_requests) + int(cfg.max_queued_requests)
        return per_replica * max(1, int(getattr(cfg, "dp_size", 1) or 1))
    except (AttributeError, TypeError, ValueError):
        return None


class ServerState:
    """What the routes share: the engine, the served name, the metrics, the draining flag, the
    limits, the open runs and the thread that parses and tokenizes.

    ``shutdown_engine_on_exit``: call ``engine.shutdown(drain=False)`` at the app's lifespan
    shutdown (after uvicorn let running requests finish or cancelled them). ``limits``: the
    :class:`~specdial.server.limits.ServerLimits`; ``prompt_chars`` its prompt character
    bound for this engine's tokenizer and context (None: none), ``tokenize_chars`` the
    ``/tokenize`` one (:func:`~specdial.server.limits.tokenize_char_limit`); ``vocab_size``
    the engine's (:func:`vocab_size_of`).
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
        self.tokenize_chars = tokenize_char_limit(self.limits, self.prompt_chars)
        self.vocab_size = vocab_size_of(engine)
        self.runs: set[Run] = set()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="specdial-tokenize")

    async def offload(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in the parsing/tokenizing thread (blocking work off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def new_run(self, jobs: list[Job], arrival: float, rid: str | None,
                whole: bool = False, *, n_param: str = "n",
                prompt_param: str = "prompt", job_rids: list[str] | None = None) -> Run:
        """A :class:`~specdial.server.runs.Run` of ``jobs`` on this engine (not started: start
        it before the next ``await``, so that no other request can take its ``job_rids``);
        ``arrival``: ``time.perf_counter()`` seconds at the request's arrival; ``whole``: a
        non-streaming response (the chunks may come at each job's end); ``job_rids``: each
        job's id as the client named it (SGLang's ``rid``), what ``/abort_request`` ends it by.
        Raises :class:`APIError` 400 naming ``n_param`` (or ``prompt_param`` for several
        prompts of one choice each) when the jobs outnumber what the engine can ever hold
        (:func:`admission_capacity`), and naming ``rid`` (code ``duplicate_rid``) when one of
        ``job_rids`` belongs to a request still running (vLLM refuses a running request id too:
        one ``/abort_request`` would otherwise end both)."""
        if job_rids is not None:
            running = {r for run in self.runs for r in (run.job_rids or ())}
            taken = sorted(running.intersection(job_rids))
            if taken:
                raise bad_request(f"rid {taken[0]!r} belongs to a request that is still running; "
                                  "a rid names one request at a time", "rid", "duplicate_rid")
        capacity = admission_capacity(self.engine)
        if capacity is not None and len(jobs) > capacity:
            prompts = sum(1 for j in jobs if j.counts_prompt)
            param = prompt_param if prompts == len(jobs) else n_param
            raise bad_request(
                f"this request asks for {len(jobs)} sequences ({prompts} prompt(s) x "
                f"{len(jobs) // max(prompts, 1)} choice(s), '{n_param}'); this server holds at most "
                f"{capacity} at once (--max-running-requests + --max-queued-requests, per "
                f"--dp-size replica): ask for fewer in one request", param, "too_many_sequences")
        run = Run(self.engine, self.metrics, self.runs, jobs, arrival, rid, whole)
        run.job_rids = job_rids
        return run

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

    # ------------------------------------------------------------------ checks of the routes
    def check_admitting(self) -> None:
        """Raises :class:`APIError` 503 while shutting down (code ``shutting_down``) or once
        the engine reports a fatal failure in its optional ``failure`` attribute (code
        ``engine_failed``, e.g. a tensor-parallel rank died)."""
        if self.draining:
            raise APIError(503, "The server is shutting down", type="service_unavailable",
                           code="shutting_down")
        failure = getattr(self.engine, "failure", None)
        if failure:
            raise APIError(503, f"The engine has failed: {failure}",
                           type="service_unavailable", code="engine_failed")

    def check_model(self, model: str | None) -> None:
        """Raises :class:`APIError` 404 (``model_not_found``, param ``model``) for a model name
        other than the served one; None (not given) passes."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                           f"'{self.model_name}'", param="model", code="model_not_found")

    def check_tokenizer(self, field: str) -> None:
        """Raises :class:`APIError` 400 (``unsupported_parameter``) naming ``field``, a request
        field that needs token texts, when the engine has no tokenizer."""
        if self.engine.tokenizer is None:
            raise bad_request(f"'{field}' needs the model's tokenizer (token texts); this "
                              "server has none", field, "unsupported_parameter")

    def require_tokenizer(self) -> Any:
        """The engine's tokenizer; raises :class:`APIError` 400 (code ``no_tokenizer``) for an
        endpoint that is nothing but the tokenizer (``/tokenize``, ...) when there is none."""
        if self.engine.tokenizer is None:
            raise APIError(400, "this server has no tokenizer", code="no_tokenizer")
        return self.engine.tokenizer


async def get_state(request: Request) -> ServerState:
    """The FastAPI dependency behind :data:`StateDep`: the app's ``app.state.specdial``.
    ``async`` so that FastAPI calls it on the event loop (a plain ``def`` dependency would cost
    every request a hop through Starlette's thread pool)."""
    state: ServerState = request.app.state.specdial
    return state


#: A route parameter annotated with this gets the app's :class:`ServerState`.
StateDep = Annotated[ServerState, Depends(get_state)]
