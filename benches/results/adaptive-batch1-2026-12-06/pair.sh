#!/bin/bash
# Whole runs of the branch's benches/hf_assisted.py (the same script for both sides), alternating base (main at 2a656ac, its own python/ and _core) and branch (421c0b7).
set -u
out=/tmp/pairsA
for i in 1 2 3; do
  for side in base branch; do
    if [ $side = base ]; then root=/tmp/baseA; else root=/tmp/branchA; fi
    echo "$side$i start $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/pair.log
    (cd $root && PYTHONPATH=$root/python nice -n 10 /work/main/.venv/bin/python /tmp/branchA/benches/hf_assisted.py \
       --repeats 9 --arms chain_adaptive,tree_adaptive --hf-schedules default --json \
       > $out/hf_${side}$i.json 2> $out/hf_${side}$i.err)
    echo "$side$i end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) rc $?" >> $out/pair.log
  done
done
echo DONE >> $out/pair.log
