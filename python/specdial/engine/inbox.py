"""The engine loop's inbox: what other threads post, and the intake of submitted requests.

:class:`LoopInbox` is the part of :class:`~specdial.engine.loop.EngineLoop` that takes its
messages (:class:`Submit`, :class:`Cancel`, :class:`Abort`, :class:`Shutdown`,
:class:`FlushCache`, :class:`Crash`; FIFO, handled between iterations on the loop thread) and
adds submitted requests to the scheduler: a request whose grammar is still compiling is held
before the scheduler's queue (:func:`~specdial.engine.grammar_gate.hold_for_grammar`) and
posted again when it is ready.
"""

from __future__ import annotations

import queue
from typing import Any, Callable

import numpy as np

from specdial._core import InvalidRequestError, QueueFullError
from specdial.detokenize import IncrementalText
from specdial.engine.api import RequestError
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
    declared here): :meth:`post` from any thread; the rest runs on the loop thread."""

    inbox: queue.SimpleQueue[Message]
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

    def post(self, message: Message) -> None:
        """Queue a :class:`Submit`, :class:`Cancel`, :class:`Abort` or :class:`Shutdown` for
        the loop (FIFO; handled between iterations)."""
        self.inbox.put(message)

    def _answer_until_shutdown(self, error: BaseException) -> None:
        while True:
            match self.inbox.get():
                case Submit(specs):
                    for spec in specs:
                        spec.sink(RuntimeError(f"the engine loop failed: {error}"))
                case Shutdown():
                    return
                case FlushCache(reply):
                    reply.set_exception(RuntimeError(f"the engine loop failed: {error}"))
                case _:
                    pass

    def _handle_inbox(self, block: bool) -> None:
        messages = [self.inbox.get()] if block else []
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                break
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
                case Abort(rid):
                    if rid in self.live:
                        self._finish_now(rid, aborted("aborted by request"))
                case Shutdown(drain):
                    self._stopping, self._drain = True, bool(drain)
                    if not self._drain:
                        for rid in list(self.live):
                            self._finish_now(rid, shut_down("aborted: the engine is shutting "
                                                            "down"))
                case Crash(text):
                    raise RuntimeError(text)
                case FlushCache(reply):
                    reply.set_result(bool(self.sched.flush_cache()))
                case _:
                    raise TypeError(f"unknown engine loop message {message!r}")
        if messages:
            self._refresh_stats()
            self._flush()

    def _submit(self, spec: RequestSpec) -> None:
        if self._stopping:
            self._out(spec.sink, RuntimeError("Engine is shut down"))
            return
        if hold_for_grammar(spec, self.post, self._out, self.worker, self.sched.draft_tree[0]):
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
