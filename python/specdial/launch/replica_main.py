"""A data-parallel replica process: ``python -m specdial.launch.replica_main --fd N``
(``--dp-rank I --log-level L``: its log lines, prefixed ``[dp I]``, at the router's level).

Started by the router (:class:`~specdial.launch.replica_client.ReplicaClient`) as a fresh
interpreter. It reads its options (the first message on the inherited connection, a dict of
:class:`~specdial.config.EngineConfig` fields with ``dp_size=1``), builds one
:class:`specdial.Engine` (with ``tp_size > 1`` that Engine starts its own tensor-parallel ranks
on its own rendezvous port), answers :data:`~specdial.launch.replica_wire.READY` and then serves
the router's calls on an asyncio loop: each call is the engine's own ``async_stream`` /
``async_generate``, so **tokenization, detokenization and stop strings run here**, in the
replica, beside its engine loop; the router only counts prompt tokens to route. Outgoing items
are batched (:mod:`specdial.launch.replica_wire`). The replica shuts down (aborting its
requests) when the router says so or when the router's end of the connection closes (the router
process died). SIGINT is ignored: Ctrl-C is the router's to handle. Every
:func:`~specdial.launch.replica_watch.beat_interval` seconds it sends a heartbeat saying how
long its engine loop has not turned while calls were in flight
(:mod:`specdial.launch.replica_watch`), which the router's watchdog judges.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from specdial.launch import replica_wire as w
from specdial.launch.replica_watch import Progress, beat_interval

__all__ = ["ReplicaServer", "main", "ready_info"]

#: Seconds between checks of the engine's ``failure`` (sent once to the router when set).
FAILURE_POLL_S = 0.5


def ready_info(engine: Any) -> dict[str, Any]:
    """What the router needs of a built replica: ``pid``, ``context_length``, ``tokenizer``
    (pickled with the message), ``sampling_defaults``, ``eos_token_ids``,
    ``speculative_algorithm``, ``max_running_requests``, ``vocab_size``, ``policy_cache``
    (its status), ``adaptive_config`` (its JSON, or None), ``fixed_steps`` (the scheduler's,
    None when adaptive)."""
    return {"pid": os.getpid(), "context_length": int(engine.context_length),
            "tokenizer": engine.tokenizer, "sampling_defaults": engine.sampling_defaults,
            "eos_token_ids": engine.eos_token_ids,
            "speculative_algorithm": engine.speculative_algorithm,
            "max_running_requests": engine.max_running_requests,
            "vocab_size": int(engine.vocab_size), "fixed_steps": engine.scheduler.fixed_steps,
            "policy_cache": engine.policy_cache.status,
            "adaptive_config": (None if engine.adaptive_config is None
                                else engine.adaptive_config.to_json())}


class ReplicaServer:
    """Serves the router's calls on ``engine`` over ``conn`` (see the module docstring);
    ``watchdog_timeout_s`` sets the heartbeat's period (``engine.loop_turns`` is its progress
    count)."""

    def __init__(self, engine: Any, conn: Connection, watchdog_timeout_s: float = 300.0) -> None:
        self.engine, self.conn = engine, conn
        self.beat_s = beat_interval(watchdog_timeout_s)
        self.progress = Progress()
        self.calls: dict[int, asyncio.Task] = {}
        self._outbox: list[tuple[int, str, Any]] = []
        self._send_lock = threading.Lock()

    async def serve(self) -> int:
        """Run until shut down; returns the exit status."""
        self.loop = asyncio.get_running_loop()
        self._stopped: asyncio.Future = self.loop.create_future()
        threading.Thread(target=self._read, name="specdial-replica-read", daemon=True).start()
        watch = self.loop.create_task(self._watch_failure())
        beat = self.loop.create_task(self._beat())
        drain = await self._stopped
        watch.cancel()
        beat.cancel()
        if drain is None:  # the router is gone: nobody reads the answers
            for task in list(self.calls.values()):
                task.cancel()
        await asyncio.to_thread(self.engine.shutdown, bool(drain))
        if self.calls:
            await asyncio.wait(list(self.calls.values()), timeout=30.0)
        self._flush()
        return 0

    # ----------------------------------------------------------------- incoming
    def _read(self) -> None:
        try:
            while True:
                items = w.decode(self.conn.recv_bytes())
                self.loop.call_soon_threadsafe(self._dispatch, items)
        except (EOFError, OSError):
            try:
                self.loop.call_soon_threadsafe(self._stop, None)
            except RuntimeError:  # the loop already ended
                pass

    def _stop(self, drain: bool | None) -> None:
        if not self._stopped.done():
            self._stopped.set_result(drain)

    def _dispatch(self, items: list[tuple[str, int, Any]]) -> None:
        for op, cid, payload in items:
            if op == w.STREAM:
                self.calls[cid] = self.loop.create_task(self._stream(cid, payload))
            elif op == w.GENERATE:
                self.calls[cid] = self.loop.create_task(self._generate(cid, *payload))
            elif op == w.CANCEL:
                task = self.calls.get(cid)
                if task is not None:
                    task.cancel()
            elif op == w.ABORT:
                self._guarded(cid, lambda rid=payload: self.engine.abort(rid), reply=False)
            elif op == w.STATS:
                self._guarded(cid, self.engine.stats)
            elif op == w.GRAPH_STATS:
                self._guarded(cid, self.engine.graph_stats)
            elif op == w.FLUSH:
                self._guarded(cid, self.engine.flush_cache)
            elif op == w.SHUTDOWN:
                self._stop(bool(payload))

    def _guarded(self, cid: int, fn: Any, reply: bool = True) -> None:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - the caller gets the error
            self._out(cid, w.ERROR, w.encode_error(e))
            return
        if reply:
            self._out(cid, w.RESULT, result)

    async def _stream(self, cid: int, kwargs: dict[str, Any]) -> None:
        if kwargs.pop("on_submitted", False):  # the router wants the request's id at once
            kwargs["on_submitted"] = lambda rid: self._out(cid, w.SUBMITTED, rid)
        try:
            async for chunk in self.engine.async_stream(**kwargs):
                self._out(cid, w.CHUNK, chunk)
        except asyncio.CancelledError:
            pass  # the stream's own cleanup aborted the request
        except Exception as e:  # noqa: BLE001 - RequestError, QueueFullError, ... to the caller
            self._out(cid, w.ERROR, w.encode_error(e))
        finally:
            self.calls.pop(cid, None)

    async def _generate(self, cid: int, args: tuple, kwargs: dict[str, Any]) -> None:
        result = None
        try:
            result = await self.engine.async_generate(*args, **kwargs)
            if kwargs.get("stream"):
                async for item in result:
                    self._out(cid, w.ITEM, item)
                self._out(cid, w.END, None)
            else:
                self._out(cid, w.RESULT, result)
        except asyncio.CancelledError:
            if kwargs.get("stream") and result is not None:
                await result.aclose()
        except Exception as e:  # noqa: BLE001
            self._out(cid, w.ERROR, w.encode_error(e))
        finally:
            self.calls.pop(cid, None)

    async def _watch_failure(self) -> None:
        while True:
            failure = getattr(self.engine, "failure", None)
            if failure:
                self._out(0, w.FAILURE, failure)
                return
            await asyncio.sleep(FAILURE_POLL_S)

    async def _beat(self) -> None:
        """The heartbeat: :meth:`beat` every ``beat_s``."""
        while True:
            await asyncio.sleep(self.beat_s)
            self._out(0, w.BEAT, self.beat())

    def beat(self) -> tuple[float, int]:
        """One heartbeat's payload ``(stall_s, loop_turns)``: seconds the engine loop has not
        turned while calls were in flight (0.0 else), and its turn count
        (``Engine.loop_turns``; the router's ``ReplicaClient.loop_turns``)."""
        turns = int(self.engine.loop_turns)
        return self.progress.stalled_s(turns, bool(self.calls), time.monotonic()), turns

    def stall(self) -> float:
        """Seconds the engine loop has not turned while calls were in flight (0.0 else)."""
        return self.beat()[0]

    # ----------------------------------------------------------------- outgoing
    def _out(self, cid: int, kind: str, payload: Any) -> None:
        """Queue one item; the first item of a batch schedules the flush after the callbacks
        and task steps already ready (so one engine iteration's chunks go in one message)."""
        if not self._outbox:
            self.loop.call_soon(self._flush)
        self._outbox.append((cid, kind, payload))

    def _flush(self) -> None:
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        try:
            with self._send_lock:
                self.conn.send_bytes(w.encode(items))
        except OSError:
            self._stop(None)  # the router is gone


def _options(conn: Connection) -> dict[str, Any]:
    """The first message (:mod:`specdial.launch.replica_wire`): the router's ``sys.path``
    entries this interpreter lacks are appended, then the options are decoded. Raises
    ``ValueError`` naming ``steps_schedule`` when they cannot be (its function could not be
    imported here)."""
    sys_path, blob = w.decode(conn.recv_bytes())
    sys.path.extend(p for p in sys_path if p not in sys.path)
    try:
        return w.decode(blob)
    except Exception as e:  # noqa: BLE001 - only a steps_schedule function can fail here
        raise ValueError(f"steps_schedule: the replica process could not import the function "
                         f"(pickled by module and name): {type(e).__name__}: {e}") from e


def _build(conn: Connection) -> tuple[Any, float]:
    """The replica's Engine and its ``watchdog_timeout``."""
    from specdial.engine import Engine

    options = _options(conn)
    return Engine(**options), float(options.get("watchdog_timeout", 300.0))


def main(argv: list[str] | None = None) -> int:
    """Build the replica's engine and serve (module docstring); returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m specdial.launch.replica_main")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--log-level", type=int, default=logging.WARNING)
    ns = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=ns.log_level, format=f"[dp {ns.dp_rank}] %(asctime)s "
                        "%(levelname)s %(name)s: %(message)s")
    conn = Connection(ns.fd)
    try:
        engine, watchdog_timeout_s = _build(conn)
        conn.send_bytes(w.encode([(0, w.READY, ready_info(engine))]))
        logging.getLogger("specdial.launch").info("data-parallel replica %d ready (pid %d)",
                                                  ns.dp_rank, os.getpid())
    except (EOFError, OSError):
        return 1  # the router is gone
    except BaseException as e:  # noqa: BLE001 - reported to the router, which raises it
        traceback.print_exc()
        try:
            conn.send_bytes(w.encode([(0, w.ERROR, w.encode_error(e))]))
        except OSError:
            pass
        return 1
    return asyncio.run(ReplicaServer(engine, conn, watchdog_timeout_s).serve())


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as specdial.launch.rank: no interpreter teardown under gloo's threads
