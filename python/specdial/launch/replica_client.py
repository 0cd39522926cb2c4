"""The router's handle on one replica process: :class:`ReplicaClient`.

It starts ``python -m specdial.launch.replica_main`` (:mod:`specdial.launch.replica_main`)
with one end of a socket pair, sends the replica's options, waits for it to be ready and then
offers the serving contract of :mod:`specdial.engine.api` (``stream``, ``async_stream``,
``generate``, ``async_generate``, ``abort``, ``stats``, ``shutdown``, ``failure``,
``tokenizer``, ``context_length``) over the connection (:mod:`specdial.launch.replica_wire`).
One reader thread per replica receives the replica's batched messages and hands each call's
items to its consumer: a ``queue.SimpleQueue`` for synchronous callers, or the caller's asyncio
loop (one ``call_soon_threadsafe`` per loop per message, however many streams it carries).

**Faults.** When the connection closes without a shutdown (the process died: killed, crashed,
out of memory), :attr:`ReplicaClient.failure` names the replica, its pid and how it exited, and
every call in flight ends at once: a stream with a last chunk of finish reason ``error``
(``status_code`` 503, :mod:`specdial.engine.ends`), a ``generate`` with
:class:`ReplicaFailure`. The replica's own engine failing (e.g. its tensor-parallel rank died)
is reported by the replica and also sets :attr:`ReplicaClient.failure`. A replica that is alive
but **hung** (its engine loop stalled with requests in flight, or nothing heard from it, for
``watchdog_timeout`` seconds: :mod:`specdial.launch.replica_watch`) is treated the same way:
its calls end at once with an error naming it and the hang, then its process is killed. A failed
replica is not
restarted: the router stops sending to it (:class:`~specdial.launch.routing.Router`) and the
server's ``/health`` names it; restarting means restarting ``specdial serve``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import AsyncIterator, Iterator
from multiprocessing.connection import Connection
from typing import Any, Callable

from specdial.engine.api import EngineStats, LogprobOptions, StreamChunk
from specdial.engine.ends import failed
from specdial.launch import replica_wire as w
from specdial.launch.replica_watch import Watchdog

__all__ = ["DEAD", "ReplicaClient", "ReplicaFailure"]

logger = logging.getLogger("specdial.launch")

#: Item kind delivered to the calls of a replica that died (payload: the message).
DEAD = "dead"
#: Seconds :meth:`ReplicaClient.stats` waits for an answer.
STATS_TIMEOUT_S = 30.0


class ReplicaFailure(RuntimeError):
    """A call could not complete because its replica process failed (the message names it)."""


class _Call:
    """One call's inbox: ``loop`` None (a synchronous caller) or the caller's asyncio loop."""

    __slots__ = ("id", "loop", "inbox", "done", "rid", "meta", "on_submitted")

    def __init__(self, cid: int, loop: asyncio.AbstractEventLoop | None) -> None:
        self.id, self.loop, self.done = cid, loop, False
        self.inbox: Any = queue.SimpleQueue() if loop is None else asyncio.Queue()
        self.rid, self.meta = -1, {}
        self.on_submitted: Callable[[int], None] | None = None


def _put_all(entries: list[tuple[_Call, tuple[str, Any]]]) -> None:
    for call, item in entries:
        call.inbox.put_nowait(item)


class ReplicaClient:
    """Replica process ``dp_rank`` (module docstring). ``options``: its ``Engine`` keyword
    arguments (:func:`~specdial.launch.replica_setup.replica_options`; its
    ``watchdog_timeout``, default 300 s, is the hang timeout); ``env``: its environment (None:
    this one's). Returns once the process has started; call :meth:`wait_ready` before
    serving. Raises ``OSError`` when the process cannot start."""

    def __init__(self, dp_rank: int, options: dict[str, Any],
                 env: dict[str, str] | None = None) -> None:
        self.dp_rank = dp_rank
        self.watchdog = Watchdog(options.get("watchdog_timeout", 300.0))
        mine, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "specdial.launch.replica_main", "--fd",
                 str(theirs.fileno()), "--dp-rank", str(dp_rank), "--log-level",
                 str(logging.getLogger("specdial").getEffectiveLevel())],
                pass_fds=(theirs.fileno(),), env=env,
                stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.conn = Connection(mine.detach())
        self._send_lock, self._lock = threading.Lock(), threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._closing = False
        self.dead: str | None = None
        self.engine_failure: str | None = None
        #: The replica's ``Engine.loop_turns`` as of its latest heartbeat (0 before the first;
        #: at most one beat interval, ``min(1 s, watchdog_timeout / 4)``, old).
        self.loop_turns = 0
        self.info: dict[str, Any] = {}
        self.conn.send_bytes(w.encode([list(sys.path), w.encode(options)]))

    # ----------------------------------------------------------------- start-up
    def wait_ready(self, timeout_s: float) -> None:
        """Wait for the replica's engine to be built (at most ``timeout_s``), then start the
        reader thread. Raises the replica's own error (e.g. ``ValueError`` for a bad option) or
        :class:`ReplicaFailure` when it exits or does not answer in time."""
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.2):
            if self.proc.poll() is not None:
                raise ReplicaFailure(f"{self._name()} {self._exit_text()} during start-up")
            if time.monotonic() > deadline:
                raise ReplicaFailure(f"{self._name()} was not ready within {timeout_s:g}s")
        try:
            (_, kind, payload), = w.decode(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise ReplicaFailure(f"{self._name()} {self._exit_text(5.0)} during start-up") \
                from None
        if kind == w.ERROR:
            raise w.decode_error(*payload)
        self.info = payload
        self.tokenizer = payload["tokenizer"]
        self.context_length = payload["context_length"]
        self.policy_cache = types.SimpleNamespace(status=payload["policy_cache"])
        self.watchdog.heard_from(time.monotonic())
        threading.Thread(target=self._read, name=f"specdial-dp{self.dp_rank}-read",
                         daemon=True).start()

    def _name(self) -> str:
        return f"data-parallel replica {self.dp_rank} (pid {self.proc.pid})"

    def _exit_text(self, wait_s: float = 0.0) -> str:
        try:
            code = self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            return "closed its connection"
        return f"exited with {f'signal {-code}' if code < 0 else f'exit status {code}'}"

    # ----------------------------------------------------------------- incoming
    def _read(self) -> None:
        dog, conn = self.watchdog, self.conn
        try:
            while True:
                if not conn.poll(dog.check_s):
                    self._check(dog.verdict(time.monotonic()))
                    continue
                items = w.decode(conn.recv_bytes())
                dog.heard_from(time.monotonic())
                self._deliver(items)
                if dog.stalled:
                    self._check(dog.verdict(time.monotonic()))
        except (EOFError, OSError):
            pass
        why = "shut down" if self._closing else f"{self._name()} {self._exit_text(2.0)}"
        self._fail_calls(why)

    def _fail_calls(self, why: str) -> None:
        """Mark the replica dead (the first reason stays) and end every call in flight."""
        with self._lock:
            self.dead = self.dead or why
            calls, self._calls = list(self._calls.values()), {}
        self._deliver_to(calls, (DEAD, self.dead))

    def _check(self, hang: str | None) -> None:
        """The watchdog's ``hang`` verdict (None: well): fail the calls, kill the process (its
        connection then closes and the reader ends)."""
        if hang is None or self._closing or self.dead is not None:
            return
        why = f"{self._name()} hung: {hang}; killed"
        logger.error("%s", why)
        self._fail_calls(why)
        self.proc.kill()

    def _deliver(self, items: list[tuple[int, str, Any]]) -> None:
        per_loop: dict[Any, list[tuple[_Call, tuple[str, Any]]]] = {}
        with self._lock:
            for cid, kind, payload in items:
                if cid == 0:
                    if kind == w.BEAT:
                        stalled_s, self.loop_turns = payload
                        self.watchdog.beat(stalled_s)
                    elif kind == w.FAILURE:
                        self.engine_failure = f"{self._name()}: {payload}"
                    continue
                call = self._calls.get(cid)
                if call is None:
                    continue
                if call.loop is None:
                    call.inbox.put((kind, payload))
                else:
                    per_loop.setdefault(call.loop, []).append((call, (kind, payload)))
        for loop, entries in per_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, entries)
            except RuntimeError:  # that caller's loop is closed
                pass

    @staticmethod
    def _deliver_to(calls: list[_Call], item: tuple[str, Any]) -> None:
        for call in calls:
            if call.loop is None:
                call.inbox.put(item)
            else:
                try:
                    call.loop.call_soon_threadsafe(call.inbox.put_nowait, item)
                except RuntimeError:
                    pass

    # ----------------------------------------------------------------- calls
    def _open(self, op: str, payload: Any, loop: asyncio.AbstractEventLoop | None) -> _Call:
        call = _Call(next(self._ids), loop)
        with self._lock:
            if self.dead is None:
                self._calls[call.id] = call
                dead = None
            else:
                dead = self.dead
        if dead is not None:
            call.inbox.put_nowait((DEAD, dead))
            return call
        self._send([(op, call.id, payload)])
        return call

    def _close(self, call: _Call) -> None:
        with self._lock:
            self._calls.pop(call.id, None)
        if not call.done and self.dead is None:
            self._send([(w.CANCEL, call.id, None)])

    def _send(self, items: list[Any]) -> None:
        try:
            with self._send_lock:
                self.conn.send_bytes(w.encode(items))
        except OSError:
            pass  # the reader thread sees the closed connection and fails the calls

    def _chunk(self, call: _Call, kind: str, payload: Any) -> StreamChunk | None:
        """A stream's next chunk from one item (raises what the replica raised)."""
        if kind == w.CHUNK:
            call.rid, call.meta = payload.request_id, payload.meta_info
            call.done = payload.finished
            return payload
        if kind == w.SUBMITTED:
            call.rid = payload
            if call.on_submitted is not None:
                call.on_submitted(payload)
            return None
        call.done = True
        if kind == w.ERROR:
            raise w.decode_error(*payload)
        message = payload if kind == DEAD else f"unexpected item {kind!r}"
        return StreamChunk(call.rid, "", [], True, failed(message, 503), dict(call.meta))

    def _value(self, call: _Call, kind: str, payload: Any) -> Any:
        """A call's result from one item (raises what the replica raised, or
        :class:`ReplicaFailure`); ``w.END`` returns ``w.END``."""
        if kind in (w.RESULT, w.ITEM):
            call.done = kind == w.RESULT
            return payload
        call.done = True
        if kind == w.END:
            return w.END
        if kind == w.ERROR:
            raise w.decode_error(*payload)
        raise ReplicaFailure(payload if kind == DEAD else f"unexpected item {kind!r}")

    def stream(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
               sampling_params: dict[str, Any] | None = None, stop: list[str] | None = None,
               logprobs: LogprobOptions | None = None) -> Iterator[StreamChunk]:
        """``Engine.stream`` on the replica; closing early aborts the request there."""
        call = self._open(w.STREAM, dict(prompt=prompt, input_ids=input_ids,
                                         sampling_params=sampling_params, stop=stop,
                                         logprobs=logprobs), None)
        try:
            while not call.done:
                chunk = self._chunk(call, *call.inbox.get())
                if chunk is not None:
                    yield chunk
        finally:
            self._close(call)

    async def async_stream(self, prompt: str | None = None, *,
                           input_ids: list[int] | None = None,
                           sampling_params: dict[str, Any] | None = None,
                           stop: list[str] | None = None,
                           logprobs: LogprobOptions | None = None,
                           whole: bool = False,
                           on_submitted: Callable[[int], None] | None = None
                           ) -> AsyncIterator[StreamChunk]:
        """``Engine.async_stream`` on the replica; ``aclose()`` or cancellation aborts it.
        ``whole``: the replica holds the chunks until the request ends and sends them in one
        message (one wake-up here per request, not per decode iteration). ``on_submitted``:
        called here with the replica's id of the request once its engine accepted it (one
        more message from the replica: :data:`~specdial.launch.replica_wire.SUBMITTED`)."""
        payload = dict(prompt=prompt, input_ids=input_ids, sampling_params=sampling_params,
                       stop=stop, logprobs=logprobs, whole=whole)
        if on_submitted is not None:
            payload["on_submitted"] = True
        call = self._open(w.STREAM, payload, asyncio.get_running_loop())
        call.on_submitted = on_submitted  # before the consumer reads the inbox below
        try:
            while not call.done:
                chunk = self._chunk(call, *(await call.inbox.get()))
                if chunk is not None:
                    yield chunk
        finally:
            self._close(call)

    def generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                 **kwargs: Any) -> Any:
        """``Engine.generate`` on the replica (``stream=True``: an iterator of dicts)."""
        call = self._open(w.GENERATE, ((prompt, sampling_params, input_ids), kwargs), None)
        if kwargs.get("stream"):
            return self._items(call)
        try:
            return self._value(call, *call.inbox.get())
        finally:
            self._close(call)

    def _items(self, call: _Call) -> Iterator[Any]:
        try:
            while (item := self._value(call, *call.inbox.get())) is not w.END:
                yield item
        finally:
            self._close(call)

    async def async_generate(self, prompt: Any = None, sampling_params: Any = None,
                             input_ids: Any = None, **kwargs: Any) -> Any:
        """``Engine.async_generate`` on the replica (``stream=True``: an async iterator)."""
        call = self._open(w.GENERATE, ((prompt, sampling_params, input_ids), kwargs),
                          asyncio.get_running_loop())
        if kwargs.get("stream"):
            return self._aitems(call)
        try:
            return self._value(call, *(await call.inbox.get()))
        finally:
            self._close(call)

    async def _aitems(self, call: _Call) -> AsyncIterator[Any]:
        try:
            while (item := self._value(call, *(await call.inbox.get()))) is not w.END:
                yield item
        finally:
            self._close(call)

    def abort(self, request_id: int) -> None:
        """Abort the replica's request ``request_id`` (its own id; ignored once dead)."""
        if self.dead is None:
            self._send([(w.ABORT, 0, int(request_id))])

    def stats(self) -> EngineStats:
        """The replica's ``Engine.stats()``. Raises :class:`ReplicaFailure` once it is dead
        and ``TimeoutError`` after :data:`STATS_TIMEOUT_S` without an answer."""
        return self._ask(w.STATS, "stats()")

    def graph_stats(self) -> dict[str, Any]:
        """The replica's ``Engine.graph_stats()``. Raises as :meth:`stats`."""
        return self._ask(w.GRAPH_STATS, "graph_stats()")

    def flush_cache(self) -> bool:
        """The replica's ``Engine.flush_cache()`` (False while it has live requests). Raises
        as :meth:`stats`."""
        return self._ask(w.FLUSH, "flush_cache()")

    def _ask(self, op: str, what: str) -> Any:
        """One call without arguments and its result, waited for on this thread."""
        call = self._open(op, None, None)
        try:
            try:
                item = call.inbox.get(timeout=STATS_TIMEOUT_S)
            except queue.Empty:
                call.done = True
                raise TimeoutError(f"{self._name()} did not answer {what} within "
                                   f"{STATS_TIMEOUT_S:g}s") from None
            return self._value(call, *item)
        finally:
            self._close(call)

    @property
    def failure(self) -> str | None:
        """Why this replica cannot serve (its process died, or its engine failed), or None."""
        if self.dead is not None and not self._closing:
            return self.dead
        return self.engine_failure

    def kill(self) -> None:
        """SIGKILL the replica process (tests and operators' drills)."""
        self.proc.kill()

    def shutdown(self, drain: bool = True) -> None:
        """Stop the replica (``drain`` as ``Engine.shutdown``) and wait for its process;
        one that does not exit within a minute after its engine stopped is killed."""
        if self._closing:
            return
        self._closing = True
        if self.dead is None:
            self._send([(w.SHUTDOWN, 0, bool(drain))])
        try:
            self.proc.wait(600.0 if drain else 60.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()


def child_env(cuda_visible: str | None) -> dict[str, str] | None:
    """The environment of a replica: this one, with ``CUDA_VISIBLE_DEVICES`` set to
    ``cuda_visible`` (None: unchanged)."""
    if cuda_visible is None:
        return None
    return {**os.environ, "CUDA_VISIBLE_DEVICES": cuda_visible}


def start_replicas(cfg: Any, on_cpu: bool, visible: list[str] | None,
                   timeout_s: float) -> list[ReplicaClient]:
    """Start ``cfg.dp_size`` replica processes at once (each from
    :func:`~specdial.launch.replica_setup.replica_options`; ``visible``: the devices to slice
    among them, None on the CPU) and wait until all are ready. Raises what a replica raises;
    the others are stopped then."""
    from specdial.launch.replica_setup import replica_devices, replica_options

    clients: list[ReplicaClient] = []
    try:
        for i in range(cfg.dp_size):
            cuda = None if visible is None else replica_devices(i, cfg.tp_size, visible)
            clients.append(ReplicaClient(i, replica_options(cfg, i, on_cpu), child_env(cuda)))
        for c in clients:
            c.wait_ready(timeout_s)
    except BaseException:
        for c in clients:
            c.kill()
            c.proc.wait()
        raise
    return clients
