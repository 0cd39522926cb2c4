"""The grammar backend of structured outputs: xgrammar, a compile cache, a compile thread pool.

Backend choice: **xgrammar** (Apache-2.0; the default of both vLLM and SGLang; a 1.3 MB
manylinux wheel that installs on this CPU-only machine with the torch, transformers, numpy and
pydantic the engine already has). It gives what speculation needs: a per-request
``GrammarMatcher`` whose ``accept_token`` advances over drafts and ``rollback(n)`` undoes
them, and ``fill_next_token_bitmask`` writing an int32 bitmask ``[ceil(V / 32)]`` per row
(bit ``j`` of word ``w`` = token ``32 w + j`` allowed). llguidance (MIT, Rust core) was the
alternative: equally able (its matcher also rolls back), but not the reference systems'
default, and the mask format and tokenizer mapping the users of SGLang / vLLM debug against are
xgrammar's.

Tokenizer mapping: :class:`GrammarBackend` builds xgrammar's ``TokenizerInfo`` from the
engine's Hugging Face tokenizer with the **target's** ``vocab_size`` (the logits' width, which
may exceed the tokenizer's: the extra ids are never allowed) and the engine's EOS ids as the
stop tokens (the grammar's end allows exactly these; the scheduler ends the request there).

Compilation (:meth:`GrammarBackend.submit`) runs on a small thread pool, never on the event
loop or the engine loop: the request waits before the scheduler's queue
(:mod:`specdial.engine.grammar_gate`) until its grammar is ready. Compiled grammars are cached
per backend (one backend per tokenizer and vocabulary: :func:`backend_for`) by
:class:`~specdial.worker.grammar_spec.StructuredSpec` (kind, text, strict), least recently used
first out beyond ``cache_size``; a failed compile is not cached.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable

import xgrammar as xgr

from specdial.worker.grammar_spec import StructuredSpec

__all__ = ["GrammarBackend", "GrammarError", "backend_for", "dead_end", "new_matcher"]


_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


class GrammarError(ValueError):
    """A constraint that does not compile; ``field`` is the API field it came from (the
    server answers 400 with it as ``param``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class GrammarBackend:
    """xgrammar over one tokenizer: ``tokenizer`` (Hugging Face), ``vocab_size`` (the
    target's logits width ``V``), ``stop_token_ids`` (the engine's EOS ids), ``threads``
    (compile threads), ``cache_size`` (compiled grammars kept).

    :meth:`submit` returns a ``Future`` of the compiled grammar; :meth:`compile` compiles in
    the calling thread (tests, offline use); :func:`new_matcher` makes a request's matcher.
    Raises ``ValueError`` for ``threads`` or ``cache_size`` below 1.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], *,
                 threads: int = 2, cache_size: int = 256) -> None:
        if threads < 1 or cache_size < 1:
            raise ValueError(f"GrammarBackend: threads ({threads}) and cache_size "
                             f"({cache_size}) must be >= 1")
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.cache_size = cache_size
        self._cache: OrderedDict[StructuredSpec, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="specdial-grammar")
        #: compiles started (cache misses), for tests and metrics
        self.compiles = 0

    def compile(self, spec: StructuredSpec) -> Any:
        """Compile ``spec`` now (no cache): an ``xgrammar.CompiledGrammar``. Raises
        :class:`GrammarError` naming ``spec.field`` when it does not compile or admits no
        output (no token allowed at its start: :func:`dead_end`)."""
        c = self.compiler
        try:
            if spec.kind == "json_schema":
                compiled = c.compile_json_schema(spec.text, strict_mode=spec.strict)
            elif spec.kind == "json_object":
                compiled = c.compile_json_schema('{"type": "object"}')
            elif spec.kind == "regex":
                compiled = c.compile_regex(spec.text)
            elif spec.kind == "choice":
                compiled = c.compile_grammar(spec.ebnf())
            else:
                compiled = c.compile_grammar(spec.text)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            first = _LOG_PREFIX.sub("", first)  # xgrammar's "[time] file.cc:line: "
            raise GrammarError(spec.field, f"invalid {spec.kind}: {first}") from None
        if dead_end(new_matcher(compiled), self.vocab_size):
            # an empty language (a regex / EBNF with an empty character class): every logit
            # would be masked, a NaN distribution; refused here, a 400 naming the field
            raise GrammarError(spec.field, f"invalid {spec.kind}: it admits no output (no "
                               "token is allowed at its start)")
        return compiled

    def submit(self, spec: StructuredSpec) -> Future:
        """The compiled grammar of ``spec``, from the cache or compiled on the pool (a
        ``Future``; its exception is a :class:`GrammarError`)."""
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                return fut
            self.compiles += 1
            fut = self._pool.submit(self.compile, spec)
            self._cache[spec] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        fut.add_done_callback(lambda f: f.exception() is not None and self._forget(spec, f))
        return fut

    def _forget(self, spec: StructuredSpec, fut: Future) -> None:
        with self._lock:
            if self._cache.get(spec) is fut:
                del self._cache[spec]

def dead_end(matcher: Any, vocab_size: int) -> bool:
    """True when ``matcher`` (an ``xgrammar.GrammarMatcher`` over ``vocab_size`` token ids) has
    not reached its end and allows no token: its grammar has no continuation here (an empty
    character class after some text, or a grammar whose language is empty). xgrammar compiles
    such grammars; masking with them would give every logit ``-inf`` (a NaN distribution).
    Host work: one bitmask fill ``[ceil(V / 32)]``."""
    if matcher.is_terminated():
        return False
    bm = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bm, 0)
    return not bool(bm.any())


def new_matcher(compiled: Any) -> Any:
    """A fresh ``xgrammar.GrammarMatcher`` of ``compiled`` (an ``xgrammar.CompiledGrammar``)
    for one request; it rolls back any number of drafted tokens."""
    return xgr.GrammarMatcher(compiled)

_BACKENDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BACKENDS_LOCK = threading.Lock()


def backend_for(tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]
                ) -> GrammarBackend:
    """The :class:`GrammarBackend` of ``tokenizer`` (made on first use, kept while the
    tokenizer lives), for ``vocab_size`` and ``stop_token_ids``: the cache's tokenizer key."""
    key = (int(vocab_size), tuple(sorted(int(t) for t in stop_token_ids)))
    with _BACKENDS_LOCK:
        per_tok = _BACKENDS.setdefault(tokenizer, {})
        backend = per_tok.get(key)
        if backend is None:
            backend = per_tok[key] = GrammarBackend(tokenizer, key[0], key[1])
        return backend
