"""Start a server process on a port it binds itself: the tests' one race-free way to a port.

Picking a "free port" in the test (bind port 0, read the port, close the socket) and then
starting a server on it races with every other process of the host: one may take the port in
between, and the test then fails to start its server or, worse, talks to someone else's. So
the server binds port 0 itself and keeps it: ``specdial serve --port 0`` lets uvicorn ask the
OS for a free port, and uvicorn's ``Uvicorn running on http://HOST:PORT`` line (log level
``info``) names the port it got; :func:`start_server` reads that line from the process's log
file, then waits for ``/health``. (Of the alternatives, handing the child an already-bound
socket needs a new file-descriptor option in ``specdial serve``, and retrying on
``EADDRINUSE`` still lets a test reach a stranger's server on the port it lost.)
In-process servers (``test_server_fake_engine.LiveServer``) bind port 0 in the test and pass
uvicorn that open socket, which is race-free too.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from timeouts import scaled

__all__ = ["RUNNING_ON", "serve_argv", "start_server"]

#: uvicorn's start-up line; group 1 is the port it listens on.
RUNNING_ON = re.compile(r"Uvicorn running on https?://\S+:(\d+)\b")


def serve_argv(*args: str) -> list[str]:
    """``specdial serve *args --port 0 --log-level info`` with this interpreter's ``specdial``
    (``--port`` and ``--log-level`` must not be in ``args``)."""
    assert "--port" not in args and "--log-level" not in args, args
    exe = Path(sys.executable).with_name("specdial")
    return [str(exe), "serve", *args, "--port", "0", "--log-level", "info"]


def start_server(argv: list[str], log: Path, *, timeout: float = 120,
                 **popen: Any) -> tuple[subprocess.Popen, int]:
    """Start ``argv`` (a server that binds port 0 and logs uvicorn's start-up line, e.g.
    :func:`serve_argv`) with stdout and stderr appended to the file ``log``; return the process
    and its port once ``/health`` on 127.0.0.1 answers 200. ``popen``: more ``Popen``
    arguments (``env``, ``cwd``). ``timeout``: idle-machine seconds (:func:`scaled`). Raises
    ``AssertionError`` with the log's tail when the process exits first or does not become
    healthy in time (the process is killed then)."""
    with log.open("a") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, **popen)
    deadline = time.monotonic() + scaled(timeout)
    port: int | None = None
    try:
        while True:
            assert proc.poll() is None, f"the server exited with {proc.returncode}:\n" + \
                log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not start:\n" + \
                log.read_text()[-3000:]
            if port is None:
                found = RUNNING_ON.search(log.read_text())
                port = int(found.group(1)) if found else None
            if port is not None:
                try:
                    r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=scaled(2))
                    if r.status_code == 200:
                        return proc, port
                except httpx.TransportError:
                    pass
            time.sleep(0.2)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
