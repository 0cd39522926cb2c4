"""The OpenAI-compatible server's request lifecycle with the FAKE engine behind a live
uvicorn: a client that disconnects (mid-stream or waiting for a whole answer) aborts its
request; SIGTERM drains running requests, then refuses and stops; the shutdown timeout aborts
what is left; the ``specdial serve`` process path exits cleanly on SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest

from test_server_api import TIMEOUT, error_of, post, wait_for
from test_server_fake_engine import FakeEngine, LiveServer
from timeouts import scaled


# ------------------------------------------------------------------ disconnects
def test_disconnect_mid_stream_aborts_the_request():
    engine = FakeEngine(delay=0.02)
    with LiveServer(engine) as live:
        with httpx.stream("POST", live.url + "/v1/completions", timeout=TIMEOUT,
                          json={"prompt": "x", "max_tokens": 100, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        # the response is closed after one event: the server notices and aborts
        assert wait_for(lambda: engine.aborted == [0]), engine.aborted
        assert wait_for(lambda: engine.stats().running == 0)
        assert post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_disconnect_during_a_non_streaming_request_aborts_it():
    engine = FakeEngine(delay=0.02)
    with LiveServer(engine) as live:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/chat/completions", timeout=httpx.Timeout(scaled(20), read=0.3),
                       json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 100})
        assert wait_for(lambda: engine.aborted == [0]), engine.aborted
        assert wait_for(lambda: engine.stats().running == 0)


# ------------------------------------------------------------------ shutdown
def test_sigterm_drains_running_requests_then_refuses_and_stops():
    engine = FakeEngine(delay=0.01)
    live = LiveServer(engine, shutdown_timeout=10)
    with live:
        events: list[str] = []
        started = threading.Event()

        def streaming():
            with httpx.stream("POST", live.url + "/v1/completions", timeout=TIMEOUT,
                              json={"prompt": "x", "max_tokens": 60, "stream": True}) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        started.set()

        t = threading.Thread(target=streaming)
        t.start()
        assert started.wait(scaled(10))
        live.server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
        assert live.app.state.specdial.draining
        # a request arriving now is refused: 503, or no connection at all once the socket closed
        try:
            r = post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2})
            error_of(r, 503, None, "shutting_down")
        except httpx.TransportError:
            pass
        t.join(scaled(20))
        assert events[-1] == "data: [DONE]"
        text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
        assert len(text) == 60  # finished, not cut
        live.thread.join(scaled(20))
        assert not live.thread.is_alive()
    assert engine.shutdown_calls == [False] and engine.aborted == []


def test_shutdown_timeout_aborts_what_is_left():
    engine = FakeEngine(delay=0.05)
    live = LiveServer(engine, shutdown_timeout=0.3)
    with live:
        def long_request():
            try:
                post(live, "/v1/completions", {"prompt": "x", "max_tokens": 120})
            except httpx.HTTPError:
                pass

        t = threading.Thread(target=long_request)
        t.start()
        assert wait_for(lambda: engine.stats().running == 1)
        live.server.handle_exit(signal.SIGTERM, None)
        live.thread.join(scaled(20))
        assert not live.thread.is_alive()
        t.join(scaled(20))
    assert engine.aborted == [0] and engine.shutdown_calls == [False]


def test_sigterm_to_a_server_process_exits_cleanly(tmp_path):
    """The process path of `specdial serve` (serve_forever), with the fake engine."""
    tests_dir = Path(__file__).resolve().parent
    script = textwrap.dedent(f"""
        import socket, sys
        sys.path.insert(0, {str(tests_dir)!r})
        from test_server_fake_engine import FakeEngine
        from specdial.server.app import create_app
        from specdial.server.launch import make_server, serve_forever
        engine = FakeEngine()
        sock = socket.socket(); sock.bind(("127.0.0.1", 0))
        print(sock.getsockname()[1], flush=True)
        app = create_app(engine)
        server = make_server(app, port=sock.getsockname()[1], log_level="info")
        code = serve_forever(server, sockets=[sock])
        print("exit", code, "shutdown", engine.shutdown_calls, flush=True)
        sys.exit(code)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        url = f"http://127.0.0.1:{port}"

        def healthy():
            try:
                return httpx.get(url + "/health", timeout=scaled(1)).status_code == 200
            except httpx.TransportError:
                return False

        assert wait_for(healthy, scaled(30))
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=scaled(10))
        assert r.json()["choices"][0]["text"] == "abc"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=scaled(30))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "exit 0 shutdown [False]" in out
    assert "Shutting down" in err
