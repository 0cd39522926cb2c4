"""Regenerates examples/sample_trace.jsonl: a synthetic, deterministic per-verify trace.

Each request's accepted drafts follow a per-token acceptance rate ``a`` (a draft is accepted with
probability ``a`` given the previous one was), recorded at 7 steps, so the trace replays exactly
for any config whose candidates are <= 7 (see specdial.replay). Phases move batch size and
content the way a serving day does: a single high-acceptance user, a low-acceptance stretch,
medium and large batches, and back.
"""

import json
import random
from pathlib import Path

PHASES = [  # (batch size, acceptance rate, verifies)
    (1, 0.85, 150),
    (1, 0.25, 120),
    (2, 0.8, 100),
    (12, 0.75, 120),
    (12, 0.15, 120),
    (12, 0.7, 120),
    (40, 0.6, 80),
    (80, 0.6, 40),
    (1, 0.8, 100),
]
STEPS = 7


def main() -> None:
    rng = random.Random(0)
    out = Path(__file__).with_name("sample_trace.jsonl")
    with out.open("w") as f:
        for bs, a, n in PHASES:
            for _ in range(n):
                acc = []
                for _ in range(bs):
                    k = 0
                    while k < STEPS and rng.random() < a:
                        k += 1
                    acc.append(k)
                f.write(json.dumps({"batch_size": bs, "accepted": acc, "steps": STEPS}) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
