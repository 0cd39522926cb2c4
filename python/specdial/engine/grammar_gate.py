"""Structured outputs in the engine: a request's grammar compiled before it is queued.

- :func:`start_compile` (called by :func:`~specdial.engine.requests.make_spec`): the request's
  :class:`~specdial.worker.grammar_spec.StructuredSpec` goes to its tokenizer's
  :class:`~specdial.worker.grammar.GrammarBackend` (compile cache and thread pool); the spec
  carries the ``Future``.
- :func:`hold_for_grammar` (the loop's submit): a request whose grammar is still compiling is
  not given to the scheduler; it is posted to the loop again when the compile is done (so it
  waits before the queue, never in a batch, and neither the event loop nor the engine loop
  compiles). A grammar that does not compile ends the request with a
  :class:`~specdial.engine.api.RequestError` naming the API field (a 400 at the server).
- :func:`matcher_of` / :func:`attach_grammar`: the request's matcher (made when it is
  admitted, kept across iterations and preemptions) and a batch's
  :class:`~specdial.worker.grammar_masks.BatchGrammar`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from specdial.engine.api import RequestError
from specdial.engine.ends import failed
from specdial.engine.messages import RequestSpec, Submit
from specdial.worker.batch_sampling import BatchSampling
from specdial.worker.grammar import GrammarError, backend_for, dead_end, new_matcher
from specdial.worker.grammar_masks import BatchGrammar
from specdial.worker.grammar_spec import StructuredSpec

__all__ = ["attach_grammar", "grammar_end_error", "hold_for_grammar", "matcher_of",
           "start_compile"]


def start_compile(structured: StructuredSpec | None, tokenizer: Any, vocab_size: int,
                  eos_token_ids: Any, label: str = "") -> Any:
    """The ``Future`` of ``structured``'s compiled grammar (None without a constraint).
    Raises :class:`RequestError` naming the field without a tokenizer (the grammar is over
    token strings)."""
    if structured is None:
        return None
    if tokenizer is None:
        raise RequestError(f"{label}{structured.field}: structured outputs need a tokenizer; "
                           "this engine has none", structured.field)
    return backend_for(tokenizer, vocab_size, eos_token_ids).submit(structured)


def hold_for_grammar(spec: RequestSpec, post: Callable[[Any], None],
                     out: Callable[[Any, Any], None],
                     on_hold: Callable[[RequestSpec], None] | None = None) -> bool:
    """True when the loop must not add ``spec`` now: its grammar is compiling (it is posted
    again, as a :class:`Submit`, when done), was cancelled meanwhile (dropped), or failed (its
    sink got the error). ``on_hold(spec)`` is called when it is held for its compile, before the
    callback that posts it again is attached (the loop's record of held requests,
    :mod:`specdial.engine.inbox`, which answers them at shutdown). Every engine serves
    constrained requests: chains (:mod:`specdial.worker.grammar_masks`), draft trees (every
    node masked with its path's state, :mod:`specdial.worker.grammar_tree`) and
    ``tp_size > 1`` (matchers on rank 0, masks broadcast)."""
    fut = spec.grammar
    if fut is None:
        return False
    if spec.cancelled:  # its consumer left while the grammar compiled: nobody to answer
        return True
    if not fut.done():
        if on_hold is not None:
            on_hold(spec)

        def again(_: Any) -> None:
            try:
                post(Submit([spec]))
            except Exception as e:  # noqa: BLE001 - the engine stopped meanwhile
                spec.sink(RuntimeError(str(e)))
        fut.add_done_callback(again)
        return True
    err = fut.exception()
    if err is None:
        return False
    field = err.field if isinstance(err, GrammarError) else spec.params.structured.field
    out(spec.sink, RequestError(str(err), field))
    return True


def matcher_of(spec: RequestSpec) -> Any:
    """A fresh matcher of ``spec``'s compiled grammar (None without one); the grammar must
    be ready (:func:`hold_for_grammar` returned False)."""
    return None if spec.grammar is None else new_matcher(spec.grammar.result())


def attach_grammar(sampling: BatchSampling | None, matchers: Sequence[Any], worker: Any
                   ) -> BatchSampling | None:
    """Set ``sampling.grammar`` from the rows' matchers (None entries: unconstrained rows;
    the vocabulary and ``grammar_share`` are ``worker``'s, read only when some row has a
    matcher). With a tensor-parallel engine (rank 0's worker wrapper has a ``grammar_share``)
    the matchers stay here, on rank 0, and each mask they make is broadcast to the other ranks
    (:class:`~specdial.worker.grammar_masks.MirroredGrammar`)."""
    if sampling is not None:
        sampling.grammar = None if all(m is None for m in matchers) else BatchGrammar(
            matchers, worker.target.config.vocab_size, sampling.temperature.device,
            worker.grammar_share)
    return sampling


def grammar_end_error(spec: RequestSpec, matcher: Any, fin: Any, matched: str | None,
                      vocab_size: int) -> dict[str, Any] | None:
    """The ``failed`` finish reason (status 400, naming the constraint's field) of a request
    that a stop token ended at a dead end of its grammar (``matcher`` allows no token and has
    not reached its end: the mask fell back to the stop tokens,
    :func:`~specdial.worker.grammar_masks.fill_row`), else None. ``fin``: the scheduler's
    ``FinishedRequest``; ``matched``: the stop string the text matched, if any (then the
    request ended on its own terms). With ``ignore_eos`` the stop tokens do not end it: it
    ends by length, with stop tokens after the dead end, and fails the same way. One bitmask
    fill per finished constrained request."""
    if matcher is None or matched is not None:
        return None
    by_stop = fin.reason == "stop" and fin.stop_token_id is not None
    if not (by_stop or (fin.reason == "length" and spec.params.ignore_eos)):
        return None
    if not dead_end(matcher, vocab_size):
        return None
    field = spec.params.structured.field
    return failed(f"{field}: the output constraint allows no token after "
                  f"{int(fin.output_len) - 1} output tokens (its grammar has no continuation "
                  "there); output ended", 400)
