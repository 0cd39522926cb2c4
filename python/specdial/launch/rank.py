"""Entry point of a worker rank: ``python -m specdial.launch.rank``.

Arguments (written by :func:`specdial.launch.launcher.rank_command`): ``--config`` (the
:class:`~specdial.distributed.group.DistConfig` as JSON), ``--entry module:function``,
``--args`` (JSON object of keyword arguments) and optionally ``--parent-fd N`` (the read end
of rank 0's watch pipe). The rank joins the group, calls ``function(tp, config, **args)`` and
leaves. When the watch pipe reaches end-of-file (rank 0 is gone) the process exits at once with
status 3, wherever it is. An exception in the entry prints its traceback and exits with 1; a
:class:`~specdial.distributed.group.RankFailure` (a peer is gone) exits with 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import threading
import traceback
from typing import Any, Callable

PARENT_GONE_EXIT = 3
RANK_FAILURE_EXIT = 2


def _watch_parent(fd: int) -> None:
    def run() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        print(f"specdial rank (pid {os.getpid()}): rank 0 is gone, exiting", file=sys.stderr,
              flush=True)
        os._exit(PARENT_GONE_EXIT)

    threading.Thread(target=run, name="specdial-parent-watch", daemon=True).start()


def exit_rank_failure(message: str) -> None:
    """Leave this worker rank now with :data:`RANK_FAILURE_EXIT` (a peer is gone), printing
    ``message``: called from a heartbeat thread, wherever the main thread is (even inside a
    collective that would only time out later)."""
    print(f"specdial rank (pid {os.getpid()}): {message}, exiting", file=sys.stderr, flush=True)
    os._exit(RANK_FAILURE_EXIT)


def resolve_entry(entry: str) -> Callable[..., Any]:
    """``"module:function"`` -> the function; ``ValueError`` naming ``entry`` otherwise."""
    module, sep, name = entry.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"entry must be 'module:function', got {entry!r}")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"entry {entry!r}: {module} has no function {name!r}")
    return fn


def device_problem(device: str, local_index: int) -> str | None:
    """Why a rank cannot run on ``device`` (``"cpu"`` or ``"cuda"``) as local rank
    ``local_index`` (it uses GPU ``local_index``), or None when it can."""
    if device != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return ("--device cuda, but CUDA is not available on this node (no GPU or no CUDA "
                "driver); use --device cpu or run on a node with GPUs")
    count = torch.cuda.device_count()
    if local_index >= count:
        return (f"this rank needs GPU {local_index} but the node has {count} (cuda:0.."
                f"cuda:{count - 1}): --tp-size / --nnodes give each node more ranks than GPUs")
    return None


def main(argv: list[str] | None = None) -> int:
    """Run one worker rank; returns the process exit status."""
    p = argparse.ArgumentParser(prog="python -m specdial.launch.rank")
    p.add_argument("--config", required=True)
    p.add_argument("--entry", required=True)
    p.add_argument("--args", default="{}")
    p.add_argument("--parent-fd", type=int, default=None)
    ns = p.parse_args(argv)
    if ns.parent_fd is not None:
        _watch_parent(ns.parent_fd)
    from specdial.distributed.group import DistConfig, RankFailure, destroy_group, init_group
    config = DistConfig(**json.loads(ns.config))
    missing = device_problem(config.device, config.rank % config.ranks_per_node)
    if missing is not None:  # foreseeable: one line, not a traceback per rank
        print(f"specdial rank {config.rank}: error: {missing}", file=sys.stderr, flush=True)
        return 1
    try:
        fn = resolve_entry(ns.entry)
        tp = init_group(config)
        fn(tp, config, **json.loads(ns.args))
    except RankFailure as e:
        print(f"specdial rank {config.rank}: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # a broken group must not be torn down (its destructor can block on, or abort over,
        # the lost peer): leave now
        os._exit(RANK_FAILURE_EXIT)
    except Exception:  # noqa: BLE001 - a worker rank reports any failure and exits non-zero
        traceback.print_exc()
        return 1
    destroy_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # leave without interpreter finalization: gloo's C++ threads can still be joinable when the
    # interpreter tears down, and std::terminate then turns a clean exit into SIGABRT (seen:
    # "terminate called without an active exception", exit -6, in the two-node test)
    os._exit(code)
