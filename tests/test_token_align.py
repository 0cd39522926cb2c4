"""Issue 25, unit level: logprob token strings join to the text (specdial.engine.token_align),
with the built-in byte-level BPE tokenizer, whose non-ASCII characters span several tokens;
also SGLang's ``output_token_logprobs`` (specdial.engine.output.OutputAccumulator, behind
``/generate`` and the offline Engine) fed chunk by chunk as the engine streams them."""

from __future__ import annotations

import pytest

from specdial.builtin import BUILTIN_DIR
from specdial.detokenize import IncrementalText
from specdial.engine.api import StreamChunk
from specdial.engine.output import OutputAccumulator
from specdial.engine.token_align import TokenAligner, TokenBytes
from specdial.models import load_tokenizer

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


# ------------------------------------------------------------------ SGLang's output lists
def _accumulate(tok, ids: list[int], stop: tuple[str, ...] = (), per_chunk: int = 1):
    """``ids`` streamed to an OutputAccumulator in chunks of ``per_chunk`` tokens, with the
    text deltas the engine's detokenizer sends (characters held back until complete, a stop
    string's possible start held back, the text ending before a matched stop string)."""
    text = IncrementalText(tok, stop)
    out = OutputAccumulator([1], return_logprob=True, decode=lambda t: tok.decode([t]),
                            token_bytes=TokenBytes(tok))
    for i in range(0, len(ids), per_chunk):
        chunk = ids[i:i + per_chunk]
        final = i + per_chunk >= len(ids)
        delta = text.update(ids[:i + per_chunk], final)
        done = final or text.matched is not None
        out.add(StreamChunk(0, delta, chunk, done, {"type": "length"} if done else None,
                            logprobs=[-1.0] * len(chunk), top_logprobs=[[]] * len(chunk)))
        if done:
            break
    return out.result()


@pytest.mark.parametrize("per_chunk", [1, 2, 3])
def test_sglang_entries_of_split_characters_join_to_the_text(tok, per_chunk):
    """Before issue 25's last round each token of a multi-byte character had its lone decode,
    "\\ufffd", as its text in ``output_token_logprobs``."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    r = _accumulate(tok, ids, per_chunk=per_chunk)
    entries = r["meta_info"]["output_token_logprobs"]
    assert r["text"] == TEXT
    assert "".join(t for _, t_id, t in entries) == TEXT
    assert [t_id for _, t_id, _ in entries] == ids
    assert any(t == "" for _, _, t in entries) and not any("\ufffd" in t for _, _, t in entries)
    # alternatives stay each token decoded alone, one list per entry
    assert len(r["meta_info"]["output_top_logprobs"]) == len(entries)


def test_sglang_entries_end_where_a_stop_string_cut_the_text(tok):
    ids = tok.encode("hello 日本語 world, again and again", add_special_tokens=False)
    r = _accumulate(tok, ids, stop=("本語 wo",), per_chunk=2)
    entries = r["meta_info"]["output_token_logprobs"]
    assert r["text"] == "hello 日"
    assert "".join(t for _, _, t in entries) == r["text"]
    assert len(entries) < len(r["output_ids"])


def test_sglang_entries_without_token_bytes_keep_every_token(tok):
    """No tokenizer (``token_bytes`` None): one entry per output token, as before."""
    ids = tok.encode("ab 日本", add_special_tokens=False)
    out = OutputAccumulator([1], return_logprob=True)
    out.add(StreamChunk(0, "", ids, True, {"type": "length"}, logprobs=[-1.0] * len(ids),
                        top_logprobs=[[]] * len(ids)))
    assert [e[1] for e in out.result()["meta_info"]["output_token_logprobs"]] == ids
