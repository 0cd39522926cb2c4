"""What travels between the router and a replica process, and how.

**Transport.** One ``socket.socketpair()`` per replica (a Unix stream socket; the child
inherits its end), wrapped on both sides in :class:`multiprocessing.connection.Connection`,
which frames each message (a length and its bytes). Either side seeing the connection close
knows the other is gone: the router fails the replica's requests, a replica whose router is gone
shuts down.

**Format.** Each message is one :func:`pickle.dumps` (highest protocol) of a list of items, so
that everything one side has to say at a moment goes in one frame: a replica sends all the
stream chunks its engine loop delivered in one iteration (for every request it runs) as one
message, and the router wakes each waiting event loop once per message, not per chunk. A
stream opened with ``whole=True`` (a non-streaming HTTP response) sends nothing until its
request ends, then all its chunks, each stamped with its ``emitted_s``, in one message.

- router -> replica, items ``(op, call_id, payload)``: :data:`STREAM` (payload: the keyword
  arguments of ``async_stream``, ``whole`` included, and ``on_submitted: True`` when the
  router wants the request's id at once), :data:`GENERATE` (``(args, kwargs)`` of ``async_generate``),
  :data:`CANCEL` (None: the consumer left; the replica cancels that call, which aborts its
  request), :data:`ABORT` (an engine request id), :data:`STATS`, :data:`GRAPH_STATS`
  (``graph_stats()``), :data:`FLUSH` (``flush_cache()``), :data:`SHUTDOWN` (``drain``);
  the first message is ``[sys_path, options]``: the router's ``sys.path`` (the replica adds
  the entries it lacks) and the replica's options, a dict of
  :class:`~specdial.config.EngineConfig` fields pickled on their own (:func:`encode`), decoded
  only after the path is extended, so that a ``steps_schedule`` function pickled by reference
  (module and name) imports from where the router found it.
- replica -> router, items ``(call_id, kind, payload)``: :data:`CHUNK` (a
  :class:`~specdial.engine.api.StreamChunk`), :data:`SUBMITTED` (the replica's engine id of a
  stream's request once its engine accepted it, for a stream opened with ``on_submitted``;
  sent at once, even with ``whole``), :data:`ITEM` (a dict of a streamed
  ``generate``), :data:`RESULT` (a call's return value), :data:`END` (a streamed ``generate``
  ended), :data:`ERROR` (an exception as :func:`encode_error`); call id 0 carries
  :data:`READY` (what the router needs of the replica: :func:`ready_info`),
  :data:`FAILURE` (the replica's engine failed: its message) and :data:`BEAT` (the heartbeat,
  :mod:`specdial.launch.replica_watch`: ``(stall_s, loop_turns)``, the seconds the replica's
  engine loop has made no progress while calls were in flight, 0.0 when it progresses or is
  idle, and its ``Engine.loop_turns``).

Pickle is safe here: both ends are this package, on one host, over a socket nobody else holds.
"""

from __future__ import annotations

import pickle
from typing import Any

from specdial.engine.api import QueueFullError, RequestError

__all__ = ["ABORT", "BEAT", "CANCEL", "CHUNK", "END", "ERROR", "FAILURE", "FLUSH", "GENERATE",
           "GRAPH_STATS", "ITEM", "READY", "RESULT", "SHUTDOWN", "STATS", "STREAM", "SUBMITTED",
           "decode", "decode_error", "encode", "encode_error"]

STREAM, GENERATE, CANCEL, ABORT, STATS, GRAPH_STATS, FLUSH, SHUTDOWN = (
    "stream", "generate", "cancel", "abort", "stats", "graph_stats", "flush_cache", "shutdown")
CHUNK, ITEM, RESULT, END, ERROR, READY, FAILURE, BEAT, SUBMITTED = (
    "chunk", "item", "result", "end", "error", "ready", "failure", "beat", "submitted")


def encode(items: list[Any]) -> bytes:
    """One frame's bytes for ``items``."""
    return pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> list[Any]:
    """The items of one frame."""
    return pickle.loads(data)


def encode_error(e: BaseException) -> tuple[str, str, str | None]:
    """``(kind, message, param)`` of an exception a call raised: ``kind`` ``"request"``
    (:class:`RequestError`, with its ``param``), ``"queue_full"`` (:class:`QueueFullError`),
    ``"value"``, ``"type"`` or ``"runtime"`` (anything else)."""
    if isinstance(e, RequestError):
        return "request", str(e), e.param
    if isinstance(e, QueueFullError):
        return "queue_full", str(e), None
    if isinstance(e, TypeError):
        return "type", str(e), None
    if isinstance(e, ValueError):
        return "value", str(e), None
    return "runtime", f"{type(e).__name__}: {e}", None


def decode_error(kind: str, message: str, param: str | None) -> BaseException:
    """The exception :func:`encode_error` encoded, raised again on the router's side."""
    if kind == "request":
        return RequestError(message, param)
    if kind == "queue_full":
        return QueueFullError(message)
    if kind == "type":
        return TypeError(message)
    if kind == "value":
        return ValueError(message)
    return RuntimeError(message)
