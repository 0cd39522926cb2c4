"""Per trace (``record_trace`` JSON lines, plain or .gz): decode iterations, the depth
histogram, the acceptance length and the median measured ms per depth."""
import collections
import gzip
import json
import statistics
import sys

for path in sys.argv[1:]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        dec = [json.loads(line) for line in f]
    hist = collections.Counter(r["steps"] for r in dec)
    sec = collections.defaultdict(list)
    for r in dec:
        if r.get("seconds"):
            sec[r["steps"]].append(r["seconds"])
    acc = sum(r["accepted"][0] for r in dec)
    print(path.split("/")[-1], len(dec), "hist", dict(sorted(hist.items())),
          "acclen", round(1 + acc / len(dec), 2),
          "med ms", {k: round(1000 * statistics.median(v), 2) for k, v in sorted(sec.items())})
