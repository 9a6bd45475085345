#!/usr/bin/env bash
# The stage step on a GPU machine, in one call: build, its GPU tests and `kestrel bench --stages`
# on Qwen3-30B-A3B shapes on each side of the open A/Bs, compute-sanitizer on one MoE fixture,
# lab/grid_stages, and Nsight Compute on the kernel. Logs to $OUT (or ./out).
# STAGES_PARTS picks parts (build tests sanitize lab bench ncu); without build, $BUILD as it is.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-gpu}
PARTS=${STAGES_PARTS:-build tests sanitize lab bench ncu}
source scripts/gpu_env.sh
has() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
if has build; then
  start=$(date +%s)
  gpu_build "$OUT/build.log" kestrel kestrel_gpu_tests grid_stages_lab || exit 1
  echo "build: $(( $(date +%s) - start )) s"
fi
T="$BUILD/tests/gpu/kestrel_gpu_tests"
# The open A/Bs, each side tested and timed ("" is the default; add "VAR=value" while one is open).
AB=("")
if has tests; then
  for i in "${!AB[@]}"; do
    env ${AB[$i]} "$T" --gtest_filter='*Stages*' >"$OUT/stages_tests_$i.log" 2>&1
    echo "stage tests [${AB[$i]:-default}]: exit $?"
    grep -E "^\[  FAILED  \]|^\[  PASSED  \]|worst rel|Failure|Expected|Which is|actual" "$OUT/stages_tests_$i.log" | head -40
  done
fi
if has sanitize && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck synccheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 9 "$T" \
      --gtest_filter='Families/CudaStagesTest.*qwen3moe_nvfp4*' \
      >"$OUT/sanitizer_stages_$tool.log" 2>&1
    echo "compute-sanitizer $tool on the stage step: exit $? ($(grep -cE 'ERROR SUMMARY: 0|RACECHECK SUMMARY: 0 hazards' \
      "$OUT/sanitizer_stages_$tool.log") clean summaries)"
  done
fi
if has lab; then
  "$BUILD/lab/grid_stages_lab" 512 20 | tee "$OUT/grid_stages.txt"
fi
if has bench; then
  for i in "${!AB[@]}"; do
    echo "== bench [${AB[$i]:-default}]"
    env ${AB[$i]} "$BUILD/src/kestrel" bench --config configs/qwen3-30b-a3b-nvfp4.json --random-weights \
      --batch ${STAGES_BATCH:-1,2,4,8} --context 1024 --steps 30 --stages --json "$OUT/bench_stages_$i.json" 2>&1 |
      grep -v "random weights:" | tee "$OUT/bench_stages_$i.txt"
  done
fi
# Why the stage kernel's warps stall, and its code size (Nsight Compute, cuobjdump).
if has ncu && command -v ncu >/dev/null; then
  KESTREL_BIN="$BUILD/src/kestrel" bash scripts/gpu_ncu_stages.sh
fi
