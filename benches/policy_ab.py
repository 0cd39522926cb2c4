"""Per-call cost of the decision's two Python calls for several builds of ``specdial._core``,
loaded side by side in one process (how issue 25's regression was bisected).

Each build is a compiled extension file (``cargo build --release --manifest-path
rust/bindings/Cargo.toml`` at some commit, ``target/release/lib_core.so`` copied away); they are
loaded as ``<tag>._core`` and measured in interleaved rounds. The figure is the minimum over the
rounds of the mean per call (ns): on a shared machine the minimum is the least disturbed round,
so builds compare even under load (the medians of ``benches/policy_py.py`` move with the load).

Usage: .venv/bin/python benches/policy_ab.py old=/path/a.so new=/path/b.so [...] [--rounds 25]
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import time
from types import ModuleType

import numpy as np

CONFIG = {"1": {"candidate_steps": [1, 3, 5, 7], "update_interval": 1, "warmup_batches": 0}}


def load(tag: str, path: str) -> ModuleType:
    """The extension at ``path`` as module ``<tag>._core`` (its init symbol is ``PyInit__core``)."""
    name = f"{tag}._core"
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="+", metavar="TAG=PATH")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--calls", type=int, default=5000)
    args = ap.parse_args()
    builds = {tag: load(tag, path) for tag, path in (b.split("=", 1) for b in args.builds)}
    accepted = np.random.default_rng(0).integers(0, 2, size=64, dtype=np.int64)
    best: dict[str, dict[str, float]] = {t: {"get": float("inf"), "verify": float("inf")}
                                         for t in builds}
    n = args.calls
    for _ in range(args.rounds):
        for tag, m in builds.items():
            p = m.AdaptiveSpeculativeParams(3, m.AdaptiveConfig.from_dict(CONFIG))
            get, verify = p.get_steps_for_batch, p.on_verify_complete
            t0 = time.perf_counter_ns()
            for _ in range(n):
                get(64)
            t1 = time.perf_counter_ns()
            for _ in range(n):
                verify(accepted, 64)
            t2 = time.perf_counter_ns()
            best[tag]["get"] = min(best[tag]["get"], (t1 - t0) / n)
            best[tag]["verify"] = min(best[tag]["verify"], (t2 - t1) / n)
    print(json.dumps({t: {k: round(v) for k, v in b.items()} for t, b in best.items()}))


if __name__ == "__main__":
    main()
