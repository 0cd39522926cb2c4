"""A ``steps_schedule`` for tests/test_dp_processes.py, sent to replica processes by reference
(module and name): it blocks the engine loop of data-parallel replica 1 (a device pass that
never returns, simulated) once the file named by ``$SPECDIAL_TEST_STALL_FLAG`` exists; every
other call answers 2 steps."""

from __future__ import annotations

import os
import sys
import time

FLAG = "SPECDIAL_TEST_STALL_FLAG"


def _dp_rank() -> int | None:
    argv = sys.argv
    return int(argv[argv.index("--dp-rank") + 1]) if "--dp-rank" in argv else None


def stall_replica_1(iteration: int, running: int) -> int:
    """2 steps; replica 1 blocks for an hour once the flag file exists."""
    flag = os.environ.get(FLAG)
    if _dp_rank() == 1 and flag and os.path.exists(flag):
        time.sleep(3600)
    return 2
