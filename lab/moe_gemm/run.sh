#!/usr/bin/env bash
# Runs the MoE grouped-GEMM lab on a GPU machine: the small problems under compute-sanitizer
# (memcheck, then racecheck for the shared-memory pipeline) where it is installed, then the full
# run (every check, then the timings). Exit status non-zero if any of them failed.
# Usage: lab/moe_gemm/run.sh path/to/moe_gemm_lab [runs]
set -uo pipefail
bin=${1:?usage: run.sh path/to/moe_gemm_lab [runs]}
shift
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.memory --format=csv,noheader || true
status=0
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ -x "$san" ]; then
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool, small problems"
    "$san" --tool "$tool" --error-exitcode 3 "$bin" check || status=1
  done
else
  echo "== compute-sanitizer not found: sanitizer runs skipped"
fi
echo "== full run"
"$bin" "$@" || status=1
exit "$status"
