"""Token strings of logprob entries that agree with the response text.

Issue 25 found ``logprobs.tokens`` joined differing from ``text`` in 18 of 1,500 requests: tokens
cut by a stop string stayed in the logprobs, and each token of a multi-byte character, decoded
alone, showed as its own ``"\\ufffd"``. The rules here, for ``/v1/completions`` (``tokens``,
``text_offset``), ``/v1/chat/completions`` (``token``, ``bytes``: :mod:`specdial.server.
openai_responses`) and SGLang's ``output_token_logprobs`` of ``/generate`` and the offline
Engine (:class:`specdial.engine.output.OutputAccumulator`):

- A token's string is the text it completes: its bytes (:meth:`TokenBytes.__call__`) are fed to
  an incremental UTF-8 decoder, so a token holding only the first bytes of a character has the
  string ``""`` and the token that completes the character carries the whole character. Its
  ``bytes`` field (chat) holds the token's own UTF-8 bytes, OpenAI's field for exactly this
  case ("characters represented by multiple tokens ... their byte representations must be
  combined"): the bytes of all entries joined are the text's UTF-8, and the strings joined are
  the text. (vLLM writes such a token as ``"bytes:\\xe4\\xbd"``, OpenAI shows the replacement
  character; neither joins to the text.)
- Entries follow the text: a streamed event carries the entries of the tokens whose text has
  been sent (text held back because it may begin a stop string holds its tokens back too), and
  the final event ends the entries where the text ends: a token cut by a stop string keeps
  only its characters before the cut (its ``bytes`` then those characters' bytes), tokens
  after the cut are left out, and a zero-width token at the very end (an EOS token, whose text
  is not shown) is kept.
- Special tokens have the string ``""`` when the request skips special tokens in its text
  (the default), else their text.

Alternatives (``top_logprobs``) keep each token decoded alone, as vLLM reports them.

The strings join to the text exactly when the tokenizer's text is the UTF-8 decoding of its
tokens' bytes in order (byte-level BPE: GPT-2, Llama 3, Qwen, the built-in models); a
tokenizer whose decode also rewrites text (SentencePiece's leading-space rule) can still differ
by those rewrites.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Entry", "TokenAligner", "TokenBytes"]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (``bytes_to_unicode``) inverted: character -> byte."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_LEVEL = _byte_decoder()


class TokenBytes:
    """``id -> bytes`` of single tokens (cached), for ``tokenizer`` (HF or ``tokenizers``).

    A token whose lone decode is clean text: that text's UTF-8. A token holding part of a
    character (its lone decode has U+FFFD): its raw bytes, from the byte-level BPE alphabet
    (GPT-2, Llama 3, Qwen) or SentencePiece's byte-fallback pieces (``<0xNN>``); the lone
    decode's UTF-8 when neither applies. Special tokens: ``b""`` when ``skip_special``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, bytes] = {}
        self.special = frozenset(getattr(tokenizer, "all_special_ids", None) or ())

    def lone(self, token: int) -> str:
        """The token decoded alone (``decode([id])``)."""
        return str(self.tokenizer.decode([token]))

    def __call__(self, token: int, skip_special: bool = True) -> bytes:
        if skip_special and token in self.special:
            return b""
        raw = self.cache.get(token)
        if raw is None:
            raw = self.cache[token] = self._bytes(token)
        return raw

    def _bytes(self, token: int) -> bytes:
        text = self.lone(token)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        if convert is None:
            convert = getattr(self.tokenizer, "id_to_token", None)
        piece = convert(token) if convert is not None else None
        if isinstance(piece, str) and piece:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            if all(ch in _BYTE_LEVEL for ch in piece):
                return bytes(_BYTE_LEVEL[ch] for ch in piece)
        return text.encode("utf-8")


@dataclass
class Entry:
    """One logprob entry: the token, its string and bytes (module docstring), its logprob
    (None: no context) and top alternatives (None with no logprob)."""

    token: int
    text: str
    raw: bytes
    logprob: float | None
    top: Any


@dataclass
class TokenAligner:
    """Per choice: turns tokens (with logprobs) and the text sent so far into the entries to
    report (module docstring). :meth:`push` tokens as they arrive, then :meth:`take` with the
    characters of text sent so far (the echoed prompt included)."""

    token_bytes: TokenBytes
    skip_special: bool = True
    _decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    _queue: list[Entry] = field(default_factory=list)
    _chars: int = 0  # characters of the entries reported so far

    def push(self, tokens: list[int], logprobs: list[float | None], tops: list[Any]) -> None:
        """Tokens in order, with their logprobs and alternatives (same lengths)."""
        for token, lp, top in zip(tokens, logprobs, tops):
            raw = self.token_bytes(token, self.skip_special)
            text = self._decoder.decode(raw)
            self._queue.append(Entry(token, text, raw, lp, top))

    def take(self, text_chars: int, final: bool) -> list[Entry]:
        """The entries whose text lies within the first ``text_chars`` characters; ``final``:
        the text is complete, so the last entry is cut there and the rest dropped (a
        zero-width entry at the very end kept)."""
        out: list[Entry] = []
        if final:
            tail = self._decoder.decode(b"", final=True)  # bytes of an unfinished character
            if tail and self._queue:
                self._queue[-1].text += tail
        while self._queue:
            e = self._queue[0]
            end = self._chars + len(e.text)
            if end <= text_chars:
                out.append(self._queue.pop(0))
                self._chars = end
                continue
            if final and self._chars < text_chars:  # cut by the end of the text
                keep = e.text[:text_chars - self._chars]
                self._queue.pop(0)
                out.append(Entry(e.token, keep, keep.encode("utf-8"), e.logprob, e.top))
                self._chars = text_chars
                continue
            break
        if final:
            self._queue.clear()
        return out
