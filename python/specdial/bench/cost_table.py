"""``specdial bench cost-table``: measure this machine's decode-iteration cost surface with the
engine's real path and save it as the cost-table JSON that ``specdial policy simulate --curve
FILE`` and ``specdial policy replay --cost-table FILE`` read (:class:`specdial._core.CostTable`).

Per context length (``--contexts``, prompt tokens per request) it times every steps value of
``--steps`` at every batch size of ``--batch-sizes`` (:func:`specdial.profiling.profile_decode`).
The engine options are those of ``specdial serve``; the speculation options are set here (an
adaptive config whose one slot offers every steps value measured).
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdial.engine.args import EngineArgs


@dataclass
class CostTableConfig(EngineArgs):
    """Options of ``specdial bench cost-table`` (besides the engine options)."""

    out: str = field(default="cost_table.json", metadata={"help": "the cost-table JSON to write",
                                                            "metavar": "FILE"})
    batch_sizes: str = field(default="1,2,4,8,16,32,64", metadata={
        "help": "comma-separated batch sizes", "metavar": "LIST"})
    steps: str = field(default="0,1,2,3,4,5,6,7", metadata={
        "help": "comma-separated steps values", "metavar": "LIST"})
    contexts: str = field(default="128", metadata={
        "help": "comma-separated prompt lengths per request, tokens", "metavar": "LIST"})
    n_warmup: int = field(default=2, metadata={"help": "untimed iterations per point",
                                               "metavar": "N"})
    n_measure: int = field(default=5, metadata={"help": "timed iterations per point",
                                                "metavar": "N"})
    max_running_requests: int | None = field(default=None, metadata={  # type: ignore[assignment]
        "help": "most requests decoded together; default: the largest --batch-sizes",
        "metavar": "N"})


def _ints(text: str, what: str, low: int) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < low:
        raise ValueError(f"{what}: expected integers >= {low}, got {text!r}")
    return out


def run_cost_table(cfg: CostTableConfig) -> dict[str, Any]:
    """Builds the engine, measures, writes ``cfg.out`` and returns the table. Raises
    ``ValueError`` for bad lists (naming the option) and what the Engine raises."""
    from specdial.engine import Engine
    from specdial.profiling import cost_table

    sizes = _ints(cfg.batch_sizes, "--batch-sizes", 1)
    steps = _ints(cfg.steps, "--steps", 0)
    contexts = _ints(cfg.contexts, "--contexts", 1)
    if cfg.n_warmup < 0 or cfg.n_measure < 1:
        raise ValueError("--n-warmup must be >= 0 and --n-measure >= 1")
    cfg.configure_process()
    kw = cfg.engine_kwargs()
    kw.update(speculative_adaptive=True, speculative_num_steps=None,
              speculative_adaptive_config={"strategy": "goodput", "1": {"candidate_steps": steps}},
              max_running_requests=max(cfg.max_running_requests or 0, max(sizes)))
    kw.pop("record_trace", None)
    started = time.time()
    engine = Engine(**kw)
    try:
        points = []
        grid = [(ctx, k, bs) for ctx in contexts for k in steps for bs in sizes]
        # one point at a time, so the bar (on stderr) moves and estimates
        # the time left; each point is measured alike either way (its own prefill and passes)
        with tqdm(grid, desc="cost table", unit="point", file=sys.stderr) as bar:
            for ctx, k, bs in bar:
                bar.set_postfix_str(f"context {ctx}, steps {k}, batch {bs}")
                points += engine.profile_costs([bs], [k], n_warmup=cfg.n_warmup,
                                               n_measure=cfg.n_measure, seq_len=ctx)
    finally:
        engine.shutdown()
    import torch

    device = (f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} "
              "torch threads)") if engine.device.type == "cpu" else torch.cuda.get_device_name()
    table = cost_table(points, device=device, model=str(kw.get("model_path") or "specdial-default"),
                       graph_bs=engine.cuda_graph_bs)
    table["measured"] = {"started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
                         "n_warmup": cfg.n_warmup, "n_measure": cfg.n_measure,
                         "contexts": contexts}
    Path(cfg.out).write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    return table
