"""Multi-node tensor parallelism, with two processes on loopback standing in for two nodes:
``--nnodes 2 --node-rank K --dist-init-addr 127.0.0.1:PORT`` (SGLang's flags), a rank on
another node that dies during start-up, and the parallelism options' validation."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from specdial.config import DistConfig
from specdial.distributed.group import free_port
from specdial.config.parallel import ParallelOptions
from specdial.launch import launch_ranks
from test_tensor_parallel import _save
from timeouts import scaled

PROBE = "specdial.launch.probe:startup_probe"


def test_two_nodes_on_loopback_match_tp1(tmp_path):
    """tp 2 over 2 "nodes" (one rank each): node 0 runs rank 0 in its own process, node 1
    starts rank 1 and waits for it; logits equal tp 1 (the check's exit status)."""
    model = _save(tmp_path / "m", "llama_gqa")
    addr = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "specdial.launch.check", str(model), "--tp-size", "2",
           "--nnodes", "2", "--dist-init-addr", addr, "--dist-timeout", "120", "--rtol", "1e-5"]
    node1 = subprocess.Popen(cmd + ["--node-rank", "1"])
    node0 = subprocess.run(cmd + ["--node-rank", "0"], capture_output=True, text=True,
                           timeout=scaled(300))
    assert node1.wait(scaled(60)) == 0
    assert node0.returncode == 0, node0.stdout + node0.stderr
    assert "target_extend" in node0.stdout
    assert node0.stdout.strip().splitlines()[-1].startswith("PASS: tp 2 matches tp 1")


def test_parallel_options_validation():
    assert ParallelOptions().distributed is False
    two = ParallelOptions(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert two.dist_config(3).node_rank == 1 and two.dist_config(1).node_rank == 0
    assert ParallelOptions().resolve_addr().startswith("127.0.0.1:")
    for bad, field in ((dict(tp_size=0), "tp_size"), (dict(dp_size=True), "dp_size"),
                       (dict(tp_size=3, nnodes=2, dist_init_addr="a:1"), "multiple of nnodes"),
                       (dict(nnodes=2, tp_size=2), "dist_init_addr"),
                       (dict(node_rank=1), "node_rank"), (dict(dist_timeout=-1), "dist_timeout"),
                       (dict(dist_init_addr="x"), "dist_init_addr"),
                       (dict(dp_size=2, nnodes=2, tp_size=2, dist_init_addr="a:1"), "dp_size")):
        with pytest.raises(ValueError, match=field):
            ParallelOptions(**bad)


def test_a_rank_on_another_node_that_dies_during_startup_fails_it_within_dist_timeout(tmp_path):
    """Issue 25: rank 1 stands for a rank on another node (rank 0 holds no process handle of
    it) and is SIGKILLed while it "loads", before the start-up barrier. Rank 0's barrier fails
    naming the rank and the cause (its heartbeat stopped) within ``dist_timeout`` plus slack,
    long before the start-up timeout (it used to wait for that: 600 s)."""
    timeout_s = 3.0
    config = DistConfig(tp_size=2, rank=0, init_addr=f"127.0.0.1:{free_port()}",
                        timeout_s=timeout_s, startup_timeout_s=600.0)
    bound = scaled(timeout_s + 5.0)
    assert bound < config.startup_s / 4  # "well before the start-up timeout"
    args = {"out_dir": str(tmp_path), "load_s": 3600.0}
    node0 = launch_ranks(config, [0], PROBE, args, stderr=subprocess.PIPE)
    node1 = launch_ranks(config, [1], PROBE, args, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + scaled(60)
        while not all((tmp_path / f"ready.{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline, "the ranks did not form the group"
            assert node0.failed() is None and node1.failed() is None
            time.sleep(0.05)
        os.kill(node1.procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        code = node0.procs[0].wait(bound)
        waited = time.monotonic() - t0
        report = json.loads((tmp_path / "report.json").read_text())
        assert code == 2 and not report["ok"], report
        assert "start-up barrier 'loaded'" in report["error"], report
        assert "worker rank 1 stopped its heartbeat" in report["error"], report
        assert waited >= timeout_s * 0.5, waited  # by the heartbeat's silence, not sooner
    finally:
        node0.close(grace_s=2)
        node1.close(grace_s=2)


def test_a_local_rank_that_dies_during_startup_fails_it_at_once(tmp_path):
    """The same on node 0: rank 0 (this process) started rank 1, so the start-up barrier sees
    its exit (the signal named) within a poll; no heartbeat is passed, so nothing else could
    have noticed it."""
    from specdial.distributed import RankFailure, init_group
    from specdial.distributed.group import destroy_group
    from specdial.distributed.liveness import startup_barrier
    config = DistConfig(tp_size=2, rank=0, init_addr=f"127.0.0.1:{free_port()}",
                        timeout_s=60.0, startup_timeout_s=600.0)
    with launch_ranks(config, [1], PROBE, {"out_dir": str(tmp_path), "load_s": 3600.0},
                      stderr=subprocess.DEVNULL) as procs:
        tp = init_group(config, procs.failed)
        try:
            deadline = time.monotonic() + scaled(60)
            while not (tmp_path / "ready.1").exists():
                assert time.monotonic() < deadline and procs.failed() is None
                time.sleep(0.05)
            os.kill(procs.procs[1].pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(RankFailure, match=r"barrier 'loaded' failed: worker rank 1 "
                                                  r"\(pid \d+\) exited with signal 9"):
                startup_barrier(tp, "loaded", procs.failed)
            assert time.monotonic() - t0 < scaled(5.0)
        finally:
            destroy_group()
