"""SGLang-style output dicts of the offline API, built from a request's stream chunks.

:class:`OutputAccumulator` folds the :class:`~specdial.engine.api.StreamChunk` s of one request
into what SGLang's ``Engine.generate`` / ``async_generate`` return: ``text`` and
``output_ids`` (cumulative) and ``meta_info`` with ``prompt_tokens``, ``completion_tokens``,
``cached_tokens`` (prompt tokens served from the prefix cache, SGLang's), ``finish_reason`` (None until finished), ``spec_verify_ct``, ``spec_accept_length``,
``spec_steps_histogram`` and, with ``return_logprob``, SGLang's logprob lists:

- ``output_token_logprobs``: one ``(logprob, token_id, text)`` per output token;
- ``output_top_logprobs``: per output token, a list of ``(logprob, token_id, text)`` (the
  ``top_logprobs_num`` most likely, most likely first);
- ``input_token_logprobs`` / ``input_top_logprobs``: the same for the prompt positions
  ``logprob_start_len..P-1`` (``logprob_start_len >= 0``), logprob None at position 0.

``text`` is None unless ``return_text_in_logprobs`` (as in SGLang). Log-probabilities are the
target's before sampling processors (:mod:`specdial.worker.logprobs`).

Given the tokenizer's token bytes (``token_bytes``), the output entries follow the text as the
OpenAI routes' do (:mod:`specdial.engine.token_align`, the same code): an entry is added once its
token's text has been sent, the entries end where the text ends (a token cut by a stop string
keeps its characters before the cut, tokens after it are left out), and a token's ``text`` is
the text it completes (``""`` for the first bytes of a multi-byte character, the whole character
on the token that completes it), so the entries' texts joined are ``text``. Alternatives
(``output_top_logprobs``) are each token decoded alone. Without ``token_bytes`` (an engine
without a tokenizer) every output token has its entry.

The ``meta_info`` values: ``finish_reason`` is ``{"type": "length", "length": n}``, ``{"type":
"stop", "matched": token_id_or_str}``, ``{"type": "abort", "message": str, "cause": "client" |
"shutdown"}`` or, for a request the engine failed, ``{"type": "error", "message": cause,
"status_code": 500}`` (:mod:`specdial.engine.ends`); ``spec_verify_ct``: decode iterations the
request took part in, trivial verifies at ``steps = 0`` included; ``spec_accept_length``: the
acceptance length, tokens emitted per verify that carried drafts (accepted drafts + 1; trivial
verifies left out; ``(completion_tokens - 1) / spec_verify_ct`` when no verify carried drafts,
0.0 without verifies); ``spec_steps_histogram``: ``{steps: iterations}``.
"""

from __future__ import annotations

from typing import Any

from specdial.engine.api import StreamChunk
from specdial.engine.token_align import TokenAligner, TokenBytes

__all__ = ["META_KEYS", "OutputAccumulator"]

#: ``meta_info`` keys of every result.
META_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason",
             "spec_verify_ct", "spec_accept_length", "spec_steps_histogram")


class OutputAccumulator:
    """One request's SGLang-style result, updated chunk by chunk (see the module docstring).

    ``prompt_ids``: the request's prompt tokens (for ``input_token_logprobs``);
    ``return_logprob``: add the logprob lists; ``decode``: ``token_id -> str`` for
    ``return_text_in_logprobs`` (None: texts are None); ``token_bytes``: the tokenizer's
    :class:`~specdial.engine.token_align.TokenBytes`, which aligns the output entries to the
    text (None: one entry per output token); ``skip_special``: the request's
    ``skip_special_tokens`` (special tokens' entry text is then ``""``, as in its text).
    """

    def __init__(self, prompt_ids: list[int], *, return_logprob: bool = False,
                 decode: Any = None, token_bytes: TokenBytes | None = None,
                 skip_special: bool = True) -> None:
        self.prompt_ids = prompt_ids
        self.return_logprob, self.decode = return_logprob, decode
        self.aligner = (TokenAligner(token_bytes, skip_special)
                        if return_logprob and token_bytes is not None else None)
        self.text_chars = 0
        self.texts: list[str] = []
        self.ids: list[int] = []
        self.meta: dict[str, Any] = {}
        self.finish_reason: dict[str, Any] | None = None
        self.out_lp: list[tuple[float, int, str | None]] = []
        self.out_top: list[list[tuple[float, int, str | None]]] = []
        self.in_lp: list[tuple[float | None, int, str | None]] | None = None
        self.in_top: list[list[tuple[float, int, str | None]] | None] | None = None

    def _entry(self, logprob: float | None, token: int) -> tuple[Any, int, str | None]:
        return (logprob, token, None if self.decode is None else self.decode(token))

    def _top(self, pairs: list[tuple[int, float]] | None) -> list[tuple[float, int, str | None]]:
        return [self._entry(lp, t) for t, lp in (pairs or [])]

    def add(self, chunk: StreamChunk) -> None:
        """Fold one chunk in."""
        self.texts.append(chunk.text)
        self.text_chars += len(chunk.text)
        self.ids += chunk.token_ids
        if chunk.meta_info:
            self.meta = chunk.meta_info
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
        if not self.return_logprob:
            return
        tops = chunk.top_logprobs or [[] for _ in chunk.token_ids]
        if self.aligner is None:
            for token, lp, top in zip(chunk.token_ids, chunk.logprobs or [], tops):
                self.out_lp.append(self._entry(lp, token))
                self.out_top.append(self._top(top))
        else:
            self.aligner.push(chunk.token_ids, chunk.logprobs or [], tops)
            for e in self.aligner.take(self.text_chars, chunk.finished):
                self.out_lp.append((e.logprob, e.token, None if self.decode is None else e.text))
                self.out_top.append(self._top(e.top))
        if chunk.prompt_logprobs is not None:
            start = len(self.prompt_ids) - len(chunk.prompt_logprobs)
            tops = chunk.prompt_top_logprobs or [None] * len(chunk.prompt_logprobs)
            self.in_lp = [self._entry(lp, t) for lp, t in
                          zip(chunk.prompt_logprobs, self.prompt_ids[start:])]
            self.in_top = [None if top is None else self._top(top) for top in tops]

    def result(self) -> dict[str, Any]:
        """The dict so far: ``text``, ``output_ids`` and ``meta_info`` (copies)."""
        meta = {**{k: self.meta.get(k) for k in META_KEYS}, "finish_reason": self.finish_reason}
        if self.return_logprob:
            meta.update(output_token_logprobs=list(self.out_lp),
                        output_top_logprobs=list(self.out_top),
                        input_token_logprobs=None if self.in_lp is None else list(self.in_lp),
                        input_top_logprobs=None if self.in_top is None else list(self.in_top))
        return {"text": "".join(self.texts), "output_ids": list(self.ids), "meta_info": meta}
