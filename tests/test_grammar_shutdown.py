"""Issue 31: a request held while its grammar compiles is answered when the engine stops.

The compile is patched to block on an event (only for this file's regexes, each test its own so
the compile cache never answers), so the request is certainly held before the scheduler's queue
when the shutdown comes (:mod:`specdial.engine.inbox`):

- ``shutdown(drain=False)``: the held request ends at once with the shutdown end (``abort``,
  cause ``shutdown``), beside a live request aborted the same way; nothing hangs; every KV page
  is free;
- ``shutdown(drain=True)``: the held request counts as accepted: the shutdown waits for its
  compile, then it runs to a normal finish (valid under its regex), and only then does the
  loop stop;
- a held request whose consumer left (a stream closed) is not waited for by a drain;
- a loop that fails ends a held request with the failed end (``error``).
"""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

import pytest

from specdial.engine import Engine
from specdial.engine.ends import end_kind
from specdial.engine.messages import Crash
from specdial.worker.grammar import GrammarBackend

from timeouts import scaled

KW = dict(max_running_requests=4, kv_cache_tokens=1024, page_size=8, log_interval_s=None,
          speculative_num_steps=2)


class BlockedCompiles:
    """``GrammarBackend.compile`` patched: a regex in ``blocked`` waits for ``release``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *regexes: str) -> None:
        self.blocked, self.started, self.release = set(regexes), threading.Event(), \
            threading.Event()
        original = GrammarBackend.compile

        def compile(backend: GrammarBackend, spec: Any) -> Any:
            if spec.text in self.blocked:
                self.started.set()
                self.release.wait(scaled(60))
            return original(backend, spec)

        monkeypatch.setattr(GrammarBackend, "compile", compile)


def _in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, list]:
    got: list = []

    def run() -> None:
        try:
            got.append(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            got.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, got


def _pages_free(engine: Engine) -> bool:
    s = engine.stats()
    return s.kv_pages_used == 0 and s.running == 0 and s.queued == 0


def test_shutdown_without_drain_ends_a_held_request_with_the_shutdown_end(monkeypatch):
    regex = "held-nodrain[0-9]{3}"
    blocked = BlockedCompiles(monkeypatch, regex)
    e = Engine(model_path=None, **KW)
    try:
        held_t, held = _in_thread(e.generate, "x", {"max_new_tokens": 8, "regex": regex})
        live_t, live = _in_thread(e.generate, "y", {"max_new_tokens": 900,
                                                    "ignore_eos": True})
        assert blocked.started.wait(scaled(30))
        held_spec(e)
        while e.stats().running == 0:  # the unconstrained one decodes
            assert live_t.is_alive(), live
            live_t.join(0.01)
        shut_t, _ = _in_thread(e.shutdown, drain=False)
        for t in (shut_t, held_t, live_t):
            t.join(scaled(30))
            assert not t.is_alive(), "shutdown(drain=False) left a request unanswered"
        reason = held[0]["meta_info"]["finish_reason"]
        assert end_kind(reason) == "shutdown" and held[0]["output_ids"] == [], reason
        assert end_kind(live[0]["meta_info"]["finish_reason"]) == "shutdown"
        assert _pages_free(e)
    finally:
        blocked.release.set()
        e.shutdown(drain=False)


def test_a_draining_shutdown_waits_for_a_held_request_and_runs_it(monkeypatch):
    regex = "held-drain[0-9]{3}"
    blocked = BlockedCompiles(monkeypatch, regex)
    e = Engine(model_path=None, **KW)
    try:
        held_t, held = _in_thread(e.generate, "x", {"max_new_tokens": 16, "regex": regex})
        assert blocked.started.wait(scaled(30))
        held_spec(e)  # the loop holds it (its Submit came before the Shutdown)
        shut_t, _ = _in_thread(e.shutdown, drain=True)
        shut_t.join(0.5)
        assert shut_t.is_alive() and held_t.is_alive(), "the drain did not wait"
        blocked.release.set()
        for t in (held_t, shut_t):
            t.join(scaled(60))
            assert not t.is_alive()
        out = held[0]
        assert end_kind(out["meta_info"]["finish_reason"]) == "finished", out
        assert re.fullmatch(regex, out["text"]), out["text"]
        assert _pages_free(e)
    finally:
        blocked.release.set()
        e.shutdown(drain=False)


def test_a_drain_does_not_wait_for_a_held_request_whose_stream_was_closed(monkeypatch):
    regex = "held-cancel[0-9]{3}"
    blocked = BlockedCompiles(monkeypatch, regex)
    e = Engine(model_path=None, **KW)

    async def scenario() -> None:
        chunks = e.async_stream(input_ids=[1, 2, 3],
                                sampling_params={"max_new_tokens": 8, "regex": regex})
        first = asyncio.ensure_future(chunks.__anext__())  # submits, waits for a chunk
        await asyncio.to_thread(held_spec, e)
        first.cancel()  # the consumer leaves while the grammar compiles: a Cancel
        with pytest.raises(asyncio.CancelledError):
            await first
        await chunks.aclose()

    try:
        asyncio.run(scenario())
        shut_t, _ = _in_thread(e.shutdown, drain=True)
        shut_t.join(scaled(30))
        assert not shut_t.is_alive(), "a drain waited for a cancelled held request"
        assert not e._loop.held
    finally:
        blocked.release.set()
        e.shutdown(drain=False)


def held_spec(engine: Engine) -> Any:
    """The one request the loop holds."""
    loop = engine._loop
    for _ in range(int(scaled(3000))):
        if loop.held:
            return next(iter(loop.held))
        threading.Event().wait(0.01)
    raise AssertionError("no request was held")


def test_a_failed_loop_ends_a_held_request_with_the_failed_end(monkeypatch):
    regex = "held-crash[0-9]{3}"
    blocked = BlockedCompiles(monkeypatch, regex)
    e = Engine(model_path=None, **KW)
    try:
        held_t, held = _in_thread(e.generate, "x", {"max_new_tokens": 8, "regex": regex})
        assert blocked.started.wait(scaled(30))
        held_spec(e)  # held now
        e._loop.post(Crash("injected loop death"))
        held_t.join(scaled(30))
        assert not held_t.is_alive(), "a failed loop left a held request unanswered"
        reason = held[0]["meta_info"]["finish_reason"]
        assert end_kind(reason) == "failed" and "injected loop death" in reason["message"]
        blocked.release.set()  # its later submit is dropped, not answered twice
    finally:
        blocked.release.set()
        e.shutdown(drain=False)
