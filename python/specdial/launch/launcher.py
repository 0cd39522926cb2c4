"""Start worker ranks as fresh interpreters and watch them.

Rank 0 (the process that owns the scheduler, or a test) calls :func:`launch_ranks` to start the
other ranks of its node as ``python -m specdial.launch.rank`` subprocesses: fresh
interpreters, so nothing is re-imported from the caller's ``__main__`` (multiprocessing's
spawn does that, which breaks plain scripts) and nothing is forked after torch has started its
threads. Each child gets the read end of a pipe whose write end only rank 0 holds; when rank 0
exits, for any reason, the pipe closes and the child exits at once (even inside a collective).
:class:`RankProcesses` tells rank 0 when a child has died, and stops them all on close.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import Any

from specdial.distributed.group import DistConfig

__all__ = ["RankProcesses", "launch_ranks", "rank_command"]

ENTRY_MODULE = "specdial.launch.rank"


def rank_command(config: DistConfig, entry: str, args: dict[str, Any],
                 parent_fd: int | None = None, python: str | None = None) -> list[str]:
    """The argv that runs rank ``config.rank``: ``python -m specdial.launch.rank ...``.

    ``entry``: ``"module:function"`` called on the rank as ``function(tp, config, **args)``
    (``args`` must be JSON-serialisable). ``parent_fd``: the pipe fd to watch (None: none, e.g.
    a rank started by hand on another node).
    """
    argv = [python or sys.executable, "-m", ENTRY_MODULE,
            "--config", json.dumps(dataclasses.asdict(config)),
            "--entry", entry, "--args", json.dumps(args)]
    if parent_fd is not None:
        argv += ["--parent-fd", str(parent_fd)]
    return argv


class RankProcesses:
    """The worker ranks one node's rank 0 (or node leader) started.

    ``procs``: rank -> ``subprocess.Popen``. Closing (or leaving the ``with`` block) stops them:
    the watch pipe is closed first (they exit on their own), then stragglers get SIGTERM and,
    after ``grace_s``, SIGKILL.
    """

    def __init__(self, procs: dict[int, subprocess.Popen], watch_fd: int | None) -> None:
        self.procs = procs
        self._watch_fd = watch_fd

    def failed(self) -> str | None:
        """A sentence naming the first rank that has exited (with its exit status), or None
        while all are alive."""
        for rank, p in sorted(self.procs.items()):
            code = p.poll()
            if code is not None:
                how = f"signal {-code}" if code < 0 else f"exit status {code}"
                return f"worker rank {rank} (pid {p.pid}) exited with {how}"
        return None

    def close(self, grace_s: float = 5.0, exit_first_s: float = 0.0) -> None:
        """Stop every rank (idempotent). Returns when all have exited. ``exit_first_s``:
        seconds to let ranks that were told to stop (a shutdown message) exit on their own
        before the watch pipe is closed."""
        deadline = time.monotonic() + exit_first_s
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        if self._watch_fd is not None:
            os.close(self._watch_fd)
            self._watch_fd = None
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> "RankProcesses":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def launch_ranks(base: DistConfig, ranks: Iterable[int], entry: str, args: dict[str, Any],
                 *, python: str | None = None, stdout: Any = None,
                 stderr: Any = None) -> RankProcesses:
    """Start one subprocess per rank in ``ranks`` with ``base``'s settings (``base.rank`` is
    replaced by each rank) running ``entry`` (see :func:`rank_command`).

    ``stdout`` / ``stderr``: as for ``subprocess.Popen`` (None: inherit, so a rank's traceback
    reaches the caller's log). Returns at once; the ranks rendezvous with the caller's
    :func:`~specdial.distributed.group.init_group`. Raises ``ValueError`` for a rank outside
    this node, ``OSError`` when a process cannot start (those already started are stopped).
    """
    read_fd, write_fd = os.pipe()  # both non-inheritable; pass_fds passes the read end only
    procs: dict[int, subprocess.Popen] = {}
    try:
        for rank in ranks:
            config = dataclasses.replace(base, rank=rank)
            procs[rank] = subprocess.Popen(
                rank_command(config, entry, args, read_fd, python), pass_fds=(read_fd,),
                stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr)
    except BaseException:
        RankProcesses(procs, write_fd).close(grace_s=1.0)
        raise
    finally:
        os.close(read_fd)
    return RankProcesses(procs, write_fd)
