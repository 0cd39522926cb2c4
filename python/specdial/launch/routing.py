"""Which data-parallel replica takes a request: the router's bookkeeping and strategies.

:class:`Router` keeps, per replica, the requests routed there and not yet ended and their
*outstanding work*: per request, its prompt tokens plus its ``max_new_tokens`` budget (when the
request gives one), counted when it is routed and released when it ends. That is the router's
estimate of the replica's queued plus running tokens from the prompt lengths it sees (it never
asks the replicas, so a choice costs no round trip). Strategies (``load_balance_method``, the
names of SGLang's ``--load-balance-method``):

- ``minimum_tokens`` (default): the replica with the least outstanding work;
- ``shortest_queue``: the replica with the fewest requests in flight;
- ``round_robin``: replicas in turn.

Ties go round-robin (a rotating start), so a burst of equal requests spreads evenly. Replicas
marked failed (:meth:`Router.mark_failed`) are never chosen; when every replica has failed,
:meth:`Router.route` raises :class:`NoReplicaError`. Thread-safe.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["METHODS", "NoReplicaError", "Router", "prompt_tokens", "request_work"]

#: The strategies (see the module docstring).
METHODS = ("minimum_tokens", "shortest_queue", "round_robin")


class NoReplicaError(RuntimeError):
    """Every replica has failed: nothing can take a request."""


def prompt_tokens(tokenizer: Any, prompt: Any, input_ids: Any) -> int:
    """Tokens of one request's prompt as the router counts them: ``len(input_ids)`` when
    given; else the tokenizer's encoding of a ``str`` prompt (an HF tokenizer's ``encode`` or
    a ``tokenizers.Tokenizer``'s); without a tokenizer (or for another prompt type) a
    characters / 4 estimate. Never raises: an invalid request is the replica's to reject."""
    if isinstance(input_ids, list):
        return len(input_ids)
    if not isinstance(prompt, str):
        return 1
    if tokenizer is not None:
        try:
            ids = tokenizer.encode(prompt)
            return len(getattr(ids, "ids", ids))
        except Exception:  # noqa: BLE001 - only an estimate; the replica reports the error
            pass
    return len(prompt) // 4 + 1


def request_work(tokens: int, sampling_params: Any) -> int:
    """A request's outstanding work: ``tokens`` (its prompt) plus its ``max_new_tokens`` when
    ``sampling_params`` is a dict giving an int (the budget it may still generate)."""
    budget = sampling_params.get("max_new_tokens") if isinstance(sampling_params, dict) else None
    extra = budget if isinstance(budget, int) and not isinstance(budget, bool) else 0
    return max(int(tokens), 0) + max(extra, 0)


class Router:
    """Per-replica load of ``size`` replicas and the choice of ``method`` (one of
    :data:`METHODS`; ``ValueError`` naming ``load_balance_method`` otherwise)."""

    def __init__(self, size: int, method: str = "minimum_tokens") -> None:
        if method not in METHODS:
            raise ValueError(f"load_balance_method must be one of {', '.join(map(repr, METHODS))};"
                             f" got {method!r}")
        if size < 1:
            raise ValueError(f"a router needs at least one replica (dp_size >= 1), got {size}")
        self.size, self.method = size, method
        self.inflight = [0] * size
        self.work = [0] * size
        self.failed: dict[int, str] = {}
        self._next = itertools.count()
        self._lock = threading.Lock()

    def route(self, works: Sequence[int]) -> list[int]:
        """Replicas for new requests of outstanding work ``works`` (one each, in order; each
        choice counts at once, so a batch spreads). Raises :class:`NoReplicaError` when every
        replica has failed."""
        out = []
        with self._lock:
            alive = [i for i in range(self.size) if i not in self.failed]
            if not alive:
                raise NoReplicaError("every data-parallel replica has failed: "
                                     + "; ".join(self.failed.values()))
            for w in works:
                start = next(self._next)
                order = [alive[(start + k) % len(alive)] for k in range(len(alive))]
                if self.method == "minimum_tokens":
                    i = min(order, key=lambda j: (self.work[j], self.inflight[j]))
                elif self.method == "shortest_queue":
                    i = min(order, key=lambda j: self.inflight[j])
                else:
                    i = order[0]
                self.inflight[i] += 1
                self.work[i] += int(w)
                out.append(i)
        return out

    def done(self, i: int, works: Sequence[int]) -> None:
        """Requests of work ``works`` routed to replica ``i`` ended."""
        with self._lock:
            self.inflight[i] -= len(works)
            self.work[i] -= sum(int(w) for w in works)

    def mark_failed(self, i: int, why: str) -> None:
        """Replica ``i`` failed (``why`` names it): never chosen again."""
        with self._lock:
            self.failed.setdefault(i, why)

    def snapshot(self) -> tuple[list[int], list[int]]:
        """``(requests in flight, outstanding work)`` per replica."""
        with self._lock:
            return list(self.inflight), list(self.work)
