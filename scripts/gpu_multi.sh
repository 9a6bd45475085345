#!/usr/bin/env bash
# Decode over several GPUs, in one call on a machine with 2, 4 or 8 of them: at every power-of-two
# GPU count up to the machine's, the split tests (fixtures and random Qwen3-30B-A3B shapes against
# the unsplit model) and a fixture's logits through `--tp N [--ep N]` against the CPU; the one-shot
# all-reduce against NCCL; decode speed of Qwen3-30B-A3B and GLM-4.5-Air shapes at TP 1..N with
# and without expert parallelism, against the roofline of the same layout; with 8 GPUs, GLM-5 at
# its full depth. NVLink multicast stays off. A short table last; logs and JSON in $OUT
# (default ./out/multi). Headers the GPU machine lacks come from .deps and .third_party, as for gpu_suite.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/multi}
mkdir -p "$OUT"
BUILD=${BUILD:-build-gpu}
source scripts/gpu_env.sh
export NCCL_NVLS_ENABLE=0
GPUS=$(nvidia-smi -L | wc -l)
[ "$GPUS" -ge 2 ] || { echo "gpu_multi.sh: needs 2 or more GPUs, found $GPUS" >&2; exit 1; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
nvidia-smi topo -m >"$OUT/topo.txt" 2>&1 || true
gpu_build "$OUT/build.log" kestrel kestrel_gpu_tests || exit 1

COUNTS=()
for n in 2 4 8; do if [ "$n" -le "$GPUS" ]; then COUNTS+=("$n"); fi; done
first() { seq -s, 0 $(($1 - 1)); }  # CUDA_VISIBLE_DEVICES for the first N GPUs
K=$BUILD/src/kestrel
rc=0

# Correctness at each count (the split and collective tests take every visible GPU: fixtures up
# to 4, the random full-shape model up to 8).
fx=tests/fixtures/qwen3moe-nvfp4
"$K" logits --model "$fx" --tokens 1,5,9,13,17,21 --device cpu --out "$OUT/logits_cpu.bin" 2>>"$OUT/cli.txt"
: >"$OUT/correct.txt"
for n in "${COUNTS[@]}"; do
  if CUDA_VISIBLE_DEVICES=$(first "$n") "$BUILD/tests/gpu/kestrel_gpu_tests" --gtest_filter='*Split*:RankGroup*:CudaComm*' \
    >"$OUT/split_tests_$n.log" 2>&1; then
    echo "$n GPUs, split tests: $(grep -E '^\[  PASSED  \]' "$OUT/split_tests_$n.log")" >>"$OUT/correct.txt"
  else
    rc=1
    echo "$n GPUs, split tests FAILED: see split_tests_$n.log" >>"$OUT/correct.txt"
  fi
  grep -h "random Qwen3" "$OUT/split_tests_$n.log" >>"$OUT/correct.txt" || true
  for ep in 1 "$n"; do
    bin=$OUT/logits_tp${n}_ep$ep.bin
    if CUDA_VISIBLE_DEVICES=$(first "$n") "$K" logits --model "$fx" --tokens 1,5,9,13,17,21 --device cuda \
      --kv-dtype f32 --tp "$n" --ep "$ep" --out "$bin" 2>>"$OUT/cli.txt"; then
      python3 -c "
import numpy as np, sys
a, b = (np.fromfile(sys.argv[i], dtype=np.float32) for i in (1, 2))
print(f'kestrel logits --tp $n --ep $ep vs cpu on $fx: rel L2 {np.linalg.norm(a - b) / np.linalg.norm(b):.2e}')
" "$bin" "$OUT/logits_cpu.bin" >>"$OUT/correct.txt"
    else
      echo "kestrel logits --tp $n --ep $ep on $fx: failed (cli.txt says why)" >>"$OUT/correct.txt"
    fi
  done
done

# The all-reduce at each count, inside CUDA graphs.
for n in "${COUNTS[@]}"; do
  "$K" bench-allreduce --gpus "$n" --sizes 4K,16K,64K,256K,1M --iters 200 --json "$OUT/allreduce_$n.json" \
    >"$OUT/allreduce_$n.txt" 2>&1 || { rc=1; echo "bench-allreduce --gpus $n failed" >>"$OUT/correct.txt"; }
done

# Decode speed: each layout's floor is the roofline of that layout (kestrel bench prints both).
bench() {  # name, visible GPUs, then kestrel bench arguments
  local name=$1 vis=$2
  shift 2
  echo "== $name: kestrel bench $*" >>"$OUT/bench.txt"
  CUDA_VISIBLE_DEVICES=$vis "$K" bench "$@" --json "$OUT/bench_$name.json" >>"$OUT/bench.txt" 2>&1 ||
    { rc=1; echo "   failed" >>"$OUT/bench.txt"; }
}
for m in qwen3-30b-a3b glm-4.5-air; do
  args=(--config "configs/$m-nvfp4.json" --random-weights --batch 1,8 --context 1024 --steps 30)
  bench "$m-tp1" 0 "${args[@]}"
  for n in "${COUNTS[@]}"; do
    ops=()  # where the time goes (weights, attention, communication): at the largest count
    if [ "$n" = "${COUNTS[-1]}" ]; then ops=(--ops); fi
    bench "$m-tp$n" "$(first "$n")" "${args[@]}" --tp "$n" "${ops[@]}"
    bench "$m-tp$n-ep$n" "$(first "$n")" "${args[@]}" --tp "$n" --ep "$n" "${ops[@]}"
  done
done
if [ "$GPUS" -ge 8 ]; then  # GLM-5 at full depth: random weights made on the GPUs
  g5=(--config configs/glm-5-nvfp4.json --random-weights --batch 1,8 --context 1024 --steps 20)
  bench glm-5-tp8-ep8 "$(first 8)" "${g5[@]}" --tp 8 --ep 8 --ops
  bench glm-5-tp8 "$(first 8)" "${g5[@]}" --tp 8
fi

echo
echo "== kestrel multi-GPU runs ($GPUS GPUs) =="
cat "$OUT/correct.txt"
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
print("all-reduce, microseconds per call (median / p99), one-shot vs NCCL:")
for path in sorted(glob.glob(os.path.join(out, "allreduce_*.json")), key=lambda p: int(p.split("_")[-1][:-5])):
    d = json.load(open(path))
    cells = [f"{s['bytes'] // 1024}K {s['oneshot_median_us']:.1f}/{s['oneshot_p99_us']:.1f} vs "
             f"{s['nccl_median_us']:.1f}/{s['nccl_p99_us']:.1f}" for s in d["sizes"]]
    print(f"  {d['gpus']} GPUs: " + ", ".join(cells))
print(f"{'decode':24} {'batch':>5} {'ms':>9} {'floor ms':>9} {'x floor':>8} {'tok/s':>8}")
for path in sorted(glob.glob(os.path.join(out, "bench_*.json"))):
    name = os.path.basename(path)[6:-5]
    for s in json.load(open(path))["steps"]:
        ms, fl = s["graph_ms"], s["floor_ms"]
        print(f"{name:24} {s['batch']:5d} {ms:9.3f} {fl:9.3f} {ms / fl:8.2f} {s['batch'] * 1e3 / ms:8.0f}")
PY
exit $rc
