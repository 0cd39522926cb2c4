"""The engine loop's inbox: what other threads post, and the intake of submitted requests.

:class:`LoopInbox` is the part of :class:`~specdial.engine.loop.EngineLoop` that takes its
messages (:class:`Submit`, :class:`Cancel`, :class:`Abort`, :class:`Shutdown`,
:class:`FlushCache`, :class:`Crash`; FIFO, handled between iterations on the loop thread) and
adds submitted requests to the scheduler.

**Held requests.** A request whose grammar is still compiling is held before the scheduler's
queue (:func:`~specdial.engine.grammar_gate.hold_for_grammar`; it has no engine id and no KV
page yet) and posted again when the compile is done. The loop keeps them in
:attr:`LoopInbox.held` so that none is left unanswered when it stops:

- ``Shutdown(drain=True)`` (``Engine.shutdown()``'s default: every accepted request finishes):
  a held request counts as accepted (its submission came before the shutdown; its client
  cannot tell a compile from a queue wait), so the loop keeps running until each held request
  compiled, entered the scheduler and finished, as SGLang's drain on SIGTERM waits for every
  request it knows, those in its scheduler's grammar queue included. A compile that never
  ends keeps the drain waiting, as a request that never ends would.
- ``Shutdown(drain=False)`` (what the HTTP server calls once its own graceful timeout is
  over): each held request ends at once with the shutdown end
  (:func:`~specdial.engine.ends.shut_down`, ``finish_reason`` ``abort`` with ``cause``
  ``shutdown``, on a chunk with ``request_id`` -1: it never had an engine id), like the live
  requests it aborts; its compile is left to finish on the pool (xgrammar cannot stop one)
  and its later submit is dropped.
- a failed loop ends each held request with the failed end
  (:func:`~specdial.engine.ends.failed`), like its live requests.
- a ``Cancel`` (the consumer left) forgets it: its later submit is dropped.
"""

from __future__ import annotations

import queue
from typing import Any, Callable

import numpy as np

from specdial._core import InvalidRequestError, QueueFullError
from specdial.detokenize import IncrementalText
from specdial.engine.api import RequestError, StreamChunk
from specdial.engine.cache_ops import cache_limit
from specdial.engine.ends import aborted, shut_down
from specdial.engine.grammar_gate import hold_for_grammar, matcher_of
from specdial.engine.isolation import param_of
from specdial.engine.live import LiveRequest
from specdial.engine.messages import (Abort, Cancel, Crash, FlushCache, Message, RequestSpec,
                                      Shutdown, Submit, Submitted)

__all__ = ["LoopInbox"]


class LoopInbox:
    """The inbox half of the engine loop (a base class of
    :class:`~specdial.engine.loop.EngineLoop`, which provides the attributes and methods
    declared here): :meth:`post` from any thread; the rest runs on the loop thread.

    ``held``: the requests held while their grammar compiles (see the module docstring).
    """

    inbox: queue.SimpleQueue[Message]
    held: set[RequestSpec]
    live: dict[int, LiveRequest]
    sched: Any
    worker: Any
    tokenizer: Any
    _stopping: bool
    _drain: bool
    _prompt_tokens: int
    _out: Callable[[Callable[[Any], None], Any], None]
    _flush: Callable[[], None]
    _refresh_stats: Callable[..., None]
    _finish_now: Callable[[int, dict[str, Any]], None]

    def _init_inbox(self) -> None:
        self.inbox = queue.SimpleQueue()
        self.held = set()

    def post(self, message: Message) -> None:
        """Queue a :class:`Submit`, :class:`Cancel`, :class:`Abort` or :class:`Shutdown` for
        the loop (FIFO; handled between iterations)."""
        self.inbox.put(message)

    def _end_held(self, reason: dict[str, Any]) -> None:
        """End every held request now with ``reason`` (its last chunk, ``request_id`` -1) and
        mark it so that its submit after the compile is dropped."""
        for spec in self.held:
            spec.cancelled = True
            self._out(spec.sink, StreamChunk(-1, "", [], True, reason))
        self.held.clear()

    def _answer_until_shutdown(self, error: BaseException) -> None:
        """After the loop failed: refuse submissions (a held request, already ended, is
        dropped) and flushes until the :class:`Shutdown`."""
        while True:
            match self.inbox.get():
                case Submit(specs):
                    for spec in specs:
                        if not spec.cancelled:
                            spec.sink(RuntimeError(f"the engine loop failed: {error}"))
                case Shutdown():
                    return
                case FlushCache(reply):
                    reply.set_exception(RuntimeError(f"the engine loop failed: {error}"))
                case _:
                    pass

    def _handle_inbox(self, block: bool) -> None:
        messages = [self.inbox.get()] if block else []
        flushed: list[tuple[Any, bool]] = []  # answered after the stats show the flush
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        try:
            self._handle_messages(messages, flushed)
        except BaseException as e:  # the loop fails: no flush caller waits forever
            for reply, _ in flushed:
                reply.set_exception(RuntimeError(f"the engine loop failed: {e}"))
            raise
        if messages:
            self._refresh_stats()
            self._flush()
        for reply, done in flushed:  # a caller reading stats() after flush_cache() sees it
            reply.set_result(done)

    def _handle_messages(self, messages: list[Any], flushed: list[tuple[Any, bool]]) -> None:
        """Act on ``messages`` in order; a :class:`FlushCache` is done here and its reply with
        its result appended to ``flushed`` (answered by the caller once stats are refreshed)."""
        for message in messages:
            match message:
                case Submit(specs):
                    for spec in specs:
                        self._submit(spec)
                case Cancel(spec):
                    if spec.rid is not None and spec.rid in self.live:
                        self._finish_now(spec.rid, aborted("aborted: the client stopped reading"))
                    elif spec.rid is None and spec.grammar is not None:  # still compiling
                        spec.cancelled = True
                        self.held.discard(spec)
                case Abort(rid):
                    if rid in self.live:
                        self._finish_now(rid, aborted("aborted by request"))
                case Shutdown(drain):
                    self._stopping, self._drain = True, bool(drain)
                    if not self._drain:
                        reason = shut_down("aborted: the engine is shutting down")
                        for rid in list(self.live):
                            self._finish_now(rid, reason)
                        self._end_held(reason)
                case Crash(text):
                    raise RuntimeError(text)
                case FlushCache(reply):
                    flushed.append((reply, bool(self.sched.flush_cache())))
                case _:
                    raise TypeError(f"unknown engine loop message {message!r}")

    def _submit(self, spec: RequestSpec) -> None:
        """Add ``spec`` to the scheduler (its sink gets ``Submitted`` or the error), or hold it
        while its grammar compiles. Its second submit, once compiled, is still taken during a
        draining shutdown (it was accepted before); an ended one is dropped."""
        again = spec in self.held  # the submit after its grammar compiled
        self.held.discard(spec)
        if self._stopping and not (again and self._drain):
            if not spec.cancelled:
                self._out(spec.sink, RuntimeError("Engine is shut down"))
            return
        if hold_for_grammar(spec, self.post, self._out, on_hold=self.held.add):
            return
        try:
            rid = self.sched.add_request(np.asarray(spec.prompt_ids, np.int64),
                                         spec.params.max_new_tokens, list(spec.stop_token_ids),
                                         True,  # EOS ids are in stop_token_ids
                                         max_cached_tokens=cache_limit(spec))
        except InvalidRequestError as e:
            self._out(spec.sink, RequestError(str(e), param_of(str(e))))
            return
        except QueueFullError as e:
            self._out(spec.sink, e)
            return
        except Exception as e:  # noqa: BLE001 - no request may stop the loop
            self._out(spec.sink, RequestError(f"the scheduler refused the request: "
                                              f"{type(e).__name__}: {e}"))
            return
        spec.rid = rid
        p = spec.params
        self.live[rid] = LiveRequest(spec, rid, IncrementalText(
            self.tokenizer, spec.stop, skip_special_tokens=p.skip_special_tokens,
            include_stop=p.include_stop_str_in_output, min_tokens=p.min_tokens),
            grammar=matcher_of(spec))
        self._prompt_tokens += len(spec.prompt_ids)
        self._out(spec.sink, Submitted(rid))
