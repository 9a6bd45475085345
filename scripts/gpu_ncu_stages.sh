#!/usr/bin/env bash
# The stage step's kernel under Nsight Compute and cuobjdump, on the GPU machine: its code size
# per instantiation, why its warps stall (per kind and per instruction) and how much it reads.
# KESTREL_BIN names a kestrel binary built elsewhere (default: build it like gpu_suite.sh);
# CONFIG, BATCH and CONTEXT pick the shapes (default: Qwen3-30B-A3B, batch 1, context 1024).
# Writes to $OUT: sass_sizes.txt, ncu_stages.txt (the sections), ncu_stages_sass.csv.xz (per
# instruction) and stalls.txt (scripts/stage_stalls.py's summary of it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
CONFIG=${CONFIG:-configs/qwen3-30b-a3b-nvfp4.json}
BATCH=${BATCH:-1}
CONTEXT=${CONTEXT:-1024}
mkdir -p "$OUT"
if [ -z "${KESTREL_BIN:-}" ]; then
  source scripts/gpu_env.sh
  gpu_build "$OUT/build.log" kestrel || exit 1
  KESTREL_BIN=$BUILD/src/kestrel
fi
# Code size: SASS instructions (16 bytes each) per stage kernel.
cuobjdump -sass "$KESTREL_BIN" >/tmp/kestrel.sass 2>/dev/null
awk '/Function :/ { name = $3 } /\/\*[0-9a-f]{4,}\*\// { n[name]++ }
     END { for (f in n) if (f ~ /stage_step_kernel/) printf "%8d instructions %8.1f KB  %s\n", n[f], n[f] * 16 / 1024, f }' \
  /tmp/kestrel.sass | sort -k1 -n | tee "$OUT/sass_sizes.txt"
REP=/tmp/ncu_stages
rm -f "$REP.ncu-rep"
ncu --clock-control none -k 'regex:stage_step_kernel' -c 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats \
  --section MemoryWorkloadAnalysis --section LaunchStats --section SourceCounters --import-source no -o "$REP" \
  "$KESTREL_BIN" bench --config "$CONFIG" --random-weights --batch "$BATCH" --context "$CONTEXT" --steps 2 --stages \
  >"$OUT/ncu_run.log" 2>&1 || { tail -20 "$OUT/ncu_run.log"; exit 1; }
ncu -i "$REP.ncu-rep" --page details >"$OUT/ncu_stages.txt" 2>&1
ncu -i "$REP.ncu-rep" --page source --csv --print-source sass >/tmp/ncu_sass.csv 2>&1
python3 scripts/stage_stalls.py /tmp/ncu_sass.csv | tee "$OUT/stalls.txt"
xz -T0 -c /tmp/ncu_sass.csv >"$OUT/ncu_stages_sass.csv.xz"
grep -E "Duration|DRAM Throughput|Memory Throughput|Executed Ipc|Issue Slots|No Eligible|Active Warps|Warp Cycles|Registers|Stall" \
  "$OUT/ncu_stages.txt" | head -40
