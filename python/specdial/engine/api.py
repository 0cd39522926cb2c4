"""The serving contract between :class:`specdial.Engine` and its front ends (server, CLI).

This module holds only plain types, no torch, so that the HTTP server, the CLI and test doubles
can import it cheaply. The Engine implements the contract; the server (``specdial.server``)
consumes it:

- ``engine.async_stream(prompt=None, *, input_ids=None, sampling_params=None, stop=None,
  logprobs=None, whole=False)`` -> ``AsyncIterator[StreamChunk]`` (``logprobs``: a
  :class:`LogprobOptions` fills the chunks' logprob fields; ``whole=True``: the consumer needs
  the output only at the request's end (a non-streaming HTTP response), so the same chunks may
  arrive together when it finishes, each with :attr:`StreamChunk.emitted_s` set, instead of
  one wake-up of the consumer per decode iteration; callers pass either only when they want
  it, so engines without them keep working for everything else; the same for
  ``on_submitted``, a callable :class:`specdial.Engine` calls with the request's id once it
  accepted it, so that a ``whole`` consumer can ``abort`` it by id before any chunk came):
  the request is submitted on the first iteration;
  :class:`RequestError` or :class:`QueueFullError` is raised then, before any chunk. If the
  consumer stops iterating (``aclose()``, or cancellation of the task awaiting the next chunk,
  e.g. a disconnected HTTP client) the request is aborted and everything it held is freed.
- ``engine.stream(...)``: the same as a synchronous iterator.
- ``engine.generate(prompt, sampling_params, input_ids)``: the offline API (SGLang style dicts).
- ``engine.abort(request_id)``, ``engine.stats() -> EngineStats``, ``engine.tokenizer`` (an HF
  tokenizer, a ``tokenizers.Tokenizer`` or None), ``engine.context_length`` (tokens, prompt plus
  completion), ``engine.shutdown(drain=True)`` (stop admitting; ``drain=True`` finishes the
  running requests, ``False`` aborts them).
- ``sampling_params`` keys: the fields of :class:`specdial.worker.sampling.SamplingParams`
  (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``,
  ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``min_tokens``,
  ``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``, ``skip_special_tokens``,
  ``seed``), each exact under speculation. An unset ``temperature`` is 1.0 (SGLang's
  ``sgl.Engine``; :mod:`specdial.engine.sampling_defaults`); ``0`` is greedy. A ``seed``
  (OpenAI's field) makes a sampling request's tokens the ones plain decoding samples with that
  seed: they depend only on its prompt, seed and sampling params, not on the other requests it
  is batched with, the steps schedule, the drafter or whether speculation is on. Logits are not
  bitwise batch-invariant, so a near-tie draw can very rarely flip (see :class:`specdial.Engine`).

:class:`EngineProtocol` spells the same contract as a ``typing.Protocol`` for type checkers.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Protocol

from specdial import _core

__all__ = ["EngineProtocol", "EngineStats", "LogprobOptions", "QueueFullError", "RequestError",
           "StreamChunk", "TopLogprobs", "stream_takes"]

#: Per token: the ``top_n`` most likely ``(token_id, logprob)`` pairs, most likely first.
TopLogprobs = list[tuple[int, float]]


@dataclass(frozen=True)
class LogprobOptions:
    """What log-probabilities a request wants (SGLang's ``return_logprob``,
    ``top_logprobs_num``, ``logprob_start_len``; OpenAI's ``logprobs`` / ``top_logprobs`` /
    ``echo``).

    Values are the target model's ``log_softmax`` of its raw logits, before temperature, top-k
    and top-p (vLLM's default ``raw_logprobs``), natural log; under a grammar (structured
    outputs) those of the grammar-masked target distribution, as vLLM reports them (fewer
    alternatives where the grammar allows fewer tokens; :mod:`specdial.worker.logprobs`).
    ``top_n``: alternatives per token (0..20). ``prompt_start``: None for none, else prompt logprobs for prompt positions
    ``prompt_start..P-1`` (position 0 has no logprob: reported as None).
    """

    top_n: int = 0
    prompt_start: int | None = None


@dataclass
class StreamChunk:
    """One increment of a streamed request.

    - ``request_id``: the engine's id of the request (for :meth:`EngineProtocol.abort`).
    - ``text``: newly detokenized text since the previous chunk (``""`` if none; stop strings
      already matched are cut, never sent).
    - ``token_ids``: tokens emitted since the previous chunk.
    - ``finished``: True on the last chunk of the request, and only there.
    - ``finish_reason``: None until finished; then SGLang style ``{"type": "length", "length": n}``,
      ``{"type": "stop", "matched": token_id_or_str}``, ``{"type": "abort", "message": str,
      "cause": "client" | "shutdown"}`` (aborted by its client, or ended by a shutdown), or
      ``{"type": "error", "message": str, "status_code": int}`` (the engine failed it; the
      message names the cause): :mod:`specdial.engine.ends`.
    - ``meta_info``: cumulative so far: ``prompt_tokens``, ``completion_tokens``,
      ``spec_verify_ct``, ``spec_accept_length``, ``spec_steps_histogram``, and
      ``queue_time_s`` (seconds from submission to the first prefill) once scheduled.
    - With :class:`LogprobOptions` only (else None): ``logprobs`` (one float per
      ``token_ids`` entry), ``top_logprobs`` (one :data:`TopLogprobs` per token); on the first
      chunk that carries tokens, ``prompt_logprobs`` (positions ``prompt_start..P-1``, None
      at position 0) and ``prompt_top_logprobs`` (None at position 0), when asked for.
    - ``emitted_s``: ``time.perf_counter()`` seconds when the engine loop emitted the chunk,
      set where its delivery is deferred (``async_stream(whole=True)``, ``generate``) so that
      latencies are still measured at emission; None when it is delivered as made (its
      arrival is its time). On Linux ``perf_counter`` reads ``CLOCK_MONOTONIC``, one clock for
      every process of the host, so a replica process's stamp compares with the router's.
    """

    request_id: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: dict[str, Any] | None = None
    meta_info: dict[str, Any] = field(default_factory=dict)
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs | None] | None = None
    emitted_s: float | None = None


# Raised at submission when the engine's waiting queue is full (``max_queued_requests``); the
# server answers HTTP 503. Nothing was admitted. It is the Rust scheduler's own exception.
QueueFullError = _core.QueueFullError


class RequestError(ValueError):
    """An invalid request (prompt longer than the context, a bad sampling value, ...); the
    server answers HTTP 400. The message names the offending field; ``param`` optionally names
    it programmatically with the engine's names (a ``sampling_params`` key, ``"prompt"``,
    ``"input_ids"`` or ``"stop"``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class EngineStats:
    """A snapshot of the engine for ``/metrics`` and the periodic log line.

    Gauges (current values): ``running`` and ``queued`` requests, ``kv_pages_used`` /
    ``kv_pages_total`` (KV cache pages; used: held by requests, a shared page once; the pages
    only the prefix cache holds are evictable and counted in ``cached_pages`` alone), ``steps_per_slot`` (slot lower batch-size bound ->
    current ``speculative_num_steps``). Cumulative counters since the engine started:
    ``num_drafts`` (request-verifies that had drafts), ``draft_tokens_proposed`` (draft tokens
    proposed; vLLM's ``spec_decode_num_draft_tokens`` counter, the Prometheus name kept),
    ``num_accepted_tokens`` (draft tokens accepted, bonus tokens excluded),
    ``accepted_per_pos`` (accepted tokens per draft position, index 0 = the first draft),
    ``step_switches``, ``preemptions``, ``requests_finished``, ``prompt_tokens`` (prompt
    tokens of the requests submitted, vLLM's ``prompt_tokens_total``), ``cached_tokens``
    (prompt tokens served from the prefix cache at the requests' first admission; hit rate =
    ``cached_tokens / prompt_tokens``, which requests aborted before admission lower a little)
    and ``generation_tokens``. ``cached_pages``: KV pages
    the prefix cache holds now (a gauge; shared with running requests or not).

    Policy state: ``slot_states``: one dict per adaptive slot, ascending, from the scheduler's
    ``slot_states()`` (``lower_bound``, ``steps``, ``ema_accept_len``, ``verify_count``; empty
    without an adaptive policy; new keys may be added); ``last_decode_steps`` and
    ``last_decode_batch_size`` (padded to the CUDA-graph size when graphs are used): the
    latest decode iteration's, None before the first. ``policy``: the adaptive strategy's
    name (None without one); ``goodput``: the ``goodput`` strategy's state, refreshed at most
    every :data:`POLICY_REFRESH_S` seconds (None otherwise): ``acceptance`` (conditional
    acceptance per draft position), ``probes``, ``switches`` and ``last_decision``
    (``batch_size``, ``context_tokens``, ``steps``, ``probe``, ``predicted_seconds`` {steps:
    seconds per decode iteration at that batch size}, ``expected_tokens`` {steps: tokens per
    request per verify}) and ``confidence_calibration`` (per bin of cumulative draft
    probability, factor ``sqrt 2`` per bin, the decayed ``(reported, survived)`` counts of chain
    positions and draft-tree nodes the confidence stop and node thresholds are priced from);
    see :meth:`specdial._core.Scheduler.goodput_state`.
    ``policy_cache``: whether the goodput policy was seeded from this machine's policy cache
    (``"loaded"``, ``"none"``, ``"ignored: <why>"``, ``"off"``, ``"n/a: <why>"``; see
    :mod:`specdial.engine.policy_cache`). ``verify_length_histogram``: cumulative
    ``{verify length: request-iterations}`` over decode iterations, each request counted at
    its own verify budget (``steps_per_request``, drafts verified; 0 = a plain decode), or at
    the length it verified after a confidence stop (``min_survival``), which differs from the
    batch's steps under per-request budgets (issue 28); chain iterations only.
    ``tree_node_histogram``: cumulative ``{tree nodes: request-iterations}`` over draft-tree
    decode iterations (issue 29), each request counted at the nodes it verified (its kept
    nodes under a per-request node budget, else the tree's ``N``; 0 = a plain decode through
    verify). Kept apart from ``verify_length_histogram``: a tree's nodes are not drafts on one
    path (a tree of ``N`` nodes and depth ``D`` accepts at most ``D``).
    """

    running: int = 0
    queued: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    steps_per_slot: dict[int, int] = field(default_factory=dict)
    num_drafts: int = 0
    draft_tokens_proposed: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    step_switches: int = 0
    preemptions: int = 0
    requests_finished: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_pages: int = 0
    generation_tokens: int = 0
    slot_states: list[dict[str, Any]] = field(default_factory=list)
    last_decode_steps: int | None = None
    last_decode_batch_size: int | None = None
    policy: str | None = None
    goodput: dict[str, Any] | None = None
    policy_cache: str | None = None
    verify_length_histogram: dict[int, int] = field(default_factory=dict)
    tree_node_histogram: dict[int, int] = field(default_factory=dict)

    @property
    def num_draft_tokens(self) -> int:
        """Deprecated read-only alias of :attr:`draft_tokens_proposed` (the field's name until
        issue 27). ``num_draft_tokens`` now means only tokens verified per request, ``steps + 1``
        (SGLang's ``--speculative-num-draft-tokens``; docs/design.md)."""
        return self.draft_tokens_proposed


#: Seconds between refreshes of :attr:`EngineStats.goodput` (a few dicts built from Rust).
POLICY_REFRESH_S = 0.25


class EngineProtocol(Protocol):
    """What the server and the CLI use of an engine (see the module docstring)."""

    tokenizer: Any
    context_length: int

    def async_stream(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
                     sampling_params: dict[str, Any] | None = None,
                     stop: list[str] | None = None,
                     logprobs: LogprobOptions | None = None,
                     whole: bool = False) -> AsyncIterator[StreamChunk]: ...

    def stream(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
               sampling_params: dict[str, Any] | None = None,
               stop: list[str] | None = None,
               logprobs: LogprobOptions | None = None) -> Iterator[StreamChunk]: ...

    def generate(self, prompt: Any = None, sampling_params: Any = None,
                 input_ids: Any = None) -> Any: ...

    def abort(self, request_id: int) -> None: ...

    def stats(self) -> EngineStats: ...

    def shutdown(self, drain: bool = True) -> None: ...


def stream_takes(engine: Any, name: str) -> bool:
    """Whether ``engine.async_stream`` names the optional keyword ``name`` (e.g.
    ``on_submitted``, which the contract leaves optional): callers pass such a keyword only
    to engines that take it."""
    try:
        return name in inspect.signature(engine.async_stream).parameters
    except (TypeError, ValueError):  # no signature to read
        return False
