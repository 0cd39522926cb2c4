"""Rank 0 -> worker ranks: one control message per engine iteration, over the group itself.

Rank 0 owns the Rust scheduler; each iteration it sends the plan's worker input once
(:meth:`Leader.step`), and every rank then runs the same passes. Between iterations an idle
rank 0 sends a heartbeat at least every third of ``dist_timeout`` (:meth:`Leader.heartbeat_due`)
so that waiting worker ranks never mistake a quiet engine for a dead one, and a worker rank
whose rank 0 is gone still learns it within ``dist_timeout`` (on another node, where no watch
pipe reaches it). :meth:`Leader.shutdown` ends the worker ranks' loops (:func:`follow`).

Messages travel with ``broadcast_object_list`` (pickle: a size and a byte tensor, two
collectives); they are small (the plan's per-request rows, lengths and token ids, never
per-token KV indices).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from specdial.distributed.group import TensorParallel

__all__ = ["Leader", "Message", "follow", "STEP", "HEARTBEAT", "SHUTDOWN"]

STEP, HEARTBEAT, SHUTDOWN = "step", "heartbeat", "shutdown"


@dataclass(frozen=True)
class Message:
    """``kind``: :data:`STEP` (``payload``: the iteration's worker input), :data:`HEARTBEAT`
    or :data:`SHUTDOWN` (``payload``: None)."""

    kind: str
    payload: Any = None


class Leader:
    """Rank 0's end. Raises :class:`~specdial.distributed.group.RankFailure` from any send
    when a worker rank is gone."""

    def __init__(self, tp: TensorParallel) -> None:
        if tp.rank != 0:
            raise ValueError(f"Leader runs on rank 0, this is rank {tp.rank}")
        self.tp = tp
        self._last = time.monotonic()

    def _send(self, message: Message) -> None:
        self.tp.broadcast_object(message, src=0)
        self._last = time.monotonic()

    def step(self, payload: Any) -> None:
        """Send one iteration's worker input (before running it here)."""
        self._send(Message(STEP, payload))

    def heartbeat_due(self) -> bool:
        """True when a third of ``dist_timeout`` has passed since the last message."""
        return time.monotonic() - self._last > self.tp.timeout_s / 3

    def heartbeat_now(self) -> None:
        """Make the next heartbeat due at once (after a long start-up without messages)."""
        self._last = time.monotonic() - self.tp.timeout_s

    def heartbeat(self) -> None:
        self._send(Message(HEARTBEAT))

    def shutdown(self) -> None:
        """End the worker ranks' :func:`follow` loops (they then leave the group)."""
        self._send(Message(SHUTDOWN))


def follow(tp: TensorParallel, on_step: Callable[[Any], None]) -> int:
    """A worker rank's loop: receive messages from rank 0 and run ``on_step(payload)`` for
    each step, until :data:`SHUTDOWN`. Returns the number of steps run. Raises
    :class:`~specdial.distributed.group.RankFailure` when rank 0 is gone or silent past
    ``dist_timeout``, and ``ValueError`` for an unknown message."""
    steps = 0
    while True:
        message = tp.broadcast_object(None, src=0)
        if not isinstance(message, Message):
            raise ValueError(f"worker rank {tp.rank} got {type(message).__name__}, "
                             "expected a Message")
        if message.kind == SHUTDOWN:
            return steps
        if message.kind == STEP:
            on_step(message.payload)
            steps += 1
        elif message.kind != HEARTBEAT:
            raise ValueError(f"unknown message kind {message.kind!r}")
