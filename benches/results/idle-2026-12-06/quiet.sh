cd /work/main
R=benches/results/idle-2026-12-06
for x in 1 2; do
  echo "== dp adaptive run $x: $(date -u +%T) $(uptime)"
  .venv/bin/python benches/dp_processes.py --repeats 5 --out $R/dp_adaptive_$x.json 2>&1 | tail -30
  echo "== dp fixed3 run $x: $(date -u +%T) $(uptime)"
  .venv/bin/python benches/dp_processes.py --repeats 5 --fixed-steps 3 --out $R/dp_fixed3_$x.json 2>&1 | tail -30
done
echo "== vb c16,64: $(date -u +%T) $(uptime)"
.venv/bin/python benches/verify_budgets_ab.py --issue28-arms "" --concurrency 16,64 --rounds 10 --num-prompts 64 --max-new-tokens 64 --json $R/verify_budgets_c16_c64.json 2>&1 | tail -40
echo "== end $(date -u +%T) $(uptime)"
