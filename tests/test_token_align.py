"""Issue 25, unit level: logprob token strings join to the text (specdial.server.token_align),
with the built-in byte-level BPE tokenizer, whose non-ASCII characters span several tokens."""

from __future__ import annotations

import pytest

from specdial.builtin import BUILTIN_DIR
from specdial.models import load_tokenizer
from specdial.server.token_align import TokenAligner, TokenBytes

TEXT = "café 日本語 ü, naïve €"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(BUILTIN_DIR / "target")


def aligner(tok, skip_special: bool = True) -> TokenAligner:
    return TokenAligner(TokenBytes(tok), skip_special)


def push(al: TokenAligner, ids: list[int]) -> None:
    al.push(ids, [-1.0] * len(ids), [[]] * len(ids))


def test_split_characters_join_to_the_text(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 4  # the case the issue found
    al = aligner(tok)
    push(al, ids)
    entries = al.take(len(TEXT), final=True)
    assert [e.token for e in entries] == ids
    assert "".join(e.text for e in entries) == TEXT
    assert b"".join(e.raw for e in entries) == TEXT.encode()
    # a token holding the first bytes of a character: "" and its own bytes
    partial = [e for e in entries if not e.text]
    assert partial and all(e.raw and e.raw[0] >= 0x80 for e in partial)


def test_streamed_entries_follow_the_text_sent(tok):
    ids = tok.encode("ab 日本", add_special_tokens=False)
    al = aligner(tok)
    push(al, ids)
    first = al.take(2, final=False)  # "ab" sent so far
    assert "".join(e.text for e in first) == "ab"
    rest = al.take(len("ab 日本"), final=True)
    assert "".join(e.text for e in first + rest) == "ab 日本"
    assert len(first) + len(rest) == len(ids)


def test_a_stop_string_cut_ends_the_entries_with_the_text(tok):
    full = "hello world, again"
    ids = tok.encode(full, add_special_tokens=False)
    al = aligner(tok)
    push(al, ids)
    text = "hello wo"  # a stop string "rld" cut inside a token
    entries = al.take(len(text), final=True)
    assert "".join(e.text for e in entries) == text
    assert entries[-1].raw == entries[-1].text.encode()
    assert len(entries) < len(ids)


def test_special_tokens_are_empty_when_skipped(tok):
    special = tok.all_special_ids[0]
    ids = tok.encode("x", add_special_tokens=False) + [special]
    al = aligner(tok)
    push(al, ids)
    entries = al.take(1, final=True)
    assert [e.token for e in entries] == ids  # the zero-width EOS at the end is kept
    assert entries[-1].text == "" and entries[-1].raw == b""
    al = aligner(tok, skip_special=False)
    push(al, ids)
    text = tok.decode(ids, skip_special_tokens=False)
    assert "".join(e.text for e in al.take(len(text), final=True)) == text


def test_an_unfinished_character_at_the_end(tok):
    ids = tok.encode("日", add_special_tokens=False)[:-1]  # the character's last byte missing
    al = aligner(tok)
    push(al, ids)
    text = tok.decode(ids)  # the tokenizer shows the bytes as U+FFFD
    entries = al.take(len(text), final=True)
    assert "".join(e.text for e in entries) == text
