"""Start-up barriers and heartbeats of a tensor-parallel group, through rank 0's TCP store.

**Start-up.** Ranks load their models at different speeds (a fresh interpreter, a busy
machine, another node): a collective issued while a peer is still loading would wait for it
under ``dist_timeout`` and take a slow rank for a dead one. So no collective runs while ranks
load: each rank waits at :func:`startup_barrier` (a key per rank in the store, polled) after
loading and again after building its engine, under the generous ``startup_timeout_s``
(:class:`~specdial.distributed.group.DistConfig`), and the engine takes requests only after the
last barrier. The group's collectives keep ``dist_timeout`` throughout (gloo and NCCL fix a
group's timeout at its creation; the store's own timeout is the start-up one). Of the options
(a barrier on a second group with a long timeout, gloo's ``monitored_barrier``, a long
collective timeout plus a liveness check), a store barrier was chosen because it needs no
second communicator, works the same for gloo and NCCL, and can be polled: the wait stops as
soon as a rank is known to be gone, rather than at ``startup_timeout_s``: a local rank's process
exited (``peers_failed``, rank 0's process handles), a watched rank's heartbeat stopped
(``liveness``: a rank on another node, which no process handle reaches) or rank 0's store is
gone. A rank still loading is not taken for a dead one: its heartbeat runs in its own thread.

**Liveness, both ways** (:class:`Heartbeat`): every rank bumps its counter in the store every
``dist_timeout / 6`` seconds from a daemon thread (its own store connection) and watches its
peers' counters: rank 0 watches every worker rank, a worker rank watches rank 0. A watched
counter that does not move for ``dist_timeout`` is a failure naming the rank; so is a store
that stops answering (rank 0's process, which serves it, is gone). This holds from the start,
model loading included: the beats come from their own thread, beside the loading, so a rank
that dies while loading is noticed within ``dist_timeout`` (issue 25; the heartbeat used to
allow ``startup_timeout_s`` of silence until the engine was built, so a rank on another node
that died during start-up was found only at the 600 s start-up timeout). This reaches ranks on
other nodes, where no process handle or watch pipe does. Rank 0 then reports the failure
(``/health`` answers 503 naming the rank); a worker rank exits (``on_failure``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from specdial.distributed.group import RankFailure, TensorParallel, parse_addr

__all__ = ["Heartbeat", "startup_barrier"]

_POLL_S = 0.05


def startup_barrier(tp: TensorParallel, name: str,
                    peers_failed: Callable[[], str | None] | None = None,
                    liveness: "Heartbeat | None" = None) -> None:
    """Wait until every rank of ``tp`` reached the barrier ``name`` (each rank calls it once
    per name). Waits at most ``tp.config.startup_s``; ``peers_failed`` (rank 0: its local
    ranks' exits) and ``liveness.failure`` (this rank's :class:`Heartbeat`: a watched rank
    stopped beating, also on another node) are polled every 50 ms. Raises
    :class:`RankFailure` naming the ranks still missing at the deadline, a rank that exited or
    stopped its heartbeat, or an unreachable store (rank 0 gone). A no-op for a group of one
    or one built without a store."""
    if tp.size == 1 or tp.store is None or tp.config is None:
        return
    store, limit = tp.store, tp.config.startup_s
    keys = [f"specdial/barrier/{name}/{r}" for r in range(tp.size)]
    started = time.monotonic()
    try:
        store.set(keys[tp.rank], "1")
        while not store.check(keys):
            why = peers_failed() if peers_failed is not None else None
            if why is None and liveness is not None:
                why = liveness.failure
            if why is not None:
                raise RankFailure(f"rank {tp.rank}: start-up barrier {name!r} failed: {why}")
            if time.monotonic() - started > limit:
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                raise RankFailure(f"rank {tp.rank}: ranks {missing} did not reach start-up "
                                  f"barrier {name!r} within {limit:g}s (startup_timeout_s)")
            time.sleep(_POLL_S)
    except RankFailure:
        raise
    except Exception as e:  # noqa: BLE001 - the store is rank 0's: it is gone
        raise RankFailure(f"rank {tp.rank}: start-up barrier {name!r} failed: rank 0's store "
                          f"does not answer ({type(e).__name__}: {e}); rank 0 is gone") from e


class Heartbeat:
    """This rank's heartbeat and its watch of its peers (see the module docstring).

    ``tp``: a group joined by :func:`~specdial.distributed.group.init_group` (with a store);
    ``on_failure(message)``: called once, from the heartbeat thread, when a watched rank
    stops beating (silent for ``dist_timeout``) or the store is gone. :attr:`failure` holds
    the message (None while well). Start with :meth:`start`; :meth:`stop` ends it
    (idempotent).
    """

    def __init__(self, tp: TensorParallel,
                 on_failure: Callable[[str], None] | None = None) -> None:
        if tp.config is None:
            raise ValueError("Heartbeat needs a group joined with init_group (it has no config)")
        self.tp, self.on_failure = tp, on_failure
        self.failure: str | None = None
        self.interval_s = tp.timeout_s / 6
        self._allowed_s = tp.timeout_s
        self._watched = [r for r in range(tp.size) if r != tp.rank] if tp.rank == 0 else [0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specdial-tp-liveness",
                                        daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(self.interval_s + 5.0)

    def _connect(self) -> Any:
        assert self.tp.config is not None
        host, port = parse_addr(self.tp.config.init_addr)
        return dist.TCPStore(host, port, None, False, timedelta(seconds=self.tp.timeout_s))

    def _fail(self, message: str) -> None:
        if self.failure is None and not self._stop.is_set():
            self.failure = message
            if self.on_failure is not None:
                self.on_failure(message)

    def _run(self) -> None:
        try:
            store = self._connect()
        except Exception as e:  # noqa: BLE001
            self._fail(f"rank {self.tp.rank} cannot reach rank 0's store "
                       f"({type(e).__name__}: {e}); rank 0 is gone")
            return
        seen = {r: (-1, time.monotonic()) for r in self._watched}
        mine = f"specdial/beat/{self.tp.rank}"
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                store.add(mine, 1)
                counts = {r: store.add(f"specdial/beat/{r}", 0) for r in self._watched}
            except Exception as e:  # noqa: BLE001 - rank 0 serves the store
                if not self._stop.is_set():
                    self._fail(f"rank 0's store stopped answering rank {self.tp.rank} "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                               "); rank 0 is gone")
                return
            for r, count in counts.items():
                last, since = seen[r]
                if count != last:
                    seen[r] = (count, now)
                elif now - since > self._allowed_s:
                    who = "rank 0" if r == 0 else f"worker rank {r}"
                    self._fail(f"{who} stopped its heartbeat: silent for {now - since:.1f}s "
                               f"(allowed {self._allowed_s:g}s); it died or hangs")
                    return
            self._stop.wait(self.interval_s)
