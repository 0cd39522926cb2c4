"""One request never hurts another: a request whose options fail is failed alone.

Requests are validated where they enter (:func:`specdial.engine.requests.make_spec`, bounds of
:mod:`specdial.engine.bounds`), but a value that passes validation could still fail where the
loop turns a batch's options into tensors. :func:`sampling_isolated` then tries each request
alone; those that fail alone are reported (the loop fails them: finish reason ``error``, and
aborts them in the scheduler, which ignores their results in the plan in flight) and their rows
get neutral options (:class:`SamplingParams` defaults: greedy, no processors), so the batch's
pass runs for every other request. If no request fails alone the batch's error is raised (the
loop then fails the plan). Nothing is tried at submission: a build per request would cost the
loop thread a few hundred microseconds each, for values the entry checks already refuse.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from specdial.worker.sampling import SamplingParams

__all__ = ["param_of", "sampling_isolated"]


def param_of(message: str) -> str | None:
    """The field an InvalidRequestError / SamplingParams message starts with."""
    head = message.split(":", 1)[0].strip()
    head = head.removeprefix("SamplingParams.").split()[0] if head else ""
    return head or None

_B = TypeVar("_B")
Build = Callable[[list[SamplingParams], list[int], list[tuple[int, ...]]], _B]


def sampling_isolated(params: list[SamplingParams], prompt_lens: list[int],
                      min_tokens_ids: list[tuple[int, ...]], build: Build[_B]
                      ) -> tuple[_B, dict[int, Exception]]:
    """``(batch, culprits)``: ``build(params, prompt_lens, min_tokens_ids)`` of the whole batch
    (``B`` rows), and ``{row: error}`` of the rows that fail alone (their rows in ``batch``
    hold neutral options). Raises the batch's error when every row builds alone (a failure of
    the combination, not of one request), or when the batch still fails without the culprits."""
    try:
        return build(params, prompt_lens, min_tokens_ids), {}
    except Exception as batch_error:  # noqa: BLE001 - find who caused it
        culprits: dict[int, Exception] = {}
        for i, (p, n, m) in enumerate(zip(params, prompt_lens, min_tokens_ids)):
            try:
                build([p], [n], [m])
            except Exception as e:  # noqa: BLE001
                culprits[i] = e
        if not culprits:
            raise batch_error
    neutral = SamplingParams()
    params = [neutral if i in culprits else p for i, p in enumerate(params)]
    min_tokens_ids = [() if i in culprits else m for i, m in enumerate(min_tokens_ids)]
    return build(params, prompt_lens, min_tokens_ids), culprits
