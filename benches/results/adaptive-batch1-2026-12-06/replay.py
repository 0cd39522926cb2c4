"""Replays a chain_adaptive trace (``record_trace`` JSON lines, plain or .gz) through a fresh
goodput policy (``specdial._core.AdaptiveSpeculativeParams``, default config, batch 1), each
iteration reported at the steps the engine ran; prints every ``N``-th iteration what the policy
believes: predicted ms and expected tokens per depth, goodput (tokens/s), iterations skipped by
the pace check, probes, switches. Usage: ``replay.py TRACE [N]`` with the core to inspect on
``PYTHONPATH``."""
import gzip
import json
import sys

from specdial._core import AdaptiveConfig, AdaptiveSpeculativeParams

path = sys.argv[1]
every = int(sys.argv[2]) if len(sys.argv) > 2 else 100
with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
    recs = [json.loads(line) for line in f]
p = AdaptiveSpeculativeParams(3, json.loads(AdaptiveConfig.default().to_json()))
agree = 0
for i, r in enumerate(recs):
    d = p.decide(1, r["context_tokens"])
    agree += d.steps == r["steps"]
    p.on_verify_complete(r["accepted"], 1, seconds=r["seconds"],
                         context_tokens=r["context_tokens"], steps=r["steps"])
    if i % every == 0:
        g = p.goodput_state()
        ld = g["last_decision"]
        gp = {k: round(ld["expected_tokens"][k] / ld["predicted_seconds"][k])
              for k in ld["predicted_seconds"]}
        print(i, "k", r["steps"], "skip", g["off_pace_skipped"], "probes", g["probes"],
              "sw", g["switches"],
              "ms", {k: round(v * 1000, 1) for k, v in ld["predicted_seconds"].items()},
              "E", {k: round(v, 2) for k, v in ld["expected_tokens"].items()}, "gp", gp)
print("decisions equal to the trace's", agree, "of", len(recs))
