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

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from specdial.distributed.channel import Leader, follow
from specdial.distributed.group import TensorParallel

__all__ = ["Call", "Mirrored", "replay"]

Check = Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class Call:
    """One mirrored call: ``target.<method>(*args, **kwargs)``."""

    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class Mirrored:
    """Rank 0's proxy of ``target``: the methods named in ``methods`` are mirrored to the
    worker ranks; any other attribute is ``target``'s own (read locally, never sent).

    ``check``: method name -> function of its result (see the module docstring). Raises
    ``ValueError`` for a ``check`` on a method that is not mirrored.
    """

    def __init__(self, target: Any, leader: Leader, methods: Iterable[str],
                 check: Mapping[str, Check] | None = None) -> None:
        self._target, self._leader = target, leader
        self._methods = frozenset(methods)
        self._check = dict(check or {})
        stray = set(self._check) - self._methods
        if stray:
            raise ValueError(f"check given for methods that are not mirrored: {sorted(stray)}")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if name not in self._methods:
            return attr

        def mirrored(*args: Any, **kwargs: Any) -> Any:
            self._leader.step(Call(name, args, kwargs))
            result = attr(*args, **kwargs)
            check = self._check.get(name)
            if check is not None:
                self._leader.tp.check_same(check(result), f"the result of {name}")
            return result

        return mirrored

    @property
    def leader(self) -> Leader:
        return self._leader


def replay(tp: TensorParallel, target: Any, methods: Iterable[str],
           check: Mapping[str, Check] | None = None) -> int:
    """A worker rank's loop: apply rank 0's mirrored calls to ``target`` until shutdown.
    Returns the number of calls. Raises ``ValueError`` for a call outside ``methods``,
    :class:`~specdial.distributed.group.RankFailure` / ``RankDivergence`` as the channel and
    the checks do."""
    allowed = frozenset(methods)
    checks = dict(check or {})

    def on_step(call: Call) -> None:
        if not isinstance(call, Call) or call.method not in allowed:
            raise ValueError(f"rank {tp.rank}: unexpected call {call!r}; mirrored methods: "
                             f"{sorted(allowed)}")
        result = getattr(target, call.method)(*call.args, **call.kwargs)
        c = checks.get(call.method)
        if c is not None:
            tp.check_same(c(result), f"the result of {call.method}")

    return follow(tp, on_step)
