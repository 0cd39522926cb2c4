"""Hang detection of data-parallel replica processes: the replica's heartbeat, the router's
watchdog (``watchdog_timeout``, SGLang's ``--watchdog-timeout``, default 300 s).

A replica process that dies closes its connection and the router sees it at once
(:mod:`specdial.launch.replica_client`). One that is alive but stuck (a deadlock, a device call
that never returns) closes nothing; this module is how the router learns of it:

- **the replica** (:class:`Progress`, driven by :class:`~specdial.launch.replica_main.
  ReplicaServer`) sends a :data:`~specdial.launch.replica_wire.BEAT` every
  :func:`beat_interval` seconds from its asyncio loop, carrying how long its **engine loop**
  has not turned (``Engine.loop_turns``, counted by the engine loop thread itself at each
  turn) while calls were in flight. A side thread cannot vouch for the loop: the count only
  moves when the loop does, so a loop stuck inside an iteration reads as stalled however
  healthy the rest of the process is. While no call is in flight the loop may block idle; the
  stall then reads 0.
- **the router** (:class:`Watchdog`, checked by the client's reader thread) declares the
  replica hung when a beat reports a stall over ``watchdog_timeout``, or when nothing at all
  (no beat, no chunk) has arrived for ``watchdog_timeout`` seconds (the whole process is
  stuck: stopped, swapping, its asyncio loop blocked). The client then fails the replica's
  calls in flight with an error naming it, kills the process (SGLang's watchdog crashes the
  server for the same reason: a hung device is not coming back), the router stops routing to
  it and ``/health`` names it.

SGLang's watchdog checks that the scheduler's forward count moved while a batch was running;
``loop_turns`` is that count for this engine (a turn is at most one iteration).
"""

from __future__ import annotations

import time

__all__ = ["Progress", "Watchdog", "beat_interval"]

#: Longest gap between two heartbeats (seconds); shorter timeouts beat 4 times per timeout.
MAX_BEAT_S = 1.0


def beat_interval(timeout_s: float) -> float:
    """Seconds between a replica's heartbeats for ``watchdog_timeout`` ``timeout_s``:
    ``min(1.0, timeout_s / 4)``, so a hang is seen within about 1.25 timeouts."""
    return min(MAX_BEAT_S, float(timeout_s) / 4.0)


class Progress:
    """The replica's side: how long the engine loop has not turned while busy."""

    def __init__(self, now: float | None = None) -> None:
        self.turns: int | None = None
        self.since = time.monotonic() if now is None else now

    def stalled_s(self, turns: int, busy: bool, now: float) -> float:
        """Seconds (>= 0) since the loop's turn count ``turns`` last moved, counted only while
        ``busy`` (calls in flight); 0.0 when it moved or nothing is in flight."""
        if turns != self.turns or not busy:
            self.turns, self.since = turns, now
        return max(now - self.since, 0.0)


class Watchdog:
    """The router's side for one replica: ``timeout_s`` is ``watchdog_timeout`` (seconds,
    > 0; ``ValueError`` otherwise)."""

    def __init__(self, timeout_s: float, now: float | None = None) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
                not timeout_s > 0:
            raise ValueError(f"watchdog_timeout must be a positive number of seconds, "
                             f"got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.heard = time.monotonic() if now is None else now
        self.stalled = 0.0

    @property
    def check_s(self) -> float:
        """How often the reader should look when nothing arrives (seconds)."""
        return beat_interval(self.timeout_s)

    def heard_from(self, now: float) -> None:
        """A message (any) arrived at ``now``."""
        self.heard = now

    def beat(self, stalled_s: float) -> None:
        """A heartbeat reported ``stalled_s`` seconds without an engine-loop turn."""
        self.stalled = float(stalled_s)

    def verdict(self, now: float) -> str | None:
        """Why the replica counts as hung at ``now``, or None while it does not."""
        if self.stalled > self.timeout_s:
            return (f"its engine loop made no progress for {self.stalled:.1f}s with requests in "
                    f"flight (watchdog_timeout {self.timeout_s:g}s)")
        silent = now - self.heard
        if silent > self.timeout_s:
            return (f"nothing, not even its heartbeat, arrived from it for {silent:.1f}s "
                    f"(watchdog_timeout {self.timeout_s:g}s)")
        return None
