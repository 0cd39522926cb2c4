"""Incremental detokenization of one request's output, with stop strings.

:class:`IncrementalText` turns the growing list of output token ids into text deltas whose
concatenation is the decode of the whole output (when the tokenizer's decode of a prefix is a
prefix of the decode of the whole, as for byte-level BPE): each update decodes the whole output
and emits the new suffix, holding back

- a trailing U+FFFD (a multi-byte character whose remaining bytes are in later tokens), and
- with stop strings, the last ``max(len(stop)) - 1`` characters (they could be the start of a
  stop string that later tokens complete), so a stop string is never partly sent.

A matched stop string and everything after it are cut (with ``include_stop``: everything
after it, vLLM's ``include_stop_str_in_output``; nothing is held back then); the request then
finishes with ``{"type": "stop", "matched": <the string>}``. With ``min_tokens`` (vLLM's rule),
no stop string matches before the output holds ``min_tokens`` tokens, and a match must end
after the text of those first tokens. ``skip_special_tokens`` (default True, vLLM's and
SGLang's) leaves special tokens out of the text.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["IncrementalText", "decode", "decoder"]

_REPLACEMENT = "\ufffd"


def decode(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """``tokenizer.decode(ids)``, without special tokens unless ``skip_special_tokens`` is False
    (HF tokenizers and ``tokenizers``)."""
    try:
        return str(tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))
    except TypeError:
        return str(tokenizer.decode(list(ids)))


def _hf_fast_decodes() -> tuple[Any, ...]:
    """The ``_decode`` methods of transformers' fast (``tokenizers``-backed) tokenizer classes
    that this version has (5.x ``TokenizersBackend``, 4.x ``PreTrainedTokenizerFast``)."""
    found = []
    for module, name in (("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
                         ("transformers.tokenization_utils_fast", "PreTrainedTokenizerFast")):
        try:
            cls = getattr(__import__(module, fromlist=[name]), name)
        except (ImportError, AttributeError):
            continue
        found.append(cls._decode)
    return tuple(found)


def decoder(tokenizer: Any, skip_special_tokens: bool = True) -> Any:
    """A function ``ids -> text`` equal to :func:`decode` with these arguments, bound once.

    For a transformers fast tokenizer whose ``decode`` is transformers' own (not overridden)
    and that cleans up no tokenization spaces, it calls the Rust ``tokenizers.Tokenizer``'s
    ``decode`` directly, which is what transformers' ``_decode`` does then: the same text
    without transformers' Python wrapper (``to_py_obj``'s per-id ``isinstance`` checks; ~5x
    the Rust decode's own cost for a 48-token output, BENCHMARKS.md, the section of this
    change). Every other tokenizer goes through :func:`decode`."""
    rust = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    base = next((c for c in cls.__mro__ if c.__name__ == "PreTrainedTokenizerBase"), None)
    if (rust is not None and base is not None and "decode" in vars(base)
            and cls.decode is vars(base)["decode"]
            and getattr(cls, "_decode", None) in _hf_fast_decodes()
            and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False):
        rust_decode = rust.decode
        return lambda ids: rust_decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: decode(tokenizer, ids, skip_special_tokens)


class IncrementalText:
    """Text state of one request. ``tokenizer`` None: every delta is ``""``.

    ``stop``: stop strings (non-empty); ``skip_special_tokens``, ``include_stop`` and
    ``min_tokens`` (output tokens before a stop string may match): the module docstring. After
    :meth:`update` returned a delta with ``matched`` set, the text is final.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), *,
                 skip_special_tokens: bool = True, include_stop: bool = False,
                 min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self._decode = None if tokenizer is None else decoder(tokenizer, skip_special_tokens)
        self.stop = tuple(stop)
        self.skip_special_tokens, self.include_stop = skip_special_tokens, include_stop
        self.min_tokens = min_tokens
        self.hold = 0 if include_stop else max((len(s) for s in self.stop), default=1) - 1
        self.sent = ""  # text already emitted
        self.matched: str | None = None
        self._searched = 0  # stop strings cannot start before this index of the full text
        self._floor: int | None = None  # a match must end after this index (min_tokens)

    def update(self, ids: Sequence[int], final: bool) -> str:
        """New text for the output ``ids`` so far; ``final``: the request ends now (nothing is
        held back). Sets :attr:`matched` when a stop string matched (the delta then ends right
        before it, or right after it with ``include_stop``)."""
        if self.tokenizer is None or self.matched is not None:
            return ""
        full = self._decode(list(ids))
        if self.stop and len(ids) > self.min_tokens:
            if self._floor is None:
                self._floor = (len(self._decode(list(ids[:self.min_tokens])))
                               if self.min_tokens else 0)
            hit = self._find_stop(full)
            if hit is not None:
                assert self.matched is not None
                full, final = full[:hit + (len(self.matched) if self.include_stop else 0)], True
        if not final:
            end = len(full)
            while end > 0 and full[end - 1] == _REPLACEMENT:
                end -= 1
            if self.stop:
                end = max(0, min(end, len(full) - self.hold))
            full = full[:end]
        if full.startswith(self.sent):
            delta = full[len(self.sent):]
        else:  # decode(prefix) is not a prefix of decode(all): emit from where they agree
            common = 0
            for a, b in zip(full, self.sent):
                if a != b:
                    break
                common += 1
            delta = full[common:] if len(full) > len(self.sent) else ""
        if delta:
            self.sent = self.sent + delta if full.startswith(self.sent) else full
        return delta

    def _find_stop(self, full: str) -> int | None:
        start = max(0, self._searched - max(len(s) for s in self.stop) + 1)
        floor = self._floor or 0
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = full.find(s, max(start, floor - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        self._searched = len(full.rstrip(_REPLACEMENT))
        if best is None:
            return None
        self.matched = best[1]
        return best[0]
