"""The engine loop's messages: what other threads post to :class:`~specdial.engine.loop.EngineLoop`
(:class:`Submit`, :class:`Cancel`, :class:`Abort`, :class:`Shutdown`, :class:`FlushCache`,
the test hook :class:`Crash`), the validated request they carry (:class:`RequestSpec`) and the first item a
request's sink gets (:class:`Submitted`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from specdial.engine.api import LogprobOptions
from specdial.worker.sampling import SamplingParams

#: The test hook of :class:`specdial.Engine`: fixed steps per decode iteration, a sequence
#: (iteration ``i`` uses ``schedule[i % len]``) or ``(iteration, batch_size) -> steps``.
StepsSchedule = Callable[[int, int], int] | Sequence[int]


@dataclass(frozen=True)
class Submitted:
    """First sink item of an accepted request: its engine id."""

    request_id: int


@dataclass(eq=False)
class RequestSpec:
    """A validated request on its way to the loop. ``stop_token_ids`` includes the EOS ids
    unless ``ignore_eos``. ``rid`` is set by the loop when the scheduler accepts it.
    ``logprobs``: the log-probabilities it wants (None: none). ``min_tokens_ids``: the token
    ids masked while the output is shorter than ``params.min_tokens`` (EOS and stop token ids
    inside the vocabulary; empty without ``min_tokens``)."""

    prompt_ids: list[int]
    params: SamplingParams
    stop_token_ids: tuple[int, ...]
    stop: tuple[str, ...]
    sink: Callable[[Any], None]
    rid: int | None = None
    logprobs: LogprobOptions | None = None
    min_tokens_ids: tuple[int, ...] = ()
    #: the compiled grammar's ``Future`` of a structured-output request (None: unconstrained;
    #: :mod:`specdial.engine.grammar_gate`)
    grammar: Any = None
    #: its consumer went away while the grammar compiled, or the loop already ended it then
    #: (a shutdown without drain, a failed loop: :mod:`specdial.engine.inbox`); its submit
    #: after the compile is dropped (never added to the scheduler)
    cancelled: bool = False


@dataclass(frozen=True, eq=False)
class Submit:
    """Loop message: add these requests (each spec's sink gets ``Submitted`` or an error)."""

    specs: list[RequestSpec]


@dataclass(frozen=True, eq=False)
class Cancel:
    """Loop message: the consumer of this request's stream went away; abort it if live."""

    spec: RequestSpec


@dataclass(frozen=True)
class Abort:
    """Loop message: abort the request with this engine id if live."""

    request_id: int


@dataclass(frozen=True)
class Shutdown:
    """Loop message: stop; ``drain`` finishes the live requests first, else aborts them."""

    drain: bool


@dataclass(frozen=True)
class Crash:
    """Loop message (a test hook): stop the loop as if it had failed with ``message``; every
    live request fails, later submissions are refused and the engine reports the failure."""

    message: str


@dataclass(frozen=True, eq=False)
class FlushCache:
    """Loop message: run ``Scheduler.flush_cache()`` between iterations and set ``reply`` (a
    ``concurrent.futures.Future``) to its result (True: flushed; False: requests are live, as
    SGLang's ``/flush_cache`` refuses), or to a ``RuntimeError`` when the loop has failed."""

    reply: Future[bool]


#: What :meth:`EngineLoop.post` takes.
Message = Submit | Cancel | Abort | Shutdown | Crash | FlushCache
