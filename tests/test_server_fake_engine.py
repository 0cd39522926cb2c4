"""A FAKE engine for the server tests (no models), the live-server helper, and tests that the
fake honours the serving contract of ``specdial.engine.api``.

``FakeEngine`` is a test double, not an engine: it "generates" the letters ``a..z`` in a cycle
(starting at ``seed % 26`` when a seed is given), ``tokens_per_chunk`` tokens per chunk every
``delay`` seconds, with a character tokenizer (token id = code point, no chat template). It
implements what the server uses of the contract: ``async_stream`` (submission on the first
iteration, :class:`RequestError` / :class:`QueueFullError` before the first chunk, abort when the
consumer stops iterating), ``stream``, ``generate``, ``abort``, ``stats``, ``tokenizer``,
``context_length``, ``flush_cache`` and ``shutdown(drain)``. Its "prefix cache" reports as a
request's ``cached_tokens`` the longest prefix it shares with an earlier prompt, in whole pages
of :data:`FAKE_PAGE` tokens and short of the last prompt token (the engine's rule); ``flush_cache``
forgets the prompts unless a request is live. It records what happened for assertions:
``submitted`` (request id -> prompt ids, sampling params with the fake's defaults filled in,
and ``received``: the params as the server sent them), ``aborted`` (ids aborted because
the consumer went away or ``abort`` was called) and ``shutdown_calls``.

``LiveServer`` runs an app under uvicorn on 127.0.0.1 (a free port) in a background thread.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import string
import threading
import time
from typing import Any, AsyncIterator, Iterator

import pytest

from specdial.engine.api import EngineStats, QueueFullError, RequestError, StreamChunk
from specdial.server.protocol import SAMPLING_EXTRAS
from timeouts import scaled

LETTERS = string.ascii_lowercase
#: Tokens per page of the fake's prefix cache.
FAKE_PAGE = 4
#: Prompts the fake's prefix cache keeps (the most recent ones).
FAKE_CACHE_PROMPTS = 64


class FakeTokenizer:
    """Characters <-> code points; no special tokens, no chat template."""

    eos_token_id = None
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def get_vocab(self) -> dict[str, int]:
        """A sample of the vocabulary: every token is one character."""
        return {chr(i): i for i in range(32, 127)}


class FakeEngine:
    """The test double described in the module docstring.

    ``max_running`` requests generate at once, ``max_queued`` more wait; beyond that
    ``QueueFullError``. ``delay``: seconds between chunks; ``tokens_per_chunk``: tokens per
    chunk (a "verify" accepting ``tokens_per_chunk - 1`` drafts at steps 3). ``gate``: when
    given, a running request makes no chunk until it is set (a test holds requests in place
    by an event, not by a delay it hopes is long enough).
    """

    def __init__(self, *, context_length: int = 256, max_running: int = 8,
                 max_queued: int = 64, delay: float = 0.0, tokens_per_chunk: int = 2,
                 tokenizer: Any = None, gate: threading.Event | None = None) -> None:
        self.tokenizer = FakeTokenizer() if tokenizer is None else tokenizer
        self.context_length = context_length
        self.max_running, self.max_queued = max_running, max_queued
        self.delay, self.tokens_per_chunk, self.gate = delay, tokens_per_chunk, gate
        self.submitted: dict[int, dict[str, Any]] = {}
        self.aborted: list[int] = []
        self.shutdown_calls: list[bool] = []
        self._ids = itertools.count()
        self._abort_requested: set[int] = set()
        self._waiting: set[int] = set()
        self._running: set[int] = set()
        self._closed = False
        self._counts = dict(num_drafts=0, draft_tokens_proposed=0, num_accepted_tokens=0,
                            requests_finished=0, prompt_tokens=0, generation_tokens=0)
        self._per_pos = [0, 0, 0]
        self._seen: list[list[int]] = []  # the fake's prefix cache: earlier prompts
        self.cached_tokens = 0

    def _cached(self, ids: list[int]) -> int:
        """Tokens of ``ids`` the fake's cache holds (class docstring), then remembers ids."""
        best = 0
        for old in self._seen:
            n = 0
            while n < min(len(old), len(ids)) and old[n] == ids[n]:
                n += 1
            best = max(best, n)
        self._seen = [*self._seen[-(FAKE_CACHE_PROMPTS - 1):], list(ids)]  # LRU: load tests
        return min(best, len(ids) - 1) // FAKE_PAGE * FAKE_PAGE

    def flush_cache(self) -> bool:
        """Forget the cached prompts; False (nothing done) while a request is live."""
        if self._running or self._waiting:
            return False
        self._seen.clear()
        return True

    # ---------------------------------------------------------------- validation
    def _submit(self, prompt: str | None, input_ids: list[int] | None,
                sampling_params: dict[str, Any] | None) -> tuple[int, list[int], dict[str, Any]]:
        if self._closed:
            raise RuntimeError("FakeEngine is shut down")
        if (prompt is None) == (input_ids is None):
            raise RequestError("pass exactly one of prompt or input_ids", param="prompt")
        ids = self.tokenizer.encode(prompt) if prompt is not None else list(input_ids or [])
        if not ids:
            raise RequestError("prompt: needs 1+ tokens", param="prompt")
        p = {"max_new_tokens": 128, "temperature": 0.0, "top_p": 1.0, **(sampling_params or {})}
        unknown = set(p) - {"max_new_tokens", "temperature", "top_p", "top_k", "seed",
                            "stop_token_ids", "ignore_eos", *SAMPLING_EXTRAS}
        if unknown:
            raise RequestError(f"unknown sampling params {sorted(unknown)}")
        if p["max_new_tokens"] < 1:
            raise RequestError("max_new_tokens must be >= 1", param="max_new_tokens")
        if p.get("seed") is not None and p["seed"] < 0:
            # no param on purpose: the server must find the field in the message
            raise RequestError("SamplingParams.seed: invalid value; allowed: 0 <= seed < 2**64")
        if len(ids) + p["max_new_tokens"] > self.context_length:
            raise RequestError(f"prompt: {len(ids)} tokens + max_new_tokens "
                               f"{p['max_new_tokens']} exceed context_length "
                               f"{self.context_length}")
        if len(self._waiting) + len(self._running) >= self.max_running + self.max_queued:
            raise QueueFullError(f"{self.max_queued} requests already queued")
        rid = next(self._ids)
        cached = self._cached(ids)
        self.submitted[rid] = {"input_ids": ids, "sampling_params": p,
                               "received": dict(sampling_params or {}), "cached_tokens": cached}
        self._counts["prompt_tokens"] += len(ids)
        self.cached_tokens += cached
        return rid, ids, p

    def _letters(self, p: dict[str, Any]) -> Iterator[int]:
        start = (p.get("seed") or 0) % 26
        for i in itertools.count():
            yield ord(LETTERS[(start + i) % 26])

    # ---------------------------------------------------------------- contract
    async def async_stream(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
                           sampling_params: dict[str, Any] | None = None,
                           stop: list[str] | None = None,
                           whole: bool = False) -> AsyncIterator[StreamChunk]:
        """Generates after submission on the first ``__anext__`` (see the class docstring);
        ``whole`` is allowed and ignored (each chunk comes as it is made, which the contract
        allows), and recorded as ``submitted[rid]["whole"]``."""
        rid, ids, p = self._submit(prompt, input_ids, sampling_params)
        self.submitted[rid]["whole"] = whole
        self._waiting.add(rid)
        finished = False
        try:
            while len(self._running) >= self.max_running:
                await asyncio.sleep(0.005)
            self._waiting.discard(rid)
            self._running.add(rid)
            while self.gate is not None and not self.gate.is_set():
                await asyncio.sleep(0.005)
            made = 0  # tokens yielded so far (an abort chunk's meta counts them, as the engine's)
            for chunk in self._chunks(rid, ids, p, stop or []):
                await asyncio.sleep(self.delay)
                if rid in self._abort_requested:
                    finished = True
                    yield self._abort_chunk(rid, ids, made)
                    return
                finished = chunk.finished
                made += len(chunk.token_ids)
                yield chunk
        finally:
            self._waiting.discard(rid)
            self._running.discard(rid)
            if not finished:
                self.aborted.append(rid)

    def _abort_chunk(self, rid: int, ids: list[int], made: int) -> StreamChunk:
        self.aborted.append(rid)
        return StreamChunk(rid, "", [], True, {"type": "abort", "message": "aborted"},
                           {"prompt_tokens": len(ids), "completion_tokens": made})

    def _chunks(self, rid: int, ids: list[int], p: dict[str, Any],
                stop: list[str]) -> Iterator[StreamChunk]:
        out: list[int] = []
        text, sent, verifies, letters = "", 0, 0, self._letters(p)
        n = p["max_new_tokens"]
        while True:
            new = [next(letters) for _ in range(min(self.tokens_per_chunk, n - len(out)))]
            out += new
            verifies += 1
            self._counts["generation_tokens"] += len(new)
            self._counts["num_drafts"] += 1
            self._counts["draft_tokens_proposed"] += 3
            self._counts["num_accepted_tokens"] += len(new) - 1
            for pos in range(len(new) - 1):
                self._per_pos[pos] += 1
            text = "".join(chr(t) for t in out)
            reason = None
            for s in stop:
                if s in text:
                    text, reason = text[:text.index(s)], {"type": "stop", "matched": s}
                    break
            if reason is None and len(out) >= n:
                reason = {"type": "length", "length": n}
            meta = {"prompt_tokens": len(ids), "completion_tokens": len(out),
                    "cached_tokens": self.submitted[rid]["cached_tokens"],
                    "spec_verify_ct": verifies, "spec_accept_length": len(out) / verifies,
                    "spec_steps_histogram": {3: verifies}}
            if reason is not None:
                self._counts["requests_finished"] += 1
            yield StreamChunk(rid, text[sent:], new, reason is not None, reason, meta)
            sent = len(text)
            if reason is not None:
                return

    def stream(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
               sampling_params: dict[str, Any] | None = None,
               stop: list[str] | None = None) -> Iterator[StreamChunk]:
        rid, ids, p = self._submit(prompt, input_ids, sampling_params)
        yield from self._chunks(rid, ids, p, stop or [])

    def generate(self, prompt: str | None = None, sampling_params: Any = None,
                 input_ids: Any = None) -> dict[str, Any]:
        chunks = list(self.stream(prompt, input_ids=input_ids, sampling_params=sampling_params))
        last = chunks[-1]
        return {"text": "".join(c.text for c in chunks),
                "output_ids": [t for c in chunks for t in c.token_ids],
                "meta_info": {**last.meta_info, "finish_reason": last.finish_reason}}

    def abort(self, request_id: int) -> None:
        self._abort_requested.add(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self._running), queued=len(self._waiting),
                           kv_pages_used=len(self._running) * 2, kv_pages_total=64,
                           steps_per_slot={1: 3, 8: 0}, step_switches=1, preemptions=0,
                           accepted_per_pos=list(self._per_pos), cached_tokens=self.cached_tokens,
                           cached_pages=sum(len(ids) // FAKE_PAGE for ids in self._seen),
                           **self._counts)

    def shutdown(self, drain: bool = True) -> None:
        self.shutdown_calls.append(drain)
        self._closed = True
        if not drain:
            self._abort_requested.update(self._running | self._waiting)


class LiveServer:
    """``create_app(engine)`` under uvicorn on 127.0.0.1:<free port> in a daemon thread.

    Use as a context manager; ``url`` is the base URL, ``server`` the
    :class:`specdial.server.launch.SpecdialServer` (``server.handle_exit(SIGTERM, None)``
    simulates the signal). ``app_options`` go to ``create_app`` (``limits``, ``security``);
    ``connection_limits`` to ``make_server``."""

    def __init__(self, engine: Any, *, name: str = "specdial-default",
                 shutdown_timeout: float = 5.0, connection_limits: Any = None,
                 **app_options: Any) -> None:
        from specdial.server.app import create_app
        from specdial.server.launch import make_server

        self.engine = engine
        self.app = create_app(engine, served_model_name=name, **app_options)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(self.app, host="127.0.0.1", port=self.port,
                                  log_level="warning", shutdown_timeout=shutdown_timeout,
                                  access_log=False, connection_limits=connection_limits)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + scaled(20)
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 20) -> None:
        """Stop the server; ``timeout``: idle-machine seconds for its thread, :func:`scaled`."""
        self.server.should_exit = True
        self.thread.join(scaled(timeout))
        assert not self.thread.is_alive(), "the test server did not stop"

    def __exit__(self, *exc: Any) -> None:
        if self.thread.is_alive():
            self.stop()


# ------------------------------------------------------------------ the fake honours the contract
async def _collect(stream: AsyncIterator[StreamChunk]) -> list[StreamChunk]:
    return [c async for c in stream]


def test_fake_stream_accounting_and_stop():
    engine = FakeEngine()
    chunks = asyncio.run(_collect(engine.async_stream("hi", sampling_params={"max_new_tokens": 5})))
    assert "".join(c.text for c in chunks) == "abcde" and chunks[-1].finished
    assert [c.finished for c in chunks[:-1]] == [False] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == {"type": "length", "length": 5}
    assert chunks[-1].meta_info["completion_tokens"] == 5
    chunks = asyncio.run(_collect(engine.async_stream("hi", stop=["d"])))
    assert "".join(c.text for c in chunks) == "abc"
    assert chunks[-1].finish_reason == {"type": "stop", "matched": "d"}
    assert engine.generate("x", {"max_new_tokens": 3})["text"] == "abc"


def test_fake_errors_before_the_first_chunk_and_abort_on_close():
    engine = FakeEngine(max_running=1, max_queued=0, delay=0.01)

    async def main() -> None:
        stream = engine.async_stream("x", sampling_params={"max_new_tokens": 0})
        with pytest.raises(RequestError) as e:
            await stream.__anext__()
        assert e.value.param == "max_new_tokens"
        first = engine.async_stream("x", sampling_params={"max_new_tokens": 100})
        chunk = await first.__anext__()
        with pytest.raises(QueueFullError):
            await engine.async_stream("y").__anext__()
        await first.aclose()  # the consumer goes away: aborted
        assert engine.aborted == [chunk.request_id]
        assert engine.stats().running == 0

    asyncio.run(main())
