"""OpenAI logprob shapes from the engine's per-token log-probabilities.

The numbers are the target's natural-log probabilities before sampling processors (vLLM's
default, :mod:`specdial.worker.logprobs`). Token strings are each token decoded alone
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


def completion_logprobs(tokens: list[int], logprobs: list[float | None],
                        tops: list[Top | None], decode: Callable[[int], str],
                        offset: int = 0) -> tuple[dict[str, Any], int]:
    """The completions ``logprobs`` object of ``tokens`` (their logprobs and top alternatives,
    None where there is no context) and the text offset after them; ``offset``: the character
    offset of the first token in the choice's text."""
    texts, offsets, top_dicts = [], [], []
    for token, lp, top in zip(tokens, logprobs, tops):
        text = decode(token)
        texts.append(text)
        offsets.append(offset)
        offset += len(text)
        if lp is None or top is None:
            top_dicts.append(None)
            continue
        entry = {decode(t): v for t, v in top}
        entry.setdefault(text, lp)
        top_dicts.append(entry)
    return ({"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": top_dicts,
             "text_offset": offsets}, offset)


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokens: list[int], logprobs: list[float], tops: list[Top],
                  decode: Callable[[int], str]) -> dict[str, Any]:
    """The chat ``logprobs`` object (``{"content": [...]}``) of ``tokens``."""
    content = []
    for token, lp, top in zip(tokens, logprobs, tops):
        entry = _chat_entry(decode(token), lp)
        entry["top_logprobs"] = [_chat_entry(decode(t), v) for t, v in top]
        content.append(entry)
    return {"content": content}
