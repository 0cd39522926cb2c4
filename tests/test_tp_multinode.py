"""Multi-node tensor parallelism, with two processes on loopback standing in for two nodes:
``--nnodes 2 --node-rank K --dist-init-addr 127.0.0.1:PORT`` (SGLang's flags), and the
parallelism options' validation."""

import subprocess
import sys

import pytest

from specdial.distributed.group import free_port
from specdial.config.parallel import ParallelOptions
from test_tensor_parallel import _save
from timeouts import scaled


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
