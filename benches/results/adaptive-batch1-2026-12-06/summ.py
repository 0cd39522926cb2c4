"""Per hf_assisted JSON: CPU-clock median paired ratio to hf_default per dataset and arm, acceptance, depth histogram."""
import json, sys
for path in sys.argv[1:]:
    r = json.load(open(path))
    out = []
    for d, row in r["datasets_cpu"].items():
        for a, v in row["ratio_to"]["hf_default"].items():
            h = row.get("depths", {}).get(a, {})
            hist = h.get("depths") or {}
            nodes = h.get("tree_nodes") or {}
            out.append(f"{d} {a}: {v['median']:.2f} ({v['ci90'][0]:.2f}-{v['ci90'][1]:.2f}) acc {row['accept_length'][a]:.2f} depths {hist} nodes {nodes}")
    hf = {d: round(row['tokens_per_s']['hf_default']) for d, row in r["datasets_cpu"].items()}
    print(path.split('/')[-1], 'identical', r['identical'], 'load', [round(x,1) for x in r['load_before']], '->', [round(x,1) for x in r['load_after']], 'hf tok/cpu-s', hf)
    for o in out: print('   ', o)
