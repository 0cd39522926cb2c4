"""One live request as the engine loop sees it (:class:`LiveRequest`): its spec, its text
state, its per-request speculation counters (``meta_info``) and its prompt log-probabilities;
and the prompt-logprob bookkeeping of a prefill chunk (:func:`prompt_plan`,
:func:`store_prompt_logprobs`)."""

from __future__ import annotations

import math

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specdial.detokenize import IncrementalText
from specdial.engine.api import StreamChunk
from specdial.engine.messages import RequestSpec
from specdial.worker.logprobs import NOT_ALLOWED_ID, HostLogprobs, PromptLogprobPlan


@dataclass(eq=False)
class LiveRequest:
    """A request the scheduler holds, on the loop thread: ``spec`` (what was asked), ``rid``
    (the scheduler's id), ``text`` (its detokenizer and stop-string state), ``output`` (its
    output token ids so far), the counters behind ``meta_info`` (``spec_verify_ct``, the
    acceptance length, the steps histogram, ``cached_tokens``: prompt tokens served from the
    prefix cache at its latest admission), its queue time, and its prompt logprobs
    (``LogprobOptions.prompt_start``; per prompt position, filled by the prefill chunks)."""

    spec: RequestSpec
    rid: int
    text: IncrementalText
    output: list[int] = field(default_factory=list)
    verify_ct: int = 0
    # verifies that carried drafts (steps > 0) and the tokens they emitted: the acceptance length
    draft_verify_ct: int = 0
    draft_verify_tokens: int = 0
    hist: dict[int, int] = field(default_factory=dict)
    cached_tokens: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    queue_time: float | None = None
    # prompt logprobs (LogprobOptions.prompt_start): per prompt position, filled by prefill
    prompt_lp: np.ndarray | None = None
    prompt_top: tuple[np.ndarray, np.ndarray] | None = None
    prompt_done: bool = False
    prompt_sent: bool = False
    # structured outputs: the request's grammar matcher (None: unconstrained)
    grammar: Any = None
    # stream_interval > 1: its chunks emitted but not sent yet, joined (join_chunks)
    held: StreamChunk | None = None

    def meta(self) -> dict[str, Any]:
        n = len(self.output)
        meta = {"prompt_tokens": len(self.spec.prompt_ids), "completion_tokens": n,
                "cached_tokens": self.cached_tokens, "spec_verify_ct": self.verify_ct,
                "spec_accept_length": self.accept_length(),
                "spec_steps_histogram": dict(sorted(self.hist.items()))}
        if self.queue_time is not None:
            meta["queue_time_s"] = self.queue_time
        return meta

    def accept_length(self) -> float:
        """Acceptance length: tokens emitted per verify that carried drafts (accepted drafts + 1,
        the bonus token included; docs/design.md's definition, vLLM's mean acceptance length); trivial
        verifies at steps 0 are plain decodes and are left out. Without any drafting verify:
        ``(completion_tokens - 1) / spec_verify_ct`` (1.0 for plain decoding), 0.0 without
        verifies."""
        if self.draft_verify_ct:
            return self.draft_verify_tokens / self.draft_verify_ct
        return (len(self.output) - 1) / self.verify_ct if self.verify_ct else 0.0

    def top_n(self) -> int | None:
        """The logprob rows entry of this request (None: no logprobs)."""
        return None if self.spec.logprobs is None else self.spec.logprobs.top_n

    def wants_prompt(self) -> bool:
        lp = self.spec.logprobs
        return lp is not None and lp.prompt_start is not None and not self.prompt_done

    def prompt_chunk(self) -> tuple[list[float | None], list[Any]] | None:
        """Prompt logprobs (and top alternatives) to send with the first chunk, once."""
        lp = self.spec.logprobs
        if lp is None or lp.prompt_start is None or self.prompt_sent or self.prompt_lp is None:
            return None
        self.prompt_sent = True
        start = lp.prompt_start
        values: list[float | None] = self.prompt_lp[start:].tolist()
        assert self.prompt_top is not None
        ids, top = self.prompt_top[0][start:].tolist(), self.prompt_top[1][start:].tolist()
        tops: list[Any] = [list(zip(i, t)) for i, t in zip(ids, top)]
        if start == 0:  # the first prompt token has no context: no logprob
            values[0], tops[0] = None, None
        return values, tops

    def chunk(self, text: str, new: list[int], finished: bool,
              reason: dict[str, Any] | None, token_lp: Any, meta: bool = True) -> StreamChunk:
        """The :class:`StreamChunk` of ``new`` tokens and their ``text`` (``token_lp``: their
        ``(logprob, top ids, top logprobs)`` rows, or None), with the prompt logprobs on the
        first chunk that carries tokens. ``meta`` False: an empty ``meta_info`` (a chunk held
        back by ``stream_interval``, whose sending chunk carries the cumulative one)."""
        chunk = StreamChunk(self.rid, text, new, finished, reason, self.meta() if meta else {})
        if self.spec.logprobs is None:
            return chunk
        if token_lp is not None:
            values, ids, top = token_lp
            chunk.logprobs = values.tolist()
            # an alternative the grammar does not allow is never listed: the chain path marks it
            # with id NOT_ALLOWED_ID, the tree path with a -inf value (its masked distribution
            # has fewer than top_n tokens)
            chunk.top_logprobs = [[(a, v) for a, v in zip(i, t)
                                   if a != NOT_ALLOWED_ID and v != -math.inf]
                                  for i, t in zip(ids.tolist(), top.tolist())]
        elif not new:
            chunk.logprobs, chunk.top_logprobs = [], []
        if new:
            prompt = self.prompt_chunk()
            if prompt is not None:
                chunk.prompt_logprobs, chunk.prompt_top_logprobs = prompt
        return chunk


def join_chunks(first: StreamChunk, then: StreamChunk) -> StreamChunk:
    """One chunk for two consecutive chunks of a request (``stream_interval`` holds chunks
    back and sends them as one): text, token ids and per-token logprobs concatenated in
    order; the prompt logprobs of whichever carries them (only a request's first chunk with
    tokens does); ``finished``, ``finish_reason``, ``meta_info`` (cumulative) and
    ``emitted_s`` of ``then``. Nothing is lost or reordered: the tokens, text and logprobs a
    consumer joins are those of the two chunks."""

    def cat(a: list[Any] | None, b: list[Any] | None) -> list[Any] | None:
        return None if a is None and b is None else (a or []) + (b or [])

    return StreamChunk(
        then.request_id, first.text + then.text, first.token_ids + then.token_ids,
        then.finished, then.finish_reason, then.meta_info,
        logprobs=cat(first.logprobs, then.logprobs),
        top_logprobs=cat(first.top_logprobs, then.top_logprobs),
        prompt_logprobs=(first.prompt_logprobs if first.prompt_logprobs is not None
                         else then.prompt_logprobs),
        prompt_top_logprobs=(first.prompt_top_logprobs if first.prompt_logprobs is not None
                             else then.prompt_top_logprobs),
        emitted_s=then.emitted_s)


def prompt_plan(plan: Any, rids: list[int], live: dict[int, LiveRequest]
                ) -> tuple[PromptLogprobPlan | None, list[tuple[LiveRequest, int, int, int]]]:
    """Positions of this prefill chunk whose next prompt token's logprob is wanted:
    position ``p`` (of a chunk ``[s, e)``) predicts prompt token ``p + 1``; wanted for
    ``p + 1`` in ``max(prompt_start, 1)..P-1``. ``owners``: ``(live, first position,
    count, chunk end)`` per request, in the plan's order."""
    owners: list[tuple[LiveRequest, int, int, int]] = []
    index, targets = [], []
    top = 0
    qo, ends = plan.qo_lens.tolist(), plan.kv_lens.tolist()
    base = 0
    for b, rid in enumerate(rids):
        lv = live.get(rid)
        s, e = ends[b] - qo[b], ends[b]
        if lv is not None and lv.wants_prompt():
            assert lv.spec.logprobs is not None and lv.spec.logprobs.prompt_start is not None
            prompt = lv.spec.prompt_ids
            lo = max(s, max(lv.spec.logprobs.prompt_start, 1) - 1)
            hi = min(e, len(prompt) - 1)
            if hi > lo:
                index.append(np.arange(base + lo - s, base + hi - s))
                targets.append(np.asarray(prompt[lo + 1:hi + 1], np.int64))
                top = max(top, lv.spec.logprobs.top_n)
            owners.append((lv, lo, max(hi - lo, 0), e))
        base += qo[b]
    if not index:
        return None, owners
    return PromptLogprobPlan(np.concatenate(index), np.concatenate(targets), top), owners


def store_prompt_logprobs(host: HostLogprobs | None,
                          owners: list[tuple[LiveRequest, int, int, int]]) -> None:
    """Store a prefill chunk's prompt logprobs (``host``, in ``owners`` order, from
    :func:`prompt_plan`) in their requests."""
    off = 0
    for lv, lo, count, end in owners:
        prompt_len = len(lv.spec.prompt_ids)
        if lv.prompt_lp is None:
            assert lv.spec.logprobs is not None
            k = lv.spec.logprobs.top_n
            lv.prompt_lp = np.full(prompt_len, np.nan, np.float32)
            lv.prompt_top = (np.zeros((prompt_len, k), np.int64),
                             np.zeros((prompt_len, k), np.float32))
        if count and host is not None:
            assert lv.prompt_top is not None
            k = lv.prompt_top[0].shape[1]
            lv.prompt_lp[lo + 1:lo + 1 + count] = host.logprob[0, off:off + count]
            lv.prompt_top[0][lo + 1:lo + 1 + count] = host.top_ids[0, off:off + count, :k]
            lv.prompt_top[1][lo + 1:lo + 1 + count] = host.top_logprob[0, off:off + count, :k]
            off += count
        lv.prompt_done = lv.prompt_done or end >= prompt_len
