import json, sys
for f in sys.argv[1:]:
    r = json.load(open(f))
    print(f, "identical", r["identical"], "load", [round(x, 1) for x in r["load_before"]], "->", [round(x, 1) for x in r["load_after"]])
    for clock in ("datasets_cpu", "datasets"):
        for d, row in r[clock].items():
            s = []
            for base, by in row["ratio_to"].items():
                for a, rr in by.items():
                    s.append(f"{a}/{base} {rr['median']:.2f} ({rr['ci90'][0]:.2f}-{rr['ci90'][1]:.2f})")
            tps = {a: round(v, 1) for a, v in row["tokens_per_s"].items()}
            acc = {a: round(v, 2) for a, v in row["accept_length"].items() if v}
            print(" ", clock, d, "; ".join(s), tps, acc)
