#!/bin/bash
# Issue 29 batch-1 host cuts: overhead_ab, then hf_assisted with branch and base alternating.
# branch: a snapshot of this branch's commit (git archive HEAD python benches tools, the same
# _core) in /tmp/wta/branch, so edits in the checkout during the run change nothing;
# base: bff984d's python/ (= main when this branch started) with the same _core.
# The hf_assisted loop below was in fact started on its own while overhead_ab.py still ran (the
# two shared the cores with each other and other sessions; figures are CPU-time ratios).
PY=/work/wt-a/.venv/bin/python
R=/work/wt-a/benches/results/host-batch1-2026-12-06
BASE=/tmp/wta/base/python
cd /tmp/wta/branch
meta() { echo "$1 $(date -u +%FT%TZ) $(uptime)" >> $R/runs.meta; }
meta overhead_start
PYTHONPATH=/tmp/wta/branch/python $PY benches/overhead_ab.py --baseline $BASE \
    --concurrency 1,4 --repeats 7 --out $R/overhead_ab.json > $R/overhead_ab.log 2>&1
meta overhead_end
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
meta all_end
