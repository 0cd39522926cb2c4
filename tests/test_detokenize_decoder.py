""":func:`specdial.detokenize.decoder` (issue 32's host cuts): the bound decode that skips
transformers' Python wrapper gives exactly ``tokenizer.decode``'s text, for random ids
(special tokens included) with and without ``skip_special_tokens``; tokenizers it cannot prove
equal (clean-up of tokenization spaces, an overridden ``decode``, a bare ``tokenizers``
tokenizer) take the general path."""

from __future__ import annotations

import copy
import random

import pytest
from transformers import AutoTokenizer

from specdial.builtin import builtin_model_path
from specdial.detokenize import IncrementalText, decode, decoder


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(builtin_model_path("target"))


def _is_direct(fn) -> bool:
    return "rust_decode" in fn.__code__.co_freevars


def _random_ids(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(rng.randrange(0, 64))]


def test_direct_decode_equals_the_tokenizers_decode(tok):
    rng = random.Random(0)
    vocab = len(tok)
    specials = list(tok.all_special_ids)
    for skip in (True, False):
        fn = decoder(tok, skip)
        assert _is_direct(fn)
        for _ in range(500):
            ids = _random_ids(rng, vocab) + rng.sample(specials, min(2, len(specials)))
            rng.shuffle(ids)
            assert fn(ids) == tok.decode(ids, skip_special_tokens=skip) == decode(tok, ids, skip)


def test_tokenizers_it_cannot_prove_equal_take_the_general_path(tok):
    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True
    assert not _is_direct(decoder(cleaning))

    class Overridden(type(tok)):
        def decode(self, ids, **kwargs):  # noqa: D102 - a subclass with its own decode
            return "x" * len(ids)

    odd = copy.copy(tok)
    odd.__class__ = Overridden
    fn = decoder(odd)
    assert not _is_direct(fn) and fn([1, 2, 3]) == "xxx"
    bare = tok.backend_tokenizer  # a tokenizers.Tokenizer
    assert not _is_direct(decoder(bare))
    assert decoder(bare)([5, 6, 7]) == bare.decode([5, 6, 7])


def test_incremental_text_uses_it_and_joins_to_the_whole_decode(tok):
    rng = random.Random(1)
    ids = [rng.randrange(len(tok)) for _ in range(80)]
    text = IncrementalText(tok)
    parts = [text.update(ids[:n], final=n == len(ids)) for n in range(1, len(ids) + 1)]
    assert "".join(parts) == tok.decode(ids, skip_special_tokens=True)
