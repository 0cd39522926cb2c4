"""The multi-turn chat workload of ``specdial bench --dataset multiturn`` (issue 30).

A conversation has ``min_turns..max_turns`` user turns (drawn per conversation, seeded; 4..8
by default). Each turn's prompt is the whole conversation so far, every earlier user message
and the answer the engine actually gave to it, then the new user message, as a chat client
resends its history, so a prefix cache can serve everything but the newest message. Turn
``t + 1`` is sent only once turn ``t``'s answer has arrived; ``--concurrency`` bounds the
conversations in flight (all at once by default). User messages are prompts of a prompt set
(``--multiturn-source``: ``code`` by default, any :mod:`specdial.bench.datasets` name or JSONL
file), each preceded by :data:`SEPARATOR` from the second turn on.

With token ids (the in-process engine) the history is the earlier prompt's ids, the answer's
ids and the new message's ids; over HTTP it is text (the answer's text appended), which the
server tokenizes. Conversations are cut to the turns whose prompts, with ``max_new_tokens``
answers before them, fit the engine's context (:class:`DatasetError` when fewer than
``min_turns`` fit). Each turn is a :class:`~specdial.bench.metrics.RequestRecord` with its
``turn`` (1-based), so the report gives TTFT per turn; ``--num-prompts`` counts conversations.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from specdial.bench.datasets import BenchRequest, DatasetError

__all__ = ["SEPARATOR", "Conversation", "conversation_runner", "multiturn_conversations"]

#: Text between the previous answer and the next user message.
SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Conversation:
    """One conversation: its user messages, in order (``index`` of each = its record's index
    in the run; ``prompt`` text and, when the driver tokenizes, ``input_ids``)."""

    index: int
    turns: tuple[BenchRequest, ...]


def multiturn_conversations(messages: Sequence[BenchRequest], num_conversations: int, *,
                            max_new_tokens: int, seed: int = 0, min_turns: int = 4,
                            max_turns: int = 8,
                            encode: Callable[[str], list[int]] | None = None,
                            fits: Callable[[int, int], bool] = lambda p, o: True,
                            ) -> list[Conversation]:
    """``num_conversations`` conversations over the user ``messages`` (module docstring),
    taken in order and wrapping around. ``encode``: text -> token ids (None: the messages are
    sent as text); ``fits(prompt_tokens, max_new_tokens)``: whether a prompt fits the engine.
    Raises :class:`DatasetError` for bad turn bounds or when no conversation fits."""
    if num_conversations < 1:
        raise DatasetError(f"num_prompts (conversations) must be >= 1, got {num_conversations}")
    if not 1 <= min_turns <= max_turns:
        raise DatasetError(f"--multiturn-min-turns {min_turns} and --multiturn-max-turns "
                           f"{max_turns}: need 1 <= min <= max")
    if not messages:
        raise DatasetError("--dataset multiturn: the message source has no prompt")
    rng, out, cursor, index = random.Random(seed), [], 0, 0
    sep = encode(SEPARATOR) if encode is not None else []
    for c in range(num_conversations):
        turns: list[BenchRequest] = []
        context = 0
        for t in range(rng.randint(min_turns, max_turns)):
            m = messages[cursor % len(messages)]
            cursor += 1
            text = (SEPARATOR if t else "") + (m.prompt or "")
            ids = None
            if encode is not None and m.prompt is not None:
                ids = tuple((sep if t else []) + encode(m.prompt))
            elif m.input_ids is not None:
                ids = m.input_ids
            context += len(ids or ()) + (max_new_tokens if t else 0)
            if ids is not None and not fits(context, max_new_tokens):
                break
            turns.append(BenchRequest(index + len(turns), "multiturn", text or None, ids,
                                      max_new_tokens))
        if len(turns) < min_turns:
            raise DatasetError(f"--dataset multiturn: conversation {c} fits only {len(turns)} "
                               f"turns in the context (fewer than {min_turns}); lower "
                               "--max-new-tokens or --multiturn-min-turns")
        out.append(Conversation(c, tuple(turns)))
        index += len(turns)
    return out


def _next_prompt(prev: BenchRequest | None, rec: Any, user: BenchRequest) -> BenchRequest:
    """Turn ``user``'s request: the previous prompt, its answer (``rec``), then ``user``."""
    if prev is None:
        return user
    if user.input_ids is not None and prev.input_ids is not None and rec.output_ids:
        ids = prev.input_ids + tuple(rec.output_ids) + user.input_ids
        return BenchRequest(user.index, user.workload, None, ids, user.max_new_tokens)
    text = (prev.prompt or "") + rec.output_text + (user.prompt or "")
    return BenchRequest(user.index, user.workload, text, None, user.max_new_tokens)


def conversation_runner(conversations: Sequence[Conversation]) -> Callable[..., Any]:
    """The runner of :func:`specdial.bench.driver.run_benchmark` for ``conversations`` (its
    ``requests`` are the turns, flattened in index order; ``caps`` an int bounds the
    conversations in flight). A failed turn fails the rest of its conversation."""

    async def run(driver: Any, requests: Sequence[BenchRequest], records: list[Any],
                  params: dict[str, Any], caps: Any, clock: Callable[[], float],
                  bar: Any) -> None:
        gate = asyncio.Semaphore(caps) if isinstance(caps, int) else None

        async def one(conv: Conversation) -> None:
            async with gate if gate is not None else contextlib.nullcontext():
                prev, prev_rec = None, None
                for t, user in enumerate(conv.turns):
                    rec = records[user.index]
                    rec.turn = t + 1
                    if prev_rec is not None and not prev_rec.success:
                        rec.error = f"turn {t} of the conversation failed"
                        bar.update(1)
                        continue
                    req = _next_prompt(prev, prev_rec, user)
                    rec.send_time = clock()
                    try:
                        await driver.send(req, {**params, "max_new_tokens":
                                                user.max_new_tokens or params["max_new_tokens"]},
                                          rec, clock)
                    except Exception as e:  # noqa: BLE001 - a failed turn is a figure
                        rec.success, rec.error = False, f"{type(e).__name__}: {e}"
                    if rec.end_time is None:
                        rec.end_time = clock()
                    bar.update(1)
                    prev, prev_rec = req, rec

        await asyncio.gather(*(one(c) for c in conversations))

    return run
