"""Handing stream items from the engine loop's thread to asyncio consumers, coalesced.

The engine loop delivers a request's items (chunks, ``Submitted``, errors) from its own thread,
in a burst at the end of each iteration (one call per request: :mod:`specdial.engine.loop`'s
``_flush``). Waking an event loop from another thread costs a ``call_soon_threadsafe``: a
write to the loop's self-pipe (a system call), the thread hand-over and the GIL back. One per
request per iteration is a per-token cost that does not shrink with the batch (issue 32).

A :class:`Courier` (one per event loop, :func:`courier_for`) batches that work the way vLLM's
``RequestOutputCollector`` and its output handler do: the engine thread appends a request's
items to its :class:`Box` under the courier's lock and marks the box due; the engine loop
delivers an iteration's items inside :func:`burst`, at whose end each event loop delivered to
gets one wake (one ``call_soon_threadsafe`` per event loop per iteration, not per request). The wake resolves the waiter of each due box; a
consumer (:meth:`Courier.take`) then gets **every item that arrived since its last take, in
order, as one list**, so a consumer that fell behind catches up in one step (one event-loop
wake and, in the HTTP server, one write per request; :func:`specdial.server.runs.Run.batches`)
instead of one per decode iteration. Nothing is dropped or merged here: the items are the
engine's, in its order.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Box", "Courier", "burst", "courier_for"]

_couriers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Courier] = \
    weakref.WeakKeyDictionary()
_couriers_lock = threading.Lock()
_local = threading.local()  # .held: the couriers delivered to in this thread's burst


class Box:
    """One consumer's items not taken yet (``items``, guarded by its courier's lock) and its
    waiter (a future of the courier's loop while the consumer waits, else None)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.waiter: asyncio.Future[None] | None = None


class Courier:
    """The coalesced hand-over to one event loop (module docstring). :meth:`deliver` is called
    from any thread; :meth:`take` on the loop. Holds the loop weakly: once it is gone,
    :meth:`deliver` returns False."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)
        self._lock = threading.Lock()
        self._due: list[Box] = []
        self._scheduled = False

    def deliver(self, box: Box, items: list[Any]) -> bool:
        """Append ``items`` to ``box`` and wake its consumer: inside a :func:`burst` on this
        thread the wake waits for the burst's end (one for all the burst's deliveries to
        this loop), else the first delivery since the loop last ran the courier schedules it.
        Returns False when the event loop is closed or gone (nobody will take them)."""
        loop = self._loop()
        if loop is None or loop.is_closed():
            return False
        with self._lock:
            box.items.extend(items)
            self._due.append(box)
        held = getattr(_local, "held", None)
        if held is not None:
            held[self] = None
            return True
        return self._schedule()

    def _schedule(self) -> bool:
        """Schedule one :meth:`_wake` unless one is pending; False when the loop is closed."""
        with self._lock:
            if self._scheduled:
                return True
            self._scheduled = True
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("event loop gone")
            loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # closed: the next delivery tries (and fails) again
            with self._lock:
                self._scheduled = False
            return False
        return True

    def _wake(self) -> None:
        with self._lock:
            due, self._due = self._due, []
            self._scheduled = False
        for box in due:
            w = box.waiter
            if w is not None and not w.done():
                w.set_result(None)

    async def take(self, box: Box) -> list[Any]:
        """Every item delivered to ``box`` since the last take, in delivery order (at least
        one: waits while there is none). Cancellation while waiting raises
        ``CancelledError`` and leaves the items in the box."""
        while True:
            with self._lock:
                if box.items:
                    items, box.items = box.items, []
                    return items
            loop = self._loop()
            if loop is None:
                raise RuntimeError("the courier's event loop is gone")
            # no other code runs on this loop between the check above and the await below,
            # so the wake that a delivery after the check schedules finds this waiter
            box.waiter = loop.create_future()
            try:
                await box.waiter
            finally:
                box.waiter = None


@contextmanager
def burst() -> Iterator[None]:
    """Hold the wakes of the deliveries this thread makes inside the block; at its end wake
    each event loop delivered to once (the engine loop wraps its per-iteration delivery in
    it). Without it, each wake is a system call that lets the event loop's thread take the
    GIL and run before the next delivery, so a burst to N streams woke the loop N times.
    Nested blocks join the outer one."""
    if getattr(_local, "held", None) is not None:
        yield
        return
    held: dict[Courier, None] = {}
    _local.held = held
    try:
        yield
    finally:
        _local.held = None
        for courier in held:
            courier._schedule()


def courier_for(loop: asyncio.AbstractEventLoop) -> Courier:
    """The :class:`Courier` of ``loop`` (made on first use; kept while the loop lives)."""
    with _couriers_lock:
        c = _couriers.get(loop)
        if c is None:
            c = _couriers[loop] = Courier(loop)
        return c
