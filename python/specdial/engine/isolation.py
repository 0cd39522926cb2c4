"""One request never hurts another: a request whose options fail is failed alone.

Requests are validated where they enter (:func:`specdial.engine.requests.make_spec`), but a
value that passes validation could still fail where the loop turns it into tensors. Two guards,
both on the loop thread:

- :func:`check_alone`, at submission: the request's own sampling options are built as a batch of
  one; a failure refuses that request (:class:`~specdial.engine.api.RequestError`, HTTP 400)
  before it reaches the scheduler.
- :func:`sampling_isolated`, when a batch's options are built: if the batch fails, each request
  is tried alone; those that fail alone are reported (the loop fails them, finish reason
  ``error``) and their rows get neutral options (:class:`SamplingParams` defaults: greedy, no
  processors), so the batch's pass runs for every other request. If no request fails alone the
  batch's error is raised (the loop then fails the plan).
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from specdial.engine.api import RequestError
from specdial.worker.sampling import SamplingParams

__all__ = ["check_alone", "sampling_isolated"]

_B = TypeVar("_B")
Build = Callable[[list[SamplingParams], list[int], list[tuple[int, ...]]], _B]


def check_alone(spec: Any, build: Callable[[], Any]) -> RequestError | None:
    """``build()`` the options of ``spec`` (a :class:`~specdial.engine.loop.RequestSpec`) as a
    batch of one; None when it works, else the :class:`RequestError` to answer with (it names
    the error; ``param`` None: the field could not be told)."""
    try:
        build()
    except Exception as e:  # noqa: BLE001 - reported to the request, never raised in the loop
        return RequestError(f"the request's sampling options cannot be applied: "
                            f"{type(e).__name__}: {e}")
    return None


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
