"""LM head, rotary and embedding per call, main against the branch (fresh processes, sides
alternating). ``python micro_ab.py --base DIR --new DIR --rounds 5``; a child
(``--child``) prints one JSON line of thread-CPU µs per call (median of 7 x 100 calls)."""
import argparse, json, os, statistics, subprocess, sys, time


def child() -> dict:
    import torch
    torch.set_num_threads(1)
    from specdial.builtin import builtin_model_path
    from specdial.models import load_model
    t, d = load_model(builtin_model_path("target")), load_model(builtin_model_path("draft"))
    cases = {}
    for m, name in ((t, "target"), (d, "draft")):
        for rows in (1, 4, 17):
            h = torch.randn(rows, m.config.hidden_size)
            cases[f"{name}_logits_{rows}"] = (lambda m=m, h=h: m.compute_logits(h))
    for n in (1, 4, 17):
        pos = torch.arange(300, 300 + n)
        cases[f"rotary_{n}"] = (lambda pos=pos: t.rotary(pos, torch.float32))
    for n in (1, 256):
        ids = torch.randint(0, 4096, (n,))
        cases[f"embed_{n}"] = (lambda ids=ids: t.embed_tokens(ids))
    out = {}
    with torch.inference_mode():
        for name, f in cases.items():
            f()
            xs = []
            for _ in range(7):
                t0 = time.thread_time()
                for _ in range(100):
                    f()
                xs.append((time.thread_time() - t0) / 100 * 1e6)
            out[name] = statistics.median(xs)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base"), p.add_argument("--new"), p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--child", action="store_true")
    a = p.parse_args()
    if a.child:
        print(json.dumps(child()))
        return
    runs = {"base": [], "new": []}
    load = os.getloadavg()
    for r in range(a.rounds):
        for side in (("base", "new") if r % 2 == 0 else ("new", "base")):
            env = dict(os.environ, PYTHONPATH=getattr(a, side))
            out = subprocess.run([sys.executable, __file__, "--child"], env=env, check=True,
                                 capture_output=True, text=True).stdout
            runs[side].append(json.loads(out.strip().splitlines()[-1]))
    res = {"load_before": load, "load_after": os.getloadavg(), "cases": {}}
    for c in runs["base"][0]:
        b, n = [x[c] for x in runs["base"]], [x[c] for x in runs["new"]]
        res["cases"][c] = {"base_us": round(statistics.median(b), 1),
                           "new_us": round(statistics.median(n), 1),
                           "new_over_base": round(statistics.median(y / x for x, y in zip(b, n)), 3),
                           "ratios": [round(y / x, 2) for x, y in zip(b, n)]}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
