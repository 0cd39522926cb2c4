"""OpenAI's response bodies: the JSON of a finished run and the server-sent events of a
streaming one (``text_completion`` / ``chat.completion`` objects and their chunks, ``usage``,
``logprobs`` aligned to the text sent: :mod:`specdial.engine.token_align`,
:mod:`specdial.server.logprob_format`). A failed choice (finish reason ``error``,
:mod:`specdial.engine.ends`) ends a stream with an error event, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from specdial.engine.api import StreamChunk
from specdial.engine.ends import error_body, is_failure
from specdial.server.errors import engine_error
from specdial.server.logprob_format import chat_logprobs, completion_logprobs
from specdial.server.runs import DONE, Choice, ClientGone, Job, Run
from specdial.server.state import ServerState
from specdial.engine.token_align import TokenAligner

__all__ = ["LogprobTrack", "choice_logprobs", "coalesce", "full_response", "new_track",
           "response_id", "sse_events"]


@dataclass
class LogprobTrack:
    """Per choice: what its logprobs reported so far (``tokens`` pushed to ``aligner``, text
    characters sent, the completions text offset)."""

    aligner: TokenAligner
    tokens: int = 0
    text_chars: int = 0
    offset: int = 0
    prompt_done: bool = False
    reported: bool = False


def response_id(run: Run, chat: bool) -> str:
    """OpenAI-style response id carrying the request id of the log lines."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{run.rid}"


def choice_logprobs(state: ServerState, c: Choice, job: Job, chat: bool, track: LogprobTrack,
                    text_chars: int, final: bool) -> dict[str, Any] | None:
    """The ``logprobs`` of ``c``'s tokens not reported yet (the echoed prompt's first) whose
    text is within the first ``text_chars`` characters sent (the echo included); ``final``:
    the text is complete (:mod:`specdial.engine.token_align`). None without logprobs, or
    when no entry is due (before the end)."""
    if job.logprobs is None:
        return None
    al = track.aligner
    if not track.prompt_done and c.token_ids:
        track.prompt_done = True
        if not chat and job.echo is not None and c.prompt_logprobs is not None:
            assert job.input_ids is not None and c.prompt_top_logprobs is not None
            al.push(job.input_ids, c.prompt_logprobs, c.prompt_top_logprobs)
    sent = track.tokens
    al.push(c.token_ids[sent:], c.logprobs[sent:], c.top_logprobs[sent:])  # type: ignore[arg-type]
    track.tokens = len(c.token_ids)
    entries = al.take(text_chars, final)
    if not entries and not (final and track.offset == 0 and not track.reported):
        return None
    track.reported = True
    if chat:
        return chat_logprobs(entries, state.decode,
                             lambda t: state.token_bytes(t, skip_special=False))
    lp, track.offset = completion_logprobs(entries, state.decode, track.offset)
    return lp


def new_track(state: ServerState, job: Job) -> LogprobTrack:
    """A fresh :class:`LogprobTrack` for ``job`` (special tokens' text skipped unless the job's
    ``skip_special_tokens`` is False, as the engine's detokenizer does)."""
    skip = job.sampling_params.get("skip_special_tokens") is not False
    return LogprobTrack(TokenAligner(state.token_bytes, skip))


def full_response(state: ServerState, run: Run, chat: bool) -> dict[str, Any]:
    """The non-streaming body of a finished ``run``: OpenAI's ``text_completion`` or
    ``chat.completion`` object with every choice and the ``usage``."""
    choices: list[dict[str, Any]] = []
    by_index = {c.index: c for c in run.choices}
    for c, job in zip(run.choices, run.jobs):
        if job.prompt_logprobs_from is not None:  # choice 0's (jobs.choices)
            src = by_index[job.prompt_logprobs_from]
            c.prompt_logprobs, c.prompt_top_logprobs = src.prompt_logprobs, src.prompt_top_logprobs
        text = "".join(c.parts)
        logprobs = choice_logprobs(state, c, job, chat, new_track(state, job),
                                   len((job.echo or "") + text), True)
        if chat:
            choices.append({"index": c.index, "logprobs": logprobs,
                            "finish_reason": c.reason,
                            "message": {"role": "assistant", "content": text}})
        else:
            choices.append({"index": c.index, "text": (job.echo or "") + text,
                            "logprobs": logprobs, "finish_reason": c.reason})
    return {"id": response_id(run, chat),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": state.model_name, "choices": choices,
            "usage": run.usage()}


async def sse_events(state: ServerState, run: Run, chat: bool,
                     include_usage: bool) -> AsyncIterator[str]:
    """The server-sent events of a started ``run`` in OpenAI's chunk format (chat: a first
    ``role`` delta per choice; a failed choice: an ``error`` event), ending with ``[DONE]``;
    ``include_usage``: a last chunk with empty ``choices`` and the ``usage``, the others with
    ``"usage": null``.

    Coalesced per wake-up (:meth:`Run.batches`): the chunks of one choice that arrived together
    make one event carrying all their text (OpenAI's stream chunks may carry several tokens;
    the joined text, logprobs and finish reason are what per-chunk events would give), and all
    the events of one wake-up are yielded as one string, i.e. one write to the client; the
    usage chunk goes out with ``[DONE]``."""
    rid, created = response_id(run, chat), int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {"id": rid, "object": kind, "created": created, "model": state.model_name,
                "choices": choices, **extra}
        if include_usage and "usage" not in body:
            body["usage"] = None
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    jobs = {c.index: j for c, j in zip(run.choices, run.jobs)}
    tracks = {c.index: new_track(state, j) for c, j in zip(run.choices, run.jobs)}
    started: set[int] = set()

    def events_of(c: Choice, text: str, tokens: bool, chunk: Any, out: list[str]) -> bool:
        """Append the events of ``c``'s coalesced chunk to ``out``; True when it failed."""
        echo = jobs[c.index].echo
        if echo is not None and c.index not in started and (text or tokens or chunk.finished):
            text = echo + text
        started.add(c.index)
        track = tracks[c.index]
        track.text_chars += len(text)
        lp = choice_logprobs(state, c, jobs[c.index], chat, track, track.text_chars,
                             chunk.finished)
        if chunk.finished and is_failure(chunk.finish_reason):
            if text or lp:
                out.append(event([_chunk_choice(chat, c.index, text, None, False, lp)]))
            out.append(f"data: {json.dumps(error_body(chunk.finish_reason)[1])}\n\n")
            return True  # the other choices are aborted when the response closes its run
        if chunk.finished:
            if chat and (text or lp):
                out.append(event([_chunk_choice(chat, c.index, text, None, False, lp)]))
                out.append(event([_chunk_choice(chat, c.index, None, c.reason, False, None)]))
            else:
                out.append(event([_chunk_choice(chat, c.index, text if not chat else None,
                                                c.reason, False, lp)]))
        elif text or lp:
            out.append(event([_chunk_choice(chat, c.index, text, None, False, lp)]))
        return False

    tail = ""
    try:
        if chat:
            yield "".join(event([_chunk_choice(chat, c.index, None, None, True, None)])
                          for c in run.choices)
        failed = False
        async for batch in run.batches():
            out: list[str] = []
            for c, text, tokens, chunk in coalesce(batch):
                if events_of(c, text, tokens, chunk, out):
                    failed = True
                    break
            if out:
                yield "".join(out)
            if failed:
                break
        if include_usage:
            tail = event([], usage=run.usage())
    except ClientGone:
        return
    except Exception as e:  # noqa: BLE001 - reported in-band once streaming started
        tail = f"data: {json.dumps(engine_error(e, {}).body())}\n\n"
    yield tail + DONE


def coalesce(batch: list[tuple[Choice, StreamChunk]]
             ) -> list[tuple[Choice, str, bool, StreamChunk]]:
    """The chunks of one wake-up merged per choice, in the order of each choice's first chunk:
    ``(choice, text joined, whether any carried tokens, the choice's last chunk)`` (its
    ``finished`` and ``finish_reason`` stand for the merged chunk: a choice's final chunk is
    its last)."""
    merged: dict[int, list[Any]] = {}
    for c, chunk in batch:
        m = merged.get(c.index)
        if m is None:
            merged[c.index] = [c, [chunk.text], bool(chunk.token_ids), chunk]
        else:
            m[1].append(chunk.text)
            m[2] = m[2] or bool(chunk.token_ids)
            m[3] = chunk
    return [(c, "".join(texts), tokens, last) for c, texts, tokens, last in merged.values()]


def _chunk_choice(chat: bool, index: int, text: str | None, reason: str | None, role: bool,
                  lp: dict[str, Any] | None) -> dict[str, Any]:
    """One entry of a chunk's ``choices``: completions' ``text``, or chat's ``delta`` (the
    ``role`` of the first, ``content`` when there is text)."""
    if not chat:
        return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": reason}
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
        {} if text is None else {"content": text})
    return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
