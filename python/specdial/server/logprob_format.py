"""OpenAI logprob shapes from the engine's per-token log-probabilities.

The numbers are the target's natural-log probabilities before sampling processors (vLLM's
default, :mod:`specdial.worker.logprobs`); under a grammar, those of the grammar-masked
distribution, with only allowed tokens among the alternatives (possibly fewer than asked). The chosen tokens' strings (and ``bytes``) follow the
text (:mod:`specdial.engine.token_align`: joined, they are the text, stop-string cuts and
multi-byte characters included); alternatives are each token decoded alone
(``tokenizer.decode([id])``), as vLLM reports them; two tokens with the same text collapse in a
completions ``top_logprobs`` dict, as in vLLM.

- :func:`completion_logprobs`: ``/v1/completions`` (``{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}``); each ``top_logprobs`` entry holds the ``logprobs`` most
  likely tokens plus the chosen one (vLLM's rule; so ``logprobs: 0`` gives the chosen token
  only); entries without context (the first prompt token under ``echo``) are None.
- :func:`chat_logprobs`: ``/v1/chat/completions`` (``{"content": [{"token", "logprob",
  "bytes", "top_logprobs": [...]}]}``, ``top_logprobs`` exactly the ``top_logprobs`` most
  likely).
"""

from __future__ import annotations

from typing import Any, Callable

from specdial.engine.token_align import Entry

__all__ = ["TokenDecoder", "chat_logprobs", "completion_logprobs"]

Top = list[tuple[int, float]]


class TokenDecoder:
    """``id -> text`` of single tokens, cached (the tokenizer's ``decode([id])``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self.cache.get(token)
        if text is None:
            text = self.cache[token] = str(self.tokenizer.decode([token]))
        return text


def completion_logprobs(entries: list[Entry], decode: Callable[[int], str],
                        offset: int = 0) -> tuple[dict[str, Any], int]:
    """The completions ``logprobs`` object of ``entries`` (:class:`~specdial.engine.token_align.
    Entry`: a logprob and top alternatives, or None where there is no context) and the text
    offset after them; ``offset``: the character offset of the first entry in the choice's
    text."""
    texts, offsets, top_dicts, lps = [], [], [], []
    for e in entries:
        texts.append(e.text)
        offsets.append(offset)
        lps.append(e.logprob)
        offset += len(e.text)
        if e.logprob is None or e.top is None:
            top_dicts.append(None)
            continue
        entry = {decode(t): v for t, v in e.top}
        entry.setdefault(decode(e.token), e.logprob)
        top_dicts.append(entry)
    return ({"tokens": texts, "token_logprobs": lps, "top_logprobs": top_dicts,
             "text_offset": offsets}, offset)


def _chat_entry(text: str, logprob: float | None, raw: bytes) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(entries: list[Entry], decode: Callable[[int], str],
                  token_bytes: Callable[[int], bytes]) -> dict[str, Any]:
    """The chat ``logprobs`` object (``{"content": [...]}``) of ``entries``; alternatives get
    their lone decode as ``token`` and their own bytes (``token_bytes``) as ``bytes``."""
    content = []
    for e in entries:
        entry = _chat_entry(e.text, e.logprob, e.raw)
        entry["top_logprobs"] = [_chat_entry(decode(t), v, token_bytes(t)) for t, v in e.top]
        content.append(entry)
    return {"content": content}
