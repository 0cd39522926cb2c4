"""Stop strings, checked before the report so that the report decides every finish.

The Rust core applies the token rules (EOS, stop token ids, ``max_new_tokens``, the context end)
but has no text. Before :meth:`specdial._core.Scheduler.report`, the loop runs each request's
:class:`~specdial.detokenize.IncrementalText` on a copy, over the tokens the iteration emitted,
and passes ``(id, keep)`` for each request whose stop string matched as
``report(..., stop_strings=...)``: ``keep`` counts the emitted tokens up to and including the
one whose text completed the stop string. The core drops the tokens after it (a verify emits
several tokens at once; plain decoding would have stopped there), applies its own rules to the
kept ones and finishes the request (reason ``stop``, no stop token) unless those rules finish it
first. So output ids, ``completion_tokens`` and logprobs do not depend on the speculative depth,
as in vLLM, whose multi-step output processor appends a multi-token step one token at a time and
stops at the first token that finishes the sequence (``MultiStepOutputProcessor.
_process_seq_outputs``). Nothing calls back into the core after the report (vLLM and SGLang also
check stop strings on the detokenized output after each step; here the check only moved before
the report).

The copy's text delta is the one the loop would compute after the report whenever the core kept
the tokens it was told to keep and finished the request for no other reason, so it is kept and
reused (:meth:`StopCheck.text_for`); otherwise (an EOS, a stop token or the length cut the
tokens) the request's own text state runs on what the core kept.
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
    """The result of :func:`check_stop_strings` for one plan: ``stopped``, the
    ``(request id, keep)`` pairs of the requests whose stop string matched (for ``report``;
    ``keep``: emitted tokens up to and including the one that completed it, >= 1) and, per
    request id checked, its text state after the emitted tokens it keeps and the text delta
    that gave."""

    stopped: list[tuple[int, int]] = field(default_factory=list)
    trials: dict[int, tuple[IncrementalText, str]] = field(default_factory=dict)

    def text_for(self, rid: int, fin: Any) -> tuple[IncrementalText, str] | None:
        """The checked text state and delta of request ``rid`` if they hold for the report's
        outcome ``fin`` (its FinishedRequest or None): the core kept the tokens checked, and
        finished the request, if at all, for the stop string. None otherwise (or when not
        checked)."""
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
    (requests absent or without stop strings or tokenizer are skipped). A request whose text
    matched is checked again token by token to find the token that completed the match (one
    decode of the output per emitted token, once in the request's life)."""
    check = StopCheck()
    bounds = offsets.tolist()
    for b, rid in enumerate(rids):
        lv = live.get(rid)
        if lv is None or not lv.spec.stop or lv.text.tokenizer is None:
            continue
        new = tokens[bounds[b]:bounds[b + 1]].tolist()
        if not new:
            continue
        try:
            trial = _text_after(lv, new)
            if trial[0].matched is not None:
                keep = _completing(lv, new)
                if keep < len(new):
                    trial = _text_after(lv, new[:keep])
                check.stopped.append((rid, keep))
        except Exception:  # noqa: BLE001 - it fails again after the report, for this request only
            continue
        check.trials[rid] = trial
    return check


def _text_after(lv: Any, new: list[int]) -> tuple[IncrementalText, str]:
    """A copy of ``lv``'s text state updated with ``new`` appended to its output, and the
    delta (``lv`` itself is left as it is)."""
    text = copy.copy(lv.text)
    return text, text.update(lv.output + new, final=False)


def _completing(lv: Any, new: list[int]) -> int:
    """How many of the emitted tokens ``new`` (whose text matched a stop string of ``lv``) reach
    the first match: the shortest prefix whose text matches, where plain decoding, one token per
    iteration, would have stopped."""
    for k in range(1, len(new)):
        if _text_after(lv, new[:k])[0].matched is not None:
            return k
    return len(new)
