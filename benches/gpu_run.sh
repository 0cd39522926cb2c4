#!/usr/bin/env bash
# Issue 18's GPU run, one prepared script for the `device` tool (15 minutes of device time in
# all): the most valuable results first, each section under its own time limit, so a rerun fits.
#   run: bash benches/gpu_run.sh            (writes under $OUT, default out/gpu_run)
#   in two device calls: GPU_RUN_SECTIONS="1 2" bash benches/gpu_run.sh, then GPU_RUN_SECTIONS="3 4"
#   CPU smoke of the same steps:  GPU_RUN_SMOKE=1 bash benches/gpu_run.sh
# 1. parity (graphs == eager == target-only, float32 and bfloat16, both drafters, forced
#    switching) and the engine's parity, 4-layer 8B-shaped target       (gpu_check, <= 240 s)
# 2. the cost surface: steps 0..7 x graph sizes up to 128 at context 1k (16 at 8k), 32 layers,
#    as cost_table.json, and `policy simulate` over it                   (<= 2 x 150 s)
# 3. flashinfer: install, then parity and timing with it, bfloat16      (<= 180 s, optional)
# 4. end to end, built-in models: adaptive / fixed / no speculation at c = 1 and 256 (<= 150 s)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu_run}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
if [ -n "${GPU_RUN_SMOKE:-}" ]; then
    CHECK=(--cpu-smoke); LAYERS=(); STEPS=(); CTX=(24 48); declare -A BS_AT=(); E2E=(--device cpu --dtype float32)
    E2E_C=1,16; E2E_N=16; T1=240; T2=120; T3=1; T4=240
else
    # KV of 32 layers x 8 kv heads x 128 x bf16 is 128 KiB per token and gpu_check's timing
    # holds four workers (spec/plain x graphs/eager), each with KV for the largest batch: 128 x
    # 1k (17 GiB each) and 16 x 8k (17 GiB each) fit beside the 16 GiB of weights on the H200;
    # 256 x 1k (4 x 34 GiB) would not
    CHECK=(); LAYERS=(--layers 32); STEPS=(--timing-steps 0,1,2,3,4,5,6,7)
    CTX=(1024 8192); declare -A BS_AT=([1024]=1,8,32,64,128 [8192]=1,8,16); E2E=(--device cuda --dtype bfloat16); E2E_C=1,256; E2E_N=256
    T1=240; T2=150; T3=180; T4=150
fi
section() { echo "=== $1 $(date +%T)"; }
# GPU_RUN_SECTIONS="1 2" runs only those (the device tool allows 600 s per command)
want() { [[ " ${GPU_RUN_SECTIONS:-1 2 3 4} " == *" $1 "* ]]; }

if want 1; then section "1 parity"
timeout "$T1" "$PY" benches/gpu_check.py "${CHECK[@]}" --sections parity,engine,capture \
    --out "$OUT/parity" --budget-s $((T1 - 30)) || echo "parity: exit $?"
fi

if want 2; then section "2 cost surface"
for c in "${CTX[@]}"; do
    BS=(); [ -n "${BS_AT[$c]:-}" ] && BS=(--timing-bs "${BS_AT[$c]}")
    timeout "$T2" "$PY" benches/gpu_check.py "${CHECK[@]}" "${LAYERS[@]}" "${BS[@]}" "${STEPS[@]}" \
        --sections timing --context "$c" --out "$OUT/cost_$c" --budget-s $((T2 - 40)) \
        || echo "cost surface at context $c: exit $?"
done
"$PY" - "$OUT" "${CTX[@]}" <<'PYEOF'
import json, sys
from pathlib import Path
out, ctxs = Path(sys.argv[1]), sys.argv[2:]
tables = [json.loads((out / f"cost_{c}" / "cost_table.json").read_text())
          for c in ctxs if (out / f"cost_{c}" / "cost_table.json").exists()]
if tables:
    merged = dict(tables[0], entries=[e for t in tables for e in t["entries"]])
    (out / "cost_table.json").write_text(json.dumps(merged, indent=1))
    print(f"merged {len(merged['entries'])} entries from contexts {ctxs} -> {out}/cost_table.json")
PYEOF
[ -f "$OUT/cost_table.json" ] && "$PY" -m specdial.cli policy simulate --curve "$OUT/cost_table.json" \
    | tee "$OUT/simulate.txt"
fi

if want 3; then section "3 flashinfer"
if [ -z "${GPU_RUN_SMOKE:-}" ]; then
    timeout "$T3" bash -c "$PY -m pip install -q flashinfer-python && \
        $PY benches/gpu_check.py --backend flashinfer --sections parity,timing \
        --out $OUT/flashinfer --budget-s 60" || echo "flashinfer: gave up (exit $?)"
else
    echo "flashinfer: skipped on the CPU (bfloat16 CUDA kernels only)"
fi
fi

if want 4; then section "4 end to end"
timeout "$T4" "$PY" -m specdial.cli bench compare "${E2E[@]}" --concurrency "$E2E_C" \
    --num-prompts "$E2E_N" --max-new-tokens 32 --repetitions 2 --max-running-requests 256 \
    --workloads code --configs no-spec,fixed-0,fixed-3,adaptive --no-progress --output-dir "$OUT/e2e" \
    || echo "end to end: exit $?"
fi
section done
