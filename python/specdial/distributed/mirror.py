"""Every rank runs the same passes: rank 0's calls on its worker, replayed on the other ranks.

Rank 0 wraps its worker in :class:`Mirrored`; each mirrored method call first sends
``(method, args, kwargs)`` over the control channel (:class:`~specdial.distributed.channel.
Leader`, one message per call) and then runs locally; worker ranks run :func:`replay`, which
applies the same calls, in the same order, to their own worker (same construction, their own
shards). Arguments must pickle: the worker input is plain data built from the Rust plan (the
decision, made once on rank 0, is never recomputed elsewhere). ``check``: per method, a
function of the call's result giving an integer tensor that must be equal on every rank (e.g.
the emitted tokens and accepted counts); after each such call all ranks compare it
(:meth:`~specdial.distributed.group.TensorParallel.check_same`), so a divergence stops the
engine with :class:`~specdial.distributed.group.RankDivergence` instead of serving garbage.
Worker ranks call the same ``check`` on their results, so both sides take part in the
collective.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from specdial.distributed.channel import Leader, follow
from specdial.distributed.group import RankDivergence, RankFailure, TensorParallel

__all__ = ["Call", "Mirrored", "replay"]

Check = Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class Call:
    """One mirrored call: ``target.<method>(*args, **kwargs)``."""

    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


Transform = Callable[[str, tuple, dict], tuple[tuple, dict]]


class Mirrored:
    """Rank 0's proxy of ``target``: the methods named in ``methods`` are mirrored to the
    worker ranks; any other attribute is ``target``'s own (read locally, never sent).

    - ``check``: method name -> function of its result (see the module docstring).
    - ``wire``: ``(method, args, kwargs) -> (args, kwargs)`` as sent (e.g. a local-only
      object replaced by a placeholder the worker ranks fill in, see :func:`replay`); the
      local call gets the arguments as given.
    - ``lock``: held for the whole call (send, local run, check), so another thread's messages
      (heartbeats) never interleave with a call's collectives.

    :attr:`failure`: the message of the first :class:`~specdial.distributed.group.RankFailure`
    or ``RankDivergence`` a call raised (None while healthy); the call re-raises it. Once
    failed, a mirrored call raises :class:`RankFailure` at once without touching the group,
    except the methods in ``local_after_failure``, which then run locally only (bookkeeping
    such as releasing a finished request's row, so that the caller can still fail its
    requests cleanly). Raises ``ValueError`` for a ``check`` on a method that is not mirrored.
    """

    def __init__(self, target: Any, leader: Leader, methods: Iterable[str],
                 check: Mapping[str, Check] | None = None, *, wire: Transform | None = None,
                 lock: threading.Lock | None = None,
                 local_after_failure: Iterable[str] = ()) -> None:
        self._local_after_failure = frozenset(local_after_failure)
        self._target, self._leader = target, leader
        self._methods = frozenset(methods)
        self._check = dict(check or {})
        self._wire = wire
        self._lock = lock or threading.Lock()
        self.failure: str | None = None
        stray = set(self._check) - self._methods
        if stray:
            raise ValueError(f"check given for methods that are not mirrored: {sorted(stray)}")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if name not in self._methods:
            return attr

        def mirrored(*args: Any, **kwargs: Any) -> Any:
            if self.failure is not None:
                if name in self._local_after_failure:
                    return attr(*args, **kwargs)
                raise RankFailure(self.failure)
            sent = (args, kwargs) if self._wire is None else self._wire(name, args, kwargs)
            with self._lock:
                try:
                    self._leader.step(Call(name, *sent))
                    result = attr(*args, **kwargs)
                    check = self._check.get(name)
                    if check is not None:
                        self._leader.tp.check_same(check(result), f"the result of {name}")
                except (RankFailure, RankDivergence) as e:
                    self.failure = self.failure or str(e)
                    raise
            return result

        return mirrored

    @property
    def leader(self) -> Leader:
        return self._leader

    @property
    def lock(self) -> threading.Lock:
        """The lock every mirrored call holds (take it to send anything else)."""
        return self._lock


def replay(tp: TensorParallel, target: Any, methods: Iterable[str],
           check: Mapping[str, Check] | None = None, *,
           local: Transform | None = None) -> int:
    """A worker rank's loop: apply rank 0's mirrored calls to ``target`` until shutdown.
    ``local``: ``(method, args, kwargs) -> (args, kwargs)`` applied to each received call
    (the inverse of :class:`Mirrored`'s ``wire``). Returns the number of calls. Raises
    ``ValueError`` for a call outside ``methods``,
    :class:`~specdial.distributed.group.RankFailure` / ``RankDivergence`` as the channel and
    the checks do."""
    allowed = frozenset(methods)
    checks = dict(check or {})

    def on_step(call: Call) -> None:
        if not isinstance(call, Call) or call.method not in allowed:
            raise ValueError(f"rank {tp.rank}: unexpected call {call!r}; mirrored methods: "
                             f"{sorted(allowed)}")
        args, kwargs = ((call.args, call.kwargs) if local is None
                        else local(call.method, call.args, call.kwargs))
        result = getattr(target, call.method)(*args, **kwargs)
        c = checks.get(call.method)
        if c is not None:
            tp.check_same(c(result), f"the result of {call.method}")

    return follow(tp, on_step)
