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
    meta = result["meta"]
    workloads = meta["workloads"]
    concs = [k for k in meta["concurrencies"] if isinstance(k, int)]  # ramps have no x position
    configs = result["configs"]
    by = {(e["workload"], e["concurrency"], e["config"]): e for e in result["results"]}
    files = {"throughput": _plot_throughput(plt, by, workloads, concs, configs, out_dir)}
    for c in configs:
        if c["kind"] != "adaptive":
            continue
        for w in workloads:
            entries = [by.get((w, k, c["name"])) for k in concs]
            cols = [(k, e) for k, e in zip(concs, entries) if e and e.get("timeline")]
            if cols:
                name = f"timeline_{_slug(c['name'])}_{_slug(w)}"
                path = out_dir / f"{name}.png"
                _plot_timeline(plt, cols, f"{c['name']} on {w}", path)
                files[name] = str(path)
    return files


def _plot_throughput(plt: Any, by: Mapping[tuple[str, Any, str], Any], workloads: list[str],
                     concs: list[int], configs: list[Mapping[str, Any]], out_dir: Path) -> str:
    """``throughput.png``: output tokens/s against concurrency, one panel per workload."""
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
    return str(path)


def _plot_timeline(plt: Any, cols: list[tuple[int, Mapping[str, Any]]], title: str,
                   path: Path) -> None:
    """One timeline figure (steps, acceptance length, and for a mixed workload the share of
    the second prompt set) with one column per concurrency in ``cols``, written to ``path``."""
    mixed = any(any(x for x in (e["timeline"].get("other_workload_share") or []) if x)
                for _, e in cols)
    rows = 3 if mixed else 2
    fig, axes = plt.subplots(rows, len(cols), figsize=(4 * len(cols), 2.4 * rows),
                             squeeze=False, sharex="col")
    for j, (k, e) in enumerate(cols):
        _timeline_column([axes[i][j] for i in range(rows)], e["timeline"], k, j == 0, mixed)
    fig.suptitle(f"{title}: steps and acceptance length over time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _timeline_column(axes: list[Any], tl: Mapping[str, Any], conc: int, first: bool,
                     mixed: bool) -> None:
    """The panels of one concurrency: ``axes`` top to bottom (steps, acceptance length, and
    the hard share when ``mixed``); y labels only on the ``first`` column."""
    t = tl["t"]
    steps = [(x, s) for x, s in zip(t, tl["steps"]) if s is not None]
    if steps:
        axes[0].step([x for x, _ in steps], [s for _, s in steps], where="post")
    top = max([7] + [s for _, s in steps])
    axes[0].set_ylim(-0.5, top + 0.5)
    axes[0].set_yticks(range(0, top + 1))
    axes[0].set_title(f"c={conc}")
    axes[0].set_ylabel("steps" if first else "")
    acc = [(x, a) for x, a in zip(t, tl["accept_length"]) if a is not None]
    if acc:
        axes[1].plot([x for x, _ in acc], [a for _, a in acc], marker=".", color="tab:orange")
    axes[1].set_ylabel("accept length" if first else "")
    if mixed:
        share = [(x, s) for x, s in zip(tl.get("share_t", t), tl["other_workload_share"])
                 if s is not None]
        if share:
            axes[2].fill_between([x for x, _ in share], [s for _, s in share], step="post",
                                 alpha=0.4, color="tab:red")
        axes[2].set_ylim(0, 1)
        axes[2].set_ylabel("hard share" if first else "")
    axes[-1].set_xlabel("time (s)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
