#!/bin/bash
# One device call that refreshes what the H200 tables lack (about 9 minutes), from the repo root:
#
#   COMMIT=<git rev-parse HEAD, run here> OPS=score,seed_tail,fp8 bash benchmarks/device_rerun.sh
#
# with the seed carried as .seed/seed_kpool.py (carry [".seed"], timeout_s 600). Writes under $OUT:
#   rerun.json       run_all.py of $OPS (merge back: merge_results.py results/h200.json rerun.json --ops $OPS)
#   sweep.json       size_sweep.py of compress P=4, 16K-512K pools, ours / seed / copy (the fixed cost)
#   ncu_p4.csv       ncu of compress and prefill P=4, ours and the seed (warp states, issue, occupancy)
#   *.log, gpu.txt   each step's output and exit status
# Each step has its own timeout, so that a step cut short still leaves the others' files.
cd "$(dirname "$0")/.." || exit 1
: "${OUT:?set OUT}" "${COMMIT:?set COMMIT to the hash of HEAD}"
export PYTHONUNBUFFERED=1 KPOOL_GIT_COMMIT=$COMMIT PYTHONPATH=src
OPS=${OPS:-score,seed_tail,fp8}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.txt" 2>&1
timeout 290 python3 benchmarks/run_all.py --ops "$OPS" --out "$OUT/rerun.json" --budget-s 220 > "$OUT/rerun.log" 2>&1
echo "run_all rc=$?" >> "$OUT/gpu.txt"
timeout 120 python3 benchmarks/size_sweep.py --op compress --case 'P=4 pools=65536' --key pools \
    --sizes 16384,32768,65536,131072,262144,524288 --impls ours,seed,copy --out "$OUT/sweep.json" \
    > "$OUT/sweep.log" 2>&1
echo "size_sweep rc=$?" >> "$OUT/gpu.txt"
if command -v ncu > /dev/null; then
    timeout 130 ncu --profile-from-start off --clock-control none --csv --page details \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        --section LaunchStats --section MemoryWorkloadAnalysis --log-file "$OUT/ncu_p4.csv" \
        python3 benchmarks/run_all.py --profile --ops compress,prefill --cases 'P=4 (pools=65536|R=64 T=262144)$' \
        --impls ours,seed --out /tmp/kpool_profile.json > "$OUT/ncu.log" 2>&1
    echo "ncu rc=$?" >> "$OUT/gpu.txt"
fi
