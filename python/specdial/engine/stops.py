"""Stop strings, checked before the report so that the report decides every finish.

The Rust core applies the token rules (EOS, stop token ids, ``max_new_tokens``, the context end)
but has no text. Before :meth:`specdial._core.Scheduler.report`, the loop runs each request's
:class:`~specdial.detokenize.IncrementalText` on a copy, over the tokens the iteration emitted,
and passes the ids whose stop string matched as ``report(..., stop_strings=ids)``; the core then
finishes them (reason ``stop``, no stop token) unless its own rules finish them first. Nothing
calls back into the core after the report (vLLM and SGLang also check stop strings on the
detokenized output after each step; here the check only moved before the report).

The copy's text delta is the one the loop would compute after the report whenever the core kept
every token and finished the request for no other reason, so it is kept and reused
(:meth:`StopCheck.text_for`); otherwise (an EOS, a stop token or the length cut the tokens) the
request's own text state runs on what the core kept.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specdial.detokenize import IncrementalText

__all__ = ["StopCheck", "check_stop_strings"]


@dataclass
class StopCheck:
    """The result of :func:`check_stop_strings` for one plan: ``stopped`` (request ids whose stop
    string matched, for ``report``) and, per request id checked, its text state after the
    emitted tokens and the text delta that gave."""

    stopped: list[int] = field(default_factory=list)
    trials: dict[int, tuple[IncrementalText, str]] = field(default_factory=dict)

    def text_for(self, rid: int, fin: Any) -> tuple[IncrementalText, str] | None:
        """The checked text state and delta of request ``rid`` if they hold for the report's
        outcome ``fin`` (its FinishedRequest or None): the core kept every token, and finished
        the request, if at all, for the stop string. None otherwise (or when not checked)."""
        trial = self.trials.get(rid)
        if trial is None or fin is None:
            return trial
        by_stop_string = fin.reason == "stop" and fin.stop_token_id is None
        return trial if by_stop_string else None


def check_stop_strings(live: dict[int, Any], rids: list[int], tokens: np.ndarray,
                       offsets: np.ndarray) -> StopCheck:
    """Check the stop strings of the plan's requests ``rids`` (in plan order) over the tokens
    they emitted (``tokens[offsets[b]:offsets[b + 1]]``, the worker's output, int64) appended to
    their output so far. ``live``: request id -> :class:`~specdial.engine.live.LiveRequest`
    (requests absent or without stop strings or tokenizer are skipped)."""
    check = StopCheck()
    bounds = offsets.tolist()
    for b, rid in enumerate(rids):
        lv = live.get(rid)
        if lv is None or not lv.spec.stop or lv.text.tokenizer is None:
            continue
        new = tokens[bounds[b]:bounds[b + 1]].tolist()
        if not new:
            continue
        text = copy.copy(lv.text)
        try:
            delta = text.update(lv.output + new, final=False)
        except Exception:  # noqa: BLE001 - it fails again after the report, for this request only
            continue
        check.trials[rid] = (text, delta)
        if text.matched is not None:
            check.stopped.append(rid)
    return check
