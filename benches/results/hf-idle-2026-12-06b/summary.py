"""Print the idle pairs' table: median paired ratio to transformers (process CPU time) and the
acceptance length, per run and arm, and the median over runs per side."""
import json
import pathlib
import statistics

HERE = pathlib.Path(__file__).parent
CELLS = [(d, a) for d in ("code", "prose") for a in ("chain_adaptive", "tree_adaptive")]
rows = {}
for side in ("base", "main"):
    for i in (1, 2, 3):
        p = HERE / f"{side}{i}.json"
        if not p.exists():
            continue
        d = json.loads(p.read_text())
        assert d["identical"], p
        c = d["datasets_cpu"]
        rows[f"{side}{i}"] = [(c[ds]["ratio_to"]["hf_default"][a]["median"],
                               c[ds]["accept_length"][a]) for ds, a in CELLS]
print("| run | " + " | ".join(f"{ds} {a.split('_')[0]}" for ds, a in CELLS) + " |")
print("| --- " * (len(CELLS) + 1) + "|")
for k, v in rows.items():
    print(f"| {k} | " + " | ".join(f"{r:.2f} ({al:.2f})" for r, al in v) + " |")
for side in ("base", "main"):
    runs = [v for k, v in rows.items() if k.startswith(side)]
    if runs:
        med = [statistics.median(r[j][0] for r in runs) for j in range(len(CELLS))]
        print(f"| **median, {side}** | " + " | ".join(f"{m:.2f}" for m in med) + " |")
