"""Issue 25: connection-level limits and the tokenizer endpoints' limits, against a live uvicorn
on 127.0.0.1 with the FAKE engine of test_server_fake_engine.py.

- Header-read timeout (specdial.server.connections): a client that never finishes its headers
  (slowloris: one byte at a time) gets 408 and its connection closed at the timeout, on a new
  connection and on a kept-alive one after a response; a request sent in time is untouched.
- Connection cap: slow-header connections fill ``--max-connections``; a completion then gets
  503 ``too_many_connections`` at once while /health and /metrics still answer 200; when the
  header timeout has closed the slow connections, completions are served again.
- ``/tokenize`` refuses more than ``--max-tokenize-chars`` characters (400 before tokenizing),
  and by default the prompt's character limit; ``/detokenize`` refuses more than
  ``--max-detokenize-tokens`` ids.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from specdial.server.config import ServeConfig
from specdial.server.connections import ConnectionLimits
from specdial.server.limits import ServerLimits
from test_server_fake_engine import FakeEngine, LiveServer
from test_server_hardening import error_of, read_all
from timeouts import scaled

HEADERS = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


def slow_header(port: int) -> socket.socket:
    """A connection that sent the start of its headers and then nothing."""
    s = socket.create_connection(("127.0.0.1", port), timeout=scaled(10))
    s.sendall(HEADERS[:30])
    return s


def test_unfinished_headers_get_408_and_the_connection_closed():
    limits = ConnectionLimits(header_read_timeout_s=0.5)
    with LiveServer(FakeEngine(), connection_limits=limits) as live:
        t0 = time.monotonic()  # before connecting: the server's timer cannot start earlier
        s = slow_header(live.port)
        answer = read_all(s, scaled(10))  # returns when the server closes the connection
        elapsed = time.monotonic() - t0
        s.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert 0.4 < elapsed < scaled(3), elapsed
        # one byte every 0.2 s does not extend the deadline
        s = socket.create_connection(("127.0.0.1", live.port), timeout=scaled(10))
        t0, closed = time.monotonic(), False
        for b in HEADERS:
            try:
                s.sendall(bytes([b]))
            except OSError:
                closed = True
                break
            time.sleep(0.2)
            if time.monotonic() - t0 > scaled(5):
                break
        s.close()
        assert closed, "a slowloris client kept its connection"
        # a request sent in time is served
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       timeout=scaled(30))
        assert r.status_code == 200


def test_an_idle_kept_alive_connection_is_closed_by_the_header_timeout():
    limits = ConnectionLimits(header_read_timeout_s=0.5)
    with LiveServer(FakeEngine(), connection_limits=limits) as live:
        s = socket.create_connection(("127.0.0.1", live.port), timeout=scaled(10))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        s.sendall(b"GET /health HTTP/1.1\r\nHo")  # the next request's headers, never finished
        rest = read_all(s, scaled(10))
        s.close()
        both = first + rest
        assert both.count(b"HTTP/1.1 200") == 1 and b"HTTP/1.1 408" in both, both[:400]
        assert both.index(b"HTTP/1.1 408") > both.index(b'{"status":"ok"}'), both[:400]


def test_slow_clients_fill_the_cap_while_health_answers():
    cap = 20
    limits = ConnectionLimits(header_read_timeout_s=scaled(3.0), max_connections=cap)
    with LiveServer(FakeEngine(), connection_limits=limits) as live:
        slow = [slow_header(live.port) for _ in range(cap)]
        with httpx.Client(base_url=live.url, timeout=scaled(30)) as c:
            t0 = time.monotonic()
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            refused_s = time.monotonic() - t0
            err = error_of(r, 503, "too_many_connections")
            assert "--max-connections" in err["message"]
            assert r.headers.get("connection") == "close"
            assert refused_s < scaled(1), refused_s
            assert c.get("/health").status_code == 200
            assert c.get("/metrics").status_code == 200
        # the header timeout closes the slow connections; the cap frees up
        answers = [read_all(s, scaled(10)) for s in slow]
        for s in slow:
            s.close()
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[:2]
        deadline = time.monotonic() + scaled(5)
        while True:
            r = httpx.post(live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                           timeout=scaled(30))
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert r.status_code == 200, r.text


def test_connection_limits_options():
    cfg = ServeConfig(header_read_timeout=2.5, max_connections=7)
    limits = cfg.connection_limits()
    assert (limits.header_read_timeout_s, limits.max_connections) == (2.5, 7)
    for kw, name in (({"header_read_timeout_s": 0}, "--header-read-timeout"),
                     ({"header_read_timeout_s": float("nan")}, "--header-read-timeout"),
                     ({"max_connections": 0}, "--max-connections"),
                     ({"max_connections": True}, "--max-connections")):
        with pytest.raises(ValueError, match=name):
            ConnectionLimits(**kw)
    for kw, name in (({"max_tokenize_chars": 0}, "--max-tokenize-chars"),
                     ({"max_detokenize_tokens": -1}, "--max-detokenize-tokens")):
        with pytest.raises(ValueError, match=name):
            ServerLimits(**kw)


# ------------------------------------------------------------------ /tokenize and /detokenize
def test_tokenize_refuses_text_beyond_the_character_limit():
    limits = ServerLimits(max_tokenize_chars=100)
    with LiveServer(FakeEngine(), limits=limits) as live:
        post = lambda body: httpx.post(live.url + "/tokenize", json=body,  # noqa: E731
                                       timeout=scaled(30))
        r = post({"prompt": "a" * 100})
        assert r.status_code == 200 and r.json()["count"] == 100
        err = error_of(post({"prompt": "a" * 101}), 400, "text_too_long", "prompt")
        assert "--max-tokenize-chars" in err["message"] and "101" in err["message"]
        error_of(post({"prompt": ["a" * 60, "b" * 60]}), 400, "text_too_long", "prompt")
        error_of(post({"messages": [{"role": "user", "content": "c" * 200}]}), 400,
                 "text_too_long", "messages")


def test_tokenize_defaults_to_the_prompt_character_limit():
    """No --max-tokenize-chars: the prompt's bound (context 256 x 1 character per token of the
    fake tokenizer), so a 3 MB text (issue 25: 7.1 s on the one tokenizer thread) is refused
    before tokenizing."""
    with LiveServer(FakeEngine(context_length=256)) as live:
        ok = httpx.post(live.url + "/tokenize", json={"prompt": "a" * 256}, timeout=scaled(30))
        assert ok.status_code == 200
        r = httpx.post(live.url + "/tokenize", json={"prompt": "a" * 3_000_000},
                       timeout=scaled(30))
        error_of(r, 400, "text_too_long", "prompt")


def test_detokenize_refuses_more_than_the_token_limit():
    limits = ServerLimits(max_detokenize_tokens=50)
    with LiveServer(FakeEngine(), limits=limits) as live:
        post = lambda body: httpx.post(live.url + "/detokenize", json=body,  # noqa: E731
                                       timeout=scaled(30))
        r = post({"tokens": [97] * 50})
        assert r.status_code == 200 and r.json()["text"] == "a" * 50
        err = error_of(post({"tokens": [97] * 51}), 400, "too_many_tokens", "tokens")
        assert "--max-detokenize-tokens" in err["message"]
        error_of(post({"tokens": [[97] * 30, [98] * 30]}), 400, "too_many_tokens", "tokens")
