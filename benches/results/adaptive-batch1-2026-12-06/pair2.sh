#!/bin/bash
# After pair.sh: whole runs alternating base (2a656ac) and final (0d6c27f: + the CPU clock), the branch's hf_assisted.py for both.
set -u
out=/tmp/pairsA
for i in 4 5; do
  for side in final base; do
    if [ $side = base ]; then root=/tmp/baseA; else root=/tmp/finalA; fi
    echo "$side$i start $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/pair.log
    (cd $root && PYTHONPATH=$root/python nice -n 10 /work/main/.venv/bin/python /tmp/branchA/benches/hf_assisted.py \
       --repeats 9 --arms chain_adaptive,tree_adaptive --hf-schedules default --json \
       > $out/hf_${side}$i.json 2> $out/hf_${side}$i.err)
    echo "$side$i end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) rc $?" >> $out/pair.log
  done
done
echo DONE2 >> $out/pair.log
