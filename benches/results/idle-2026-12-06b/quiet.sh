cd /work/main
R=benches/results/idle-2026-12-06b
for x in 1 2; do
  echo "== dp adaptive run $x: $(date -u +%T) $(uptime)"
  .venv/bin/python benches/dp_processes.py --repeats 5 --out $R/dp_adaptive_$x.json 2>&1 | tail -30
  echo "== dp fixed3 run $x: $(date -u +%T) $(uptime)"
  .venv/bin/python benches/dp_processes.py --repeats 5 --fixed-steps 3 --out $R/dp_fixed3_$x.json 2>&1 | tail -30
done
echo "== hf_assisted: $(date -u +%T) $(uptime)"
.venv/bin/python benches/hf_assisted.py --repeats 5 --json > $R/hf_assisted.txt 2>&1; tail -30 $R/hf_assisted.txt
echo "== vb c1,4: $(date -u +%T) $(uptime)"
.venv/bin/python benches/verify_budgets_ab.py --issue28-arms "" --concurrency 1,4 --rounds 9 --num-prompts 32 --max-new-tokens 64 --json $R/verify_budgets_c1_c4.json 2>&1 | tail -40
echo "== end $(date -u +%T) $(uptime)"
