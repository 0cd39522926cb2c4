#!/bin/bash
# issue 29 idle pairs: main (a04b0df+) vs base bff984d (stop 41's main + the malloc test fix), alternating whole runs
cd /work/main
for i in 1 2 3; do
  for side in base main; do
    if [ $side = base ]; then PP=/tmp/base42/python; else PP=/work/main/python; fi
    echo "$side$i $(date -u +%T) $(uptime)"
    PYTHONPATH=$PP .venv/bin/python benches/hf_assisted.py --repeats 9 --arms chain_adaptive,tree_adaptive --hf-schedules default --json > /tmp/idle42/${side}$i.json 2>/dev/null
  done
done
echo "end $(date -u +%T) $(uptime)"
