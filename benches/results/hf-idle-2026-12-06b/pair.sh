#!/bin/bash
# Idle pairs for issue 29: base (2a656ac, its own _core, at /tmp/base43) against main (this
# commit), whole runs alternating, main's benches/hf_assisted.py for both sides.
cd /work/main
OUT=benches/results/hf-idle-2026-12-06b
for i in 1 2 3; do
  for side in base main; do
    if [ $side = base ]; then PP=/tmp/base43/python; else PP=/work/main/python; fi
    echo "$side$i start $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" >> $OUT/pair.log
    PYTHONPATH=$PP .venv/bin/python benches/hf_assisted.py --repeats 9 \
      --arms chain_adaptive,tree_adaptive --hf-schedules default --json > $OUT/$side$i.json 2> $OUT/$side$i.err
    echo "$side$i end $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg) rc=$?" >> $OUT/pair.log
  done
done
