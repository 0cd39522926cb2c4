"""PNG plots of a comparison (matplotlib, Agg backend: no display needed).

- ``throughput.png``: output tokens/s against concurrency (log2 axis), one line per
  configuration, one panel per workload.
- ``timeline_{config}_{workload}.png`` for each adaptive configuration whose engine reports
  ``stats()``: the steps of the slot in use and the acceptance length over each sampling
  interval against time (seconds since the start of the run, first repetition), one column per
  concurrency; for a mixed workload a third row shows the share of in-flight requests from the
  second prompt set (``hard``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

__all__ = ["plot_comparison"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "x"


def plot_comparison(result: Mapping[str, Any], out_dir: Path) -> dict[str, str]:
    """Write the plots of ``result`` (:func:`specdial.bench.compare.run_comparison`) into
    ``out_dir``; returns ``{name: path}``."""
    plt = _pyplot()
    files: dict[str, str] = {}
    meta = result["meta"]
    workloads = meta["workloads"]
    concs = [k for k in meta["concurrencies"] if isinstance(k, int)]  # ramps have no x position
    configs = result["configs"]
    by = {(e["workload"], e["concurrency"], e["config"]): e for e in result["results"]}

    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for c in configs:
            xs = [k for k in concs if (w, k, c["name"]) in by]
            ys = [by[(w, k, c["name"])]["summary"]["output_throughput"] for k in xs]
            style = {"linewidth": 2.5, "marker": "o"} if c["kind"] == "adaptive" else {
                "linewidth": 1.2, "marker": ".", "linestyle": "--" if c["kind"] == "none"
                else "-"}
            ax.plot(xs, ys, label=c["name"], **style)
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs)
        ax.set_xticklabels([str(k) for k in concs])
        ax.set_xlabel("concurrency (requests)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(w)
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("Output throughput by configuration")
    fig.tight_layout()
    path = out_dir / "throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    files["throughput"] = str(path)

    for c in configs:
        if c["kind"] != "adaptive":
            continue
        for w in workloads:
            entries = [by.get((w, k, c["name"])) for k in concs]
            cols = [(k, e) for k, e in zip(concs, entries) if e and e.get("timeline")]
            if not cols:
                continue
            mixed = any(any(x for x in (e["timeline"].get("other_workload_share") or [])
                            if x) for _, e in cols)
            rows = 3 if mixed else 2
            fig, axes = plt.subplots(rows, len(cols), figsize=(4 * len(cols), 2.4 * rows),
                                     squeeze=False, sharex="col")
            for j, (k, e) in enumerate(cols):
                tl = e["timeline"]
                t = tl["t"]
                steps = [(x, s) for x, s in zip(t, tl["steps"]) if s is not None]
                if steps:
                    axes[0][j].step([x for x, _ in steps], [s for _, s in steps], where="post")
                top = max([7] + [s for _, s in steps])
                axes[0][j].set_ylim(-0.5, top + 0.5)
                axes[0][j].set_yticks(range(0, top + 1))
                axes[0][j].set_title(f"c={k}")
                axes[0][j].set_ylabel("steps" if j == 0 else "")
                acc = [(x, a) for x, a in zip(t, tl["accept_length"]) if a is not None]
                if acc:
                    axes[1][j].plot([x for x, _ in acc], [a for _, a in acc], marker=".",
                                    color="tab:orange")
                axes[1][j].set_ylabel("accept length" if j == 0 else "")
                if mixed:
                    share = [(x, s) for x, s in zip(tl.get("share_t", t),
                                                     tl["other_workload_share"])
                             if s is not None]
                    if share:
                        axes[2][j].fill_between([x for x, _ in share], [s for _, s in share],
                                                step="post", alpha=0.4, color="tab:red")
                    axes[2][j].set_ylim(0, 1)
                    axes[2][j].set_ylabel("hard share" if j == 0 else "")
                axes[rows - 1][j].set_xlabel("time (s)")
                for i in range(rows):
                    axes[i][j].grid(True, alpha=0.3)
            fig.suptitle(f"{c['name']} on {w}: steps and acceptance length over time")
            fig.tight_layout()
            name = f"timeline_{_slug(c['name'])}_{_slug(w)}"
            path = out_dir / f"{name}.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            files[name] = str(path)
    return files
