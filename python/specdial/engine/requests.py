"""Request validation and the three front ends' drivers of :class:`specdial.Engine`.

- :func:`make_spec`: one request validated into a :class:`RequestSpec` (raises
  :class:`~specdial.engine.api.RequestError` naming the field).
- :func:`collect`: ``generate``'s driver: submits a batch, waits (retrying requests refused by a
  full queue) and builds the SGLang-style output dicts; it (and :func:`async_collect`) takes
  each request's chunks at its end (:func:`held_until_end`), not each iteration.
- :func:`async_collect`: ``async_generate``'s driver (the same dicts, on an asyncio loop).
- :func:`sync_stream` / :func:`async_stream`: one request as an iterator of
  :class:`~specdial.engine.api.StreamChunk`; submission on the first ``next`` / ``__anext__``;
  leaving early cancels (aborts) the request.

``post(message)`` queues a message for the engine loop (raising ``RuntimeError`` once the
engine is shut down); ``cancel(spec)`` aborts a submitted request, if it still runs.
"""

from __future__ import annotations

import asyncio
import queue
import re
import time
from types import MappingProxyType
from typing import Any, AsyncGenerator, Callable, Iterator, Mapping

from specdial._core import QueueFullError
from specdial.engine.api import LogprobOptions, RequestError, StreamChunk
from specdial.engine.bounds import check_vocab_bounds
from specdial.engine.courier import Box, courier_for
from specdial.engine.grammar_gate import start_compile
from specdial.engine.messages import Message, RequestSpec, Submit, Submitted
from specdial.engine.output import OutputAccumulator
from specdial.engine.sampling_defaults import request_defaults, with_defaults
from specdial.engine.token_align import TokenBytes
from specdial.worker.logit_bias import check_logit_bias_vocab
from specdial.worker.logprobs import MAX_TOP_LOGPROBS
from specdial.worker.sampling import SamplingParams

Post = Callable[[Message], None]
Cancel = Callable[[RequestSpec], None]



def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text``; :class:`RequestError` without a tokenizer."""
    if tokenizer is None:
        raise RequestError("prompt: this engine has no tokenizer: pass input_ids instead of "
                           "prompt", "prompt")
    enc = tokenizer.encode(text)
    return [int(t) for t in getattr(enc, "ids", enc)]


def _check_logprobs(lp: Any, prompt_len: int, label: str) -> LogprobOptions | None:
    if lp is None:
        return None
    if not isinstance(lp, LogprobOptions):
        raise RequestError(f"{label}logprobs must be a LogprobOptions or None", "logprobs")
    if isinstance(lp.top_n, bool) or not isinstance(lp.top_n, int) or not (
            0 <= lp.top_n <= MAX_TOP_LOGPROBS):
        raise RequestError(f"{label}top_logprobs_num: invalid value {lp.top_n!r}; allowed: "
                           f"int in 0..{MAX_TOP_LOGPROBS}", "top_logprobs_num")
    start = lp.prompt_start
    if start is not None and (isinstance(start, bool) or not isinstance(start, int)
                              or not 0 <= start < prompt_len):
        raise RequestError(f"{label}logprob_start_len: invalid value {start!r}; allowed: -1 "
                           f"(no prompt logprobs) or an int in 0..{prompt_len - 1} (a position "
                           "of the prompt)", "logprob_start_len")
    return lp


def logprob_options(return_logprob: Any, logprob_start_len: Any,
                    top_logprobs_num: Any) -> LogprobOptions | None:
    """SGLang's ``return_logprob`` / ``logprob_start_len`` (-1: no prompt logprobs) /
    ``top_logprobs_num`` as :class:`LogprobOptions` (None without ``return_logprob``).
    Raises :class:`RequestError` for a wrong type, or for the other two set without
    ``return_logprob``; the ranges are checked per request (they depend on the prompt)."""
    if not isinstance(return_logprob, bool):
        raise RequestError(f"return_logprob must be a bool, got {return_logprob!r}",
                           "return_logprob")
    for name, value in (("logprob_start_len", logprob_start_len),
                        ("top_logprobs_num", top_logprobs_num)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestError(f"{name} must be an int, got {value!r}", name)
    if not return_logprob:
        if logprob_start_len != -1 or top_logprobs_num != 0:
            raise RequestError("logprob_start_len and top_logprobs_num need "
                               "return_logprob=True", "return_logprob")
        return None
    return LogprobOptions(top_n=top_logprobs_num,
                          prompt_start=None if logprob_start_len == -1 else logprob_start_len)


#: Sampling defaults of a request when the caller gives none (no model file).
_DEFAULTS: Mapping[str, Any] = MappingProxyType(request_defaults())


def _split_stop(sampling_params: Any, stop: Any, label: str) -> tuple[Any, Any]:
    """SGLang's ``sampling_params["stop"]`` moved out of the sampling params (stop strings are
    matched by the engine loop, not sampled); a different ``stop`` argument is an error."""
    if not isinstance(sampling_params, dict) or "stop" not in sampling_params:
        return sampling_params, stop
    params = dict(sampling_params)
    in_params = params.pop("stop")
    if stop is not None and in_params is not None and in_params != stop:
        raise RequestError(f"{label}stop is given both in sampling_params and as an argument, "
                           "with different values; give it once", "stop")
    return params, stop if in_params is None else in_params


def _check_context(n: int, max_new: int, ctx: int, field: str, label: str, *, sent: bool,
                   context_label: str | None) -> None:
    """``RequestError`` when ``n`` prompt tokens leave no room within the context of ``ctx``
    tokens, or ``n + max_new`` exceed it. The error names what the user sent: the prompt
    (``field``) when ``max_new_tokens`` was not ``sent`` (its default then overflows), and the
    allowed values; ``context_label`` names the option that set the limit."""
    where = context_label or f"context_length {ctx}"
    if n >= ctx:
        raise RequestError(f"{label}{field}: {n} tokens leave no room for a completion within "
                           f"{where}; allowed: at most {ctx - 1} prompt tokens", field)
    if n + max_new <= ctx:
        return
    if sent:
        raise RequestError(f"{label}{n} prompt tokens + max_new_tokens {max_new} exceed "
                           f"{where}; allowed: max_new_tokens <= {ctx - n} for this prompt",
                           "max_new_tokens")
    raise RequestError(f"{label}{field}: {n} tokens + the default max_new_tokens {max_new} "
                       f"(not sent) exceed {where}; allowed: at most {max(ctx - max_new, 0)} "
                       f"prompt tokens, or send max_new_tokens <= {ctx - n}", field)


def make_spec(prompt: Any, input_ids: Any, sampling_params: Any, stop: Any, *, tokenizer: Any,
              vocab_size: int, context_length: int, eos_token_ids: frozenset[int],
              label: str = "", logprobs: LogprobOptions | None = None,
              defaults: Mapping[str, Any] = _DEFAULTS,
              context_label: str | None = None) -> RequestSpec:
    """Validate one request (``label`` prefixes the messages, e.g. ``"prompt 2: "``).

    ``context_label``: how the messages name the context limit (the option that set it,
    :func:`specdial.engine.bounds.context_label`; default ``context_length N``).

    ``defaults``: the sampling values of the fields ``sampling_params`` leaves unset
    (:func:`specdial.engine.sampling_defaults.request_defaults`; the engine passes the ones
    its target's ``generation_config.json`` sets).

    Raises :class:`RequestError` (``param`` = ``prompt``, ``input_ids``, a sampling key or
    ``stop``) for: both or neither of prompt / input_ids, a non-str prompt, a prompt that is not
    valid Unicode (a lone surrogate), an empty prompt,
    token ids outside the vocabulary (prompt, ``stop_token_ids``; ``top_k`` above the vocabulary
    size: :mod:`specdial.engine.bounds`), a bad sampling value or unknown key, a prompt leaving no
    room for a completion, prompt + ``max_new_tokens`` above ``context_length``, bad stop
    strings (or stop strings without a tokenizer), bad :class:`LogprobOptions` (``top_n``
    outside 0..20, ``prompt_start`` outside the prompt). ``sampling_params`` may hold SGLang's
    ``stop`` (a string or a list), equivalent to the ``stop`` argument."""
    sampling_params, stop = _split_stop(sampling_params, stop, label)
    if (prompt is None) == (input_ids is None):
        raise RequestError(f"{label}pass exactly one of prompt or input_ids", "prompt")
    field = "prompt" if input_ids is None else "input_ids"
    if prompt is not None:
        if not isinstance(prompt, str):
            raise RequestError(f"{label}prompt must be a str", "prompt")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: no tokenizer can encode it
            raise RequestError(f"{label}prompt is not valid Unicode text (a lone surrogate "
                               f"{prompt[e.start]!r} at character {e.start})", "prompt") from None
        ids: list[int] | None = encode(tokenizer, prompt)
    else:
        try:
            ids = [int(t) for t in input_ids if not isinstance(t, bool)]
        except (TypeError, ValueError):
            ids = None
        if ids is None or len(ids) != len(input_ids):
            raise RequestError(f"{label}input_ids must be a list of ints", "input_ids")
    if not ids:
        raise RequestError(f"{label}{field} is empty (0 tokens); allowed: 1+ token ids in "
                           f"[0, {vocab_size})", field)
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise RequestError(f"{label}{field}: invalid token id {bad}; allowed: token ids in "
                           f"[0, {vocab_size}) (the vocabulary)", field)
    try:
        params = SamplingParams.from_dict(with_defaults(sampling_params, defaults))
    except ValueError as e:
        m = re.match(r"SamplingParams(?:\.(\w+)|: unknown key '([^']*)')", str(e))
        raise RequestError(f"{label}{e}", (m.group(1) or m.group(2)) if m else None) from e
    check_vocab_bounds(params, vocab_size, label)
    try:
        check_logit_bias_vocab(params.logit_bias, vocab_size)
    except ValueError as e:
        raise RequestError(f"{label}{e}", "logit_bias") from None
    _check_context(len(ids), params.max_new_tokens, context_length, field, label,
                   sent=isinstance(sampling_params, Mapping)
                   and sampling_params.get("max_new_tokens") is not None,
                   context_label=context_label)
    stops: tuple[str, ...] = ()
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s
                                                           for s in stop):
            raise RequestError(f"{label}stop must be a list of non-empty strings", "stop")
        if stop and tokenizer is None:
            raise RequestError(f"{label}stop strings need a tokenizer", "stop")
        stops = tuple(stop)
    stop_ids = params.stop_token_ids + (() if params.ignore_eos else tuple(sorted(eos_token_ids)))
    return RequestSpec(ids, params, stop_ids, stops, sink=lambda _: None,
                       logprobs=_check_logprobs(logprobs, len(ids), label),
                       min_tokens_ids=_min_tokens_ids(params, eos_token_ids, vocab_size, label),
                       grammar=start_compile(params.structured, tokenizer, vocab_size,
                                             eos_token_ids, label))


def _min_tokens_ids(params: SamplingParams, eos_token_ids: frozenset[int], vocab_size: int,
                    label: str) -> tuple[int, ...]:
    """The ids masked while the output is shorter than ``min_tokens``: EOS (even with
    ``ignore_eos``, as vLLM's ``all_stop_token_ids``) and ``stop_token_ids``, those inside the
    vocabulary (others can never be sampled). :class:`RequestError` when they are the whole
    vocabulary (nothing could be sampled)."""
    if not params.min_tokens:
        return ()
    ids = tuple(sorted(t for t in set(params.stop_token_ids) | eos_token_ids if t < vocab_size))
    if len(ids) >= vocab_size:
        raise RequestError(f"{label}min_tokens: {params.min_tokens} tokens are required before "
                           f"a stop, but every token id of the vocabulary is an EOS or stop "
                           "token id; nothing could be sampled", "min_tokens")
    return ids


def batch_specs(prompt: Any, sampling_params: Any, input_ids: Any, return_logprob: Any,
                logprob_start_len: Any, top_logprobs_num: Any, return_text_in_logprobs: Any, *,
                spec: Callable[..., RequestSpec], tokenizer: Any,
                token_bytes: TokenBytes | None = None
                ) -> tuple[bool, list[RequestSpec], list[OutputAccumulator]]:
    """Validate a ``generate`` / ``async_generate`` call (SGLang's ``Engine.generate``
    arguments): ``(single, specs, outputs)``. ``spec(prompt, input_ids, sampling_params, stop,
    label, logprobs)`` validates one prompt; ``token_bytes`` (the tokenizer's, None without
    one) aligns the outputs' logprob entries to their text
    (:class:`~specdial.engine.output.OutputAccumulator`). Raises :class:`RequestError` naming
    the field."""
    if (prompt is None) == (input_ids is None):
        raise RequestError("pass exactly one of prompt or input_ids", "prompt")
    if prompt is not None and not isinstance(prompt, (str, list, tuple)):
        raise RequestError("prompt must be a string or a list of strings, got "
                           f"{type(prompt).__name__}", "prompt")
    single = isinstance(prompt, str) or (prompt is None and (
        not input_ids or not isinstance(input_ids[0], (list, tuple))))
    items: list[Any] = [prompt if prompt is not None else input_ids] if single else list(
        prompt if prompt is not None else input_ids)  # type: ignore[arg-type]
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != len(items):
            raise RequestError(f"{len(sampling_params)} sampling_params for {len(items)} "
                               "prompts", "sampling_params")
        sps = list(sampling_params)
    else:
        sps = [sampling_params] * len(items)
    lp = logprob_options(return_logprob, logprob_start_len, top_logprobs_num)
    if not isinstance(return_text_in_logprobs, bool):
        raise RequestError(f"return_text_in_logprobs must be a bool, got "
                           f"{return_text_in_logprobs!r}", "return_text_in_logprobs")
    if return_text_in_logprobs and tokenizer is None:
        raise RequestError("return_text_in_logprobs needs a tokenizer", "return_text_in_logprobs")
    specs = [spec(x if prompt is not None else None,
                  x if prompt is None else None, sp, None,
                  "" if single else f"prompt {i}: ", lp)
             for i, (x, sp) in enumerate(zip(items, sps))]
    decode = (lambda t: str(tokenizer.decode([t]))) if return_text_in_logprobs else None
    outs = [OutputAccumulator(s.prompt_ids, return_logprob=lp is not None, decode=decode,
                              token_bytes=token_bytes, skip_special=s.params.skip_special_tokens)
            for s in specs]
    return single, specs, outs


def collect(post: Post, cancel: Cancel, specs: list[RequestSpec],
            outs: list[OutputAccumulator] | None = None) -> list[dict[str, Any]]:
    """Run ``specs`` to the end; SGLang-style dicts (``text`` is the concatenation of the
    streamed deltas), built by ``outs`` (one :class:`OutputAccumulator` per spec; default:
    without logprobs). A request refused by a full queue is submitted again when the queue
    may have room (polled every 20 ms). Raises the first other submission error (after
    cancelling the rest)."""
    q: queue.SimpleQueue[tuple[int, list[Any]]] = queue.SimpleQueue()
    for i, spec in enumerate(specs):
        spec.sink = held_until_end((lambda i: lambda items: q.put((i, items)))(i))
    if outs is None:
        outs = [OutputAccumulator(spec.prompt_ids) for spec in specs]
    left, in_submit = len(specs), len(specs)
    retry: list[RequestSpec] = []
    try:
        post(Submit(specs))
        while left:
            try:
                i, items = q.get(timeout=0.02 if retry and not in_submit else None)
            except queue.Empty:  # the queue was full: try again
                post(Submit(retry))
                in_submit, retry = len(retry), []
                continue
            for item in items:
                if isinstance(item, Submitted):
                    in_submit -= 1
                elif isinstance(item, QueueFullError):
                    in_submit -= 1
                    retry.append(specs[i])
                elif isinstance(item, BaseException):
                    raise item
                else:
                    outs[i].add(item)
                    if item.finished:
                        left -= 1
    finally:
        if left:
            for spec in specs:
                cancel(spec)
    return [out.result() for out in outs]


class _StreamDriver:
    """What a sync and an async stream of one request share: the meaning of each sink item
    (``Submitted`` is skipped, an exception ends the stream by raising, a chunk is yielded
    and the stream is done after the finished one) and the cancel of a stream left early."""

    def __init__(self, cancel: Cancel, spec: RequestSpec,
                 on_submitted: Callable[[int], None] | None = None) -> None:
        self.cancel, self.spec, self.done = cancel, spec, False
        self.on_submitted = on_submitted

    def take(self, item: Any) -> StreamChunk | None:
        """The chunk to yield for ``item`` (None: nothing); raises an error item. ``Submitted``
        goes to ``on_submitted`` (when given) with the request's engine id."""
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if isinstance(item, Submitted):
            if self.on_submitted is not None:
                self.on_submitted(item.request_id)
            return None
        self.done = bool(item.finished)
        return item

    def close(self) -> None:
        """The stream ends: cancel the request unless its last chunk (or an error) came."""
        if not self.done:
            self.cancel(self.spec)


def sync_stream(post: Post, cancel: Cancel, spec: RequestSpec) -> Iterator[StreamChunk]:
    """The chunks of ``spec`` (a generator: submission on the first ``next``)."""
    q: queue.SimpleQueue[Any] = queue.SimpleQueue()
    spec.sink = q.put
    post(Submit([spec]))
    driver = _StreamDriver(cancel, spec)
    try:
        while not driver.done:
            chunk = driver.take(q.get())
            if chunk is not None:
                yield chunk
    finally:
        driver.close()


def held_until_end(deliver: Callable[[list[Any]], None]) -> Callable[[Any], None]:
    """A request's sink for a consumer that wants its whole output, not each step
    (``generate``, ``async_generate``; streams take every chunk as it comes): the engine loop
    calls it once per item; a chunk that does not finish the request is held (a list append on
    the loop's thread), and ``deliver`` gets the held chunks in order, as one list, with the
    item after them that is not such a chunk (the finished chunk, an error, ``Submitted``,
    a ``QueueFullError``). So the consumer's thread or event loop is woken once per request
    instead of once per decode iteration: each wake-up costs the engine loop a thread hand-over
    and the GIL back (BENCHMARKS.md, issue 32's per-chunk wake-up), a per-iteration cost that
    does not shrink with the batch. Each chunk gets its :attr:`~specdial.engine.api.
    StreamChunk.emitted_s` (``time.perf_counter()`` now, on the loop's thread as it emits)."""
    held: list[Any] = []

    def sink(item: Any) -> None:
        held.append(item)
        if isinstance(item, StreamChunk):
            item.emitted_s = time.perf_counter()
            if not item.finished:
                return
        items = held[:]
        held.clear()
        deliver(items)

    return sink


async def async_stream(post: Post, cancel: Cancel, spec: RequestSpec, *,
                       whole: bool = False,
                       on_submitted: Callable[[int], None] | None = None
                       ) -> AsyncGenerator[StreamChunk, None]:
    """The chunks of ``spec`` on the running event loop (submission on the first
    ``__anext__``; ``aclose()`` or cancellation while awaiting a chunk cancels). ``whole``:
    the consumer only needs the request's output at its end, so the chunks arrive together
    (:func:`held_until_end`: one event-loop wake-up per request, not per iteration).
    ``on_submitted``: called on this event loop with the request's engine id once the loop
    accepted it (``Submitted``, handed over at once even with ``whole``), so the consumer can
    ``abort`` it by id and still read what it generated until then.

    Delivery goes through the loop's :class:`~specdial.engine.courier.Courier`: one wake of
    the loop per engine iteration for all its streams, and the chunks that arrived since this
    stream last resumed are yielded one after the other without awaiting in between (so a
    consumer that fell behind handles them in one step)."""
    courier = courier_for(asyncio.get_running_loop())
    box = Box()

    def deliver(items: list[Any]) -> None:
        if not courier.deliver(box, items):  # the event loop is closed: nobody reads
            cancel(spec)

    spec.sink = held_until_end(deliver) if whole else lambda item: deliver([item])
    post(Submit([spec]))
    driver = _StreamDriver(cancel, spec, on_submitted)
    try:
        while not driver.done:
            for item in await courier.take(box):
                chunk = driver.take(item)
                if chunk is not None:
                    yield chunk
    finally:
        driver.close()


async def async_collect(post: Post, cancel: Cancel, specs: list[RequestSpec],
                        outs: list[OutputAccumulator]) -> list[dict[str, Any]]:
    """:func:`collect` on the running event loop: every spec streams concurrently into its
    accumulator; a spec refused by a full queue is submitted again every 20 ms; another
    submission error is raised after cancelling the others."""

    async def one(spec: RequestSpec, out: OutputAccumulator) -> None:
        while True:
            try:
                async for chunk in async_stream(post, cancel, spec, whole=True):
                    out.add(chunk)
                return
            except QueueFullError:
                await asyncio.sleep(0.02)

    tasks = [asyncio.ensure_future(one(s, o)) for s, o in zip(specs, outs)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
    return [out.result() for out in outs]
