#!/bin/bash
# hf_assisted, branch and base alternating (started while overhead_ab.py still ran: the two
# shared the cores with each other and with other sessions; figures are CPU-time ratios).
PY=/work/wt-a/.venv/bin/python
R=/work/wt-a/benches/results/host-batch1-2026-12-06
BASE=/tmp/wta/base/python
cd /tmp/wta/branch
meta() { echo "$1 $(date -u +%FT%TZ) $(uptime)" >> $R/runs.meta; }
for i in 1 2; do
  for side in branch base; do
    meta hf_${side}${i}_start
    if [ $side = base ]; then PP=$BASE; else PP=/tmp/wta/branch/python; fi
    PYTHONPATH=$PP $PY benches/hf_assisted.py --repeats 7 \
        --arms chain_adaptive,tree_adaptive --hf-schedules default --json \
        > $R/hf_${side}${i}.json 2> $R/hf_${side}${i}.err
    meta hf_${side}${i}_end
  done
done
meta hf_all_end
