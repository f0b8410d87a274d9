#!/bin/bash
# A device call (an H200) that times the open leads benchmarks/NOTES.md lists as untimed, from the
# repo root:
#
#   COMMIT=<git rev-parse HEAD, run here> STEPS=sweep,warps,c8 bash benchmarks/device_leads.sh
#
# with the seed carried as .seed/seed_kpool.py (carry [".seed"], timeout_s 600); about 5-8 minutes
# for all three. Steps (each with its own timeout, so a step cut short still leaves the others'
# files), under $OUT:
#   sweep   sweep_<gates>.json: size_sweep.py of compress P=4 at 131K / 262K / 524K pools, ours and
#           copy, each point also replayed for 2 s with the SM clock, power and throttle reasons
#           sampled, for KPOOL_BENCH_GATES apart / offset / interleaved (why ours falls off above 131K)
#   warps   warps_p16.json: decode P=16 B=1,024 next_n 2 / 4, main / 4 warps at 64 registers (the
#           P=4 half of this lead was timed in the 68th session: it lost)
#   c8      c8_<op>.json: ab.py of compress and prefill P=4, main / 8 dims per thread (a copy of src/
#           with the writers' max_contiguous hints at 8)
#   gpu.txt each step's exit status; *.log each step's output
# The ab.py records are for comparison only (no byte checks). On an H100, where the P=4 writers are
# memory-bound, AB_EXTRA="--occupy-sms 0,39" also times them with 39 SMs held (an H200's bandwidth per SM).
cd "$(dirname "$0")/.." || exit 1
: "${OUT:?set OUT}" "${COMMIT:?set COMMIT to the hash of HEAD}"
export PYTHONUNBUFFERED=1 KPOOL_GIT_COMMIT=$COMMIT PYTHONPATH=src
STEPS=${STEPS:-sweep,warps,c8}
AB="python3 benchmarks/ab.py --seed-path .seed/seed_kpool.py ${AB_EXTRA:-}"  # e.g. --occupy-sms 0,39 on an H100
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > "$OUT/gpu.txt" 2>&1

step_sweep() {
    for gates in apart offset interleaved; do
        KPOOL_BENCH_GATES=$gates timeout 80 python3 benchmarks/size_sweep.py --op compress \
            --case 'P=4 pools=65536' --key pools --sizes 131072,262144,524288 --impls ours,copy --sustain-s 2 \
            --out "$OUT/sweep_$gates.json" > "$OUT/sweep_$gates.log" 2>&1
        echo "sweep $gates rc=$?" >> "$OUT/gpu.txt"
    done
}

step_warps() {
    local c4='import kpool.ops.decode as m; m.SMALL_BATCH = 1 << 20; m.step_max_regs = lambda nn, p, w: 64 if w == 4 else None'
    timeout 120 $AB --op decode --cases '^P=16 B=1024 next_n=(2|4)$' --variant main=src --variant "w4c64=src::$c4" \
        --out "$OUT/warps_p16.json" > "$OUT/warps_p16.log" 2>&1
    echo "warps p16 rc=$?" >> "$OUT/gpu.txt"
}

step_c8() {
    local c8
    c8=$(mktemp -d)
    cp -r src "$c8/src"
    sed -i 's/tl.max_contiguous(tl.arange(0, 128), 4)/tl.max_contiguous(tl.arange(0, 128), 8)/' "$c8/src/kpool/ops/compress.py"
    sed -i 's/tl.max_contiguous(d, 4)/tl.max_contiguous(d, 8)/' "$c8/src/kpool/ops/prefill.py"
    if ! grep -q 'max_contiguous(tl.arange(0, 128), 8)' "$c8/src/kpool/ops/compress.py" ||
        ! grep -q 'max_contiguous(d, 8)' "$c8/src/kpool/ops/prefill.py"; then
        echo "c8: the hints were not found (sed matched nothing): not timed" >> "$OUT/gpu.txt"
        return
    fi
    for op in compress prefill; do
        timeout 80 $AB --op $op --cases '^P=4 ' --variant main=src --variant "c8=$c8/src" \
            --out "$OUT/c8_$op.json" > "$OUT/c8_$op.log" 2>&1
        echo "c8 $op rc=$?" >> "$OUT/gpu.txt"
    done
}

for step in ${STEPS//,/ }; do
    case $step in
        sweep|warps|c8) "step_$step" ;;
        *) echo "unknown step $step (sweep, warps, c8)" >> "$OUT/gpu.txt" ;;
    esac
done
cat "$OUT/gpu.txt"
