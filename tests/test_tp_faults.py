"""Tensor-parallel faults: a rank that dies or hangs is a clear error within ``dist_timeout``,
and worker ranks exit when rank 0 is gone. Ranks are fresh interpreters running
:func:`specdial.launch.probe.collective_probe` in a loop."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from specdial.config import DistConfig
from specdial.launch import launch_ranks
from specdial.distributed.group import free_port
from timeouts import scaled

PROBE = "specdial.launch.probe:collective_probe"


def _wait_for(predicate, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _start(tmp_path, timeout_s):
    config = DistConfig(tp_size=2, rank=0, init_addr=f"127.0.0.1:{free_port()}",
                        timeout_s=timeout_s)
    procs = launch_ranks(config, range(2), PROBE,
                         {"out_dir": str(tmp_path), "iters": 100000, "pause_s": 0.01},
                         stderr=subprocess.PIPE)
    _wait_for(lambda: all((tmp_path / f"ready.{r}").exists() for r in range(2)), scaled(120),
              "both ranks to form the group")
    return procs


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_dead_or_hung_rank_is_an_error_within_the_timeout(tmp_path, fault):
    """SIGKILL (dies) or SIGSTOP (hangs) rank 1 mid-loop: rank 0's all-reduce raises
    RankFailure naming the collective and the timeout, within ``dist_timeout`` (plus start-up
    slack), and rank 0 exits with status 2."""
    timeout_s = 4.0
    procs = _start(tmp_path, timeout_s)
    try:
        victim, rank0 = procs.procs[1], procs.procs[0]
        os.kill(victim.pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        t0 = time.monotonic()
        code = rank0.wait(timeout_s + scaled(30))
        waited = time.monotonic() - t0
        report = json.loads((tmp_path / "report.json").read_text())
        assert code == 2 and not report["ok"], report
        assert "all_reduce on rank 0 of 2 failed" in report["error"]
        assert "a peer rank died or hung" in report["error"]
        assert f"dist_timeout {timeout_s:g}s" in report["error"]
        assert waited < timeout_s + scaled(10), waited
        if fault == "hung":  # gloo waits for the peer until the deadline, not longer
            assert report["elapsed_s"] >= timeout_s * 0.5, report
    finally:
        if fault == "hung":
            os.kill(procs.procs[1].pid, signal.SIGCONT)
        procs.close(grace_s=2)
    assert "rank 0: tensor-parallel all_reduce" in procs.procs[0].stderr.read().decode()


def test_worker_ranks_exit_when_rank0_dies(tmp_path):
    """A parent that launched a worker rank is SIGKILLed: the worker (blocked in the
    rendezvous, waiting for a rank 0 that never comes) exits within seconds (its watch pipe
    closed), with status 3, long before its 60 s timeout."""
    script = (
        "import sys, time\n"
        "from specdial.config import DistConfig\n"
        "from specdial.launch import launch_ranks\n"
        "from specdial.distributed.group import free_port\n"
        "cfg = DistConfig(tp_size=2, rank=0, init_addr=f'127.0.0.1:{free_port()}', timeout_s=60)\n"
        "p = launch_ranks(cfg, [1], 'specdial.launch.probe:idle', {})\n"
        "print(p.procs[1].pid, flush=True)\n"
        "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        child = int(parent.stdout.readline())
        time.sleep(1.0)
        os.kill(child, 0)  # alive while the parent is
        parent.kill()
        parent.wait()
        t0 = time.monotonic()

        def gone():
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return True
            # a zombie of the killed parent is reaped by init; check its state
            with open(f"/proc/{child}/stat") as f:
                return f.read().split(")")[1].split()[0] == "Z"
        _wait_for(gone, scaled(15), "the worker rank to exit")
        assert time.monotonic() - t0 < scaled(15)
    finally:
        parent.kill()


def test_rendezvous_fails_fast_when_a_worker_dies_at_startup(tmp_path):
    """A worker rank that cannot start (bad entry) fails rank 0's rendezvous at once, naming
    the rank and its exit status, instead of after the timeout."""
    from specdial.distributed import RankFailure, init_group
    from specdial.distributed.group import destroy_group
    config = DistConfig(tp_size=2, rank=0, init_addr=f"127.0.0.1:{free_port()}", timeout_s=scaled(60))
    with launch_ranks(config, [1], "specdial.launch.probe:no_such_entry", {},
                      stderr=subprocess.DEVNULL) as procs:
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match="worker rank 1 .* exited with exit status 1"):
            init_group(config, procs.failed)
        assert time.monotonic() - t0 < scaled(30)
    destroy_group()


@pytest.mark.parametrize("diverge_at", [None, 2])
def test_leader_channel_and_divergence_check(tmp_path, diverge_at):
    """Rank 0 leads iterations over the channel; a rank that computes a different value is
    caught by ``check_same`` on every rank (RankDivergence naming the step)."""
    config = DistConfig(tp_size=2, rank=0, init_addr=f"127.0.0.1:{free_port()}", timeout_s=scaled(30))
    with launch_ranks(config, range(2), "specdial.launch.probe:channel_probe",
                      {"out_dir": str(tmp_path), "steps": 5, "diverge_at": diverge_at}) as procs:
        assert [p.wait(scaled(120)) for p in procs.procs.values()] == [0, 0]
    report = json.loads((tmp_path / "report.json").read_text())
    if diverge_at is None:
        assert report == {"steps": 5}
    else:
        assert report["error"].startswith("RankDivergence: tensor-parallel ranks disagree on "
                                          "step 2")


@pytest.mark.parametrize("skew_at", [None, 3])
def test_mirrored_calls_replay_on_worker_ranks(tmp_path, skew_at):
    """Rank 0's mirrored calls run in order on the worker rank (state included: a reset is
    replayed); a worker whose result differs is caught at that call, after which calls fail
    at once (no collective) except the local-only bookkeeping."""
    config = DistConfig(tp_size=2, rank=0, init_addr=f"127.0.0.1:{free_port()}", timeout_s=scaled(30))
    with launch_ranks(config, range(2), "specdial.launch.probe:mirror_probe",
                      {"out_dir": str(tmp_path), "values": [1, 2, 3, 4],
                       "skew_at": skew_at}) as procs:
        assert [p.wait(scaled(120)) for p in procs.procs.values()] == [0, 0]
    report = json.loads((tmp_path / "report.json").read_text())
    if skew_at is None:
        assert report == {"totals": [2, 6, 12, 20, 0]}
    else:
        assert "disagree on the result of add" in report["error"]
        # once failed: no more collectives (a call raises at once, bookkeeping runs locally)
        assert report["after"].startswith("RankFailure: tensor-parallel ranks disagree")
        assert report["failure"] in report["error"]


def test_startup_timeout_is_validated_and_never_below_dist_timeout():
    base = dict(tp_size=2, rank=0, init_addr="127.0.0.1:5000")
    for bad in (0, -1.0, "600", None):
        with pytest.raises(ValueError, match="startup_timeout_s must be a positive number"):
            DistConfig(**base, startup_timeout_s=bad)
    assert DistConfig(**base, timeout_s=5.0).startup_s == 600.0
    assert DistConfig(**base, timeout_s=900.0, startup_timeout_s=30).startup_s == 900.0
