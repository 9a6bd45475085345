#!/usr/bin/env bash
# The stage step on a GPU machine, in one call: build (unless $BUILD is built already), its GPU
# tests, compute-sanitizer on one MoE fixture, lab/grid_stages, and `kestrel bench --stages`
# on Qwen3-30B-A3B shapes. Logs to $OUT (or ./out).
# STAGES_SKIP_BUILD=1 uses the build as it is; STAGES_PARTS picks parts (build tests sanitize lab bench).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-gpu}
PARTS=${STAGES_PARTS:-build tests sanitize lab bench}
source scripts/gpu_env.sh
has() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
if has build; then
  start=$(date +%s)
  gpu_build "$OUT/build.log" kestrel kestrel_gpu_tests grid_stages_lab || exit 1
  echo "build: $(( $(date +%s) - start )) s"
fi
T="$BUILD/tests/gpu/kestrel_gpu_tests"
if has tests; then
  "$T" --gtest_filter='*Stages*' >"$OUT/stages_tests.log" 2>&1
  echo "stage tests: exit $?"
  grep -E "^\[  FAILED  \]|^\[  PASSED  \]|worst rel|Failure|Expected|Which is|actual" "$OUT/stages_tests.log" | head -40
fi
if has sanitize && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck synccheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 9 "$T" --gtest_filter='Families/CudaStagesTest.*qwen3moe_nvfp4*' \
      >"$OUT/sanitizer_stages_$tool.log" 2>&1
    echo "compute-sanitizer $tool on the stage step: exit $? ($(grep -cE 'ERROR SUMMARY: 0|RACECHECK SUMMARY: 0 hazards' \
      "$OUT/sanitizer_stages_$tool.log") clean summaries)"
  done
fi
if has lab; then
  "$BUILD/lab/grid_stages_lab" 512 20 | tee "$OUT/grid_stages.txt"
fi
if has bench; then
  "$BUILD/src/kestrel" bench --config configs/qwen3-30b-a3b-nvfp4.json --random-weights \
    --batch ${STAGES_BATCH:-1,2,4,8} --context 1024 --steps 30 --stages --json "$OUT/bench_stages.json" 2>&1 |
    grep -v "random weights:" | tee "$OUT/bench_stages.txt"
fi
