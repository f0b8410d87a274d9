#!/bin/bash
# One device call (an H200; about 8 minutes: each step is bounded, and the call's 600 s limit cuts the
# last one if all run long) that times the open leads benchmarks/NOTES.md lists as ready but untimed
# (67th session), from the repo root:
#
#   COMMIT=<git rev-parse HEAD, run here> bash benchmarks/device_leads.sh
#
# with the seed carried as .seed/seed_kpool.py (carry [".seed"], timeout_s 600). Writes under $OUT:
#   sweep_<gates>.json   size_sweep.py of compress P=4 at 131K / 262K / 524K pools, ours and copy, each point
#                        also replayed for 2 s with the SM clock, power and throttle reasons sampled, for
#                        KPOOL_BENCH_GATES apart / offset / interleaved (why ours falls off above 131K)
#   c8_<op>.json         ab.py of compress and prefill P=4: main against 8 dims per thread (a copy of src/
#                        with the writers' max_contiguous hints at 8)
#   warps_p4.json        ab.py of decode P=4 at B 512 / 1,024, next_n 1 / 2 / 4: 1 (main) / 2 / 4 warps per program
#   warps_p16.json       ab.py of decode P=16 B=1,024 next_n 2 / 4: main against 4 warps capped at 64 registers
#   *.log, gpu.txt       each step's output and exit status
# Each step has its own timeout, so that a step cut short still leaves the others' files. The ab.py
# records are for comparison only (no byte checks): land a variant only with the GPU tests and
# `python -m kpool.exactness` of the changed ops on the same machine.
cd "$(dirname "$0")/.." || exit 1
: "${OUT:?set OUT}" "${COMMIT:?set COMMIT to the hash of HEAD}"
export PYTHONUNBUFFERED=1 KPOOL_GIT_COMMIT=$COMMIT PYTHONPATH=src
AB="python3 benchmarks/ab.py --seed-path .seed/seed_kpool.py"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > "$OUT/gpu.txt" 2>&1

for gates in apart offset interleaved; do
    KPOOL_BENCH_GATES=$gates timeout 80 python3 benchmarks/size_sweep.py --op compress --case 'P=4 pools=65536' \
        --key pools --sizes 131072,262144,524288 --impls ours,copy --sustain-s 2 --out "$OUT/sweep_$gates.json" \
        > "$OUT/sweep_$gates.log" 2>&1
    echo "size_sweep $gates rc=$?" >> "$OUT/gpu.txt"
done

C8=$(mktemp -d)
cp -r src "$C8/src"
sed -i 's/tl.max_contiguous(tl.arange(0, 128), 4)/tl.max_contiguous(tl.arange(0, 128), 8)/' "$C8/src/kpool/ops/compress.py"
sed -i 's/tl.max_contiguous(d, 4)/tl.max_contiguous(d, 8)/' "$C8/src/kpool/ops/prefill.py"
for op in compress prefill; do
    timeout 80 $AB --op $op --cases '^P=4 ' --variant main=src --variant "c8=$C8/src" \
        --out "$OUT/c8_$op.json" > "$OUT/c8_$op.log" 2>&1
    echo "c8 $op rc=$?" >> "$OUT/gpu.txt"
done

W2='import kpool.ops.decode as m; m.decode_warps = lambda b, n: 4 if b <= m.SMALL_BATCH else 2'
W4='import kpool.ops.decode as m; m.SMALL_BATCH = 1 << 20'
KPOOL_BENCH_DECODE_STEPS=4:512:1,4:512:2,4:512:4 timeout 150 $AB --op decode --cases '^P=4 B=(512|1024) ' \
    --variant main=src --variant "w2=src::$W2" --variant "w4=src::$W4" --out "$OUT/warps_p4.json" \
    > "$OUT/warps_p4.log" 2>&1
echo "warps p4 rc=$?" >> "$OUT/gpu.txt"
C4='import kpool.ops.decode as m; m.SMALL_BATCH = 1 << 20; m.step_max_regs = lambda nn, p, w: 64 if w == 4 else None'
timeout 70 $AB --op decode --cases '^P=16 B=1024 next_n=(2|4)$' --variant main=src --variant "w4c64=src::$C4" \
    --out "$OUT/warps_p16.json" > "$OUT/warps_p16.log" 2>&1
echo "warps p16 rc=$?" >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
