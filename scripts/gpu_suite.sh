#!/usr/bin/env bash
# The GPU suite, in one call on a machine with a GPU: build the CUDA code, run every GPU test
# (each op against the CPU reference, every fixture family against CPU and transformers), then
# benchmark decode on random-weight models of real shapes, and print a short table last.
# Headers the GPU machine lacks come from .deps and XGrammar from .third_party (scripts/gpu_deps.sh
# makes both: carry them). Results go to
# $OUT (or ./out) as logs and JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-gpu}
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
gpu_build "$OUT/build.log" kestrel kestrel_gpu_tests || exit 1

set +e
"$BUILD/tests/gpu/kestrel_gpu_tests" ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER} >"$OUT/gpu_tests.log" 2>&1
tests_rc=$?
set -e
grep -E "^\[  FAILED  \]|worst rel|Failure|Expected|Which is|actual" "$OUT/gpu_tests.log" | head -40 || true
# rerun LOG FILTER [VAR=VALUE ...]: a subset of the GPU tests once more, in another setting.
rerun() {
  local log=$1 filter=$2; shift 2
  set +e
  env "$@" "$BUILD/tests/gpu/kestrel_gpu_tests" --gtest_filter="$filter" >"$OUT/$log" 2>&1
  local rc=$?
  set -e
  [ $rc -ne 0 ] && tests_rc=$rc
  grep -E "^\[  FAILED  \]|Failure" "$OUT/$log" | head -20 || true
}
if [ -z "${GTEST_FILTER:-}" ]; then
  # The linear kernels with every token group of a pass in one block row (small matrices
  # otherwise spread them, so 2 and 4 groups per block would go untested).
  rerun gpu_tests_fill0.log '*LinearTest*:CudaOps.ThreeJobs*' KESTREL_LINEAR_FILL=0
  # And with K never split over clusters (those shapes then take the wide kernel).
  rerun gpu_tests_nosplit.log '*LinearTest*:CudaOps.ThreeJobs*' KESTREL_LINEAR_SPLIT=0
  # The expert-grouped kernels splitting the activations per tile instead of taking fragment rows.
  rerun gpu_tests_nofrag.log 'CudaOps.Moe*:*CudaModelTest*:CudaRandomModel*' KESTREL_MOE_FRAG=0
  # With several GPUs, the split tests on one of them: the split code path with one rank.
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    rerun gpu_tests_one_gpu.log '*Split*:RankGroup*:CudaCommOneRank*' CUDA_VISIBLE_DEVICES=0
  fi
fi

# The stage step's kernel under compute-sanitizer (memcheck, racecheck, synccheck) on one
# MoE fixture at 1 and 3 sequences.
if [ -z "${GTEST_FILTER:-}" ] && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck synccheck; do
    set +e
    compute-sanitizer --tool "$tool" --error-exitcode 9 "$BUILD/tests/gpu/kestrel_gpu_tests" \
      --gtest_filter='Families/CudaStagesTest.*qwen3moe_nvfp4*' \
      >"$OUT/sanitizer_persistent_$tool.log" 2>&1
    rc=$?
    set -e
    echo "compute-sanitizer $tool on the persistent step: exit $rc ($(grep -c 'ERROR SUMMARY: 0' "$OUT/sanitizer_persistent_$tool.log") clean summaries)" |
      tee -a "$OUT/cli.txt"
    [ $rc -ne 0 ] && tests_rc=$rc
  done
fi

# The commands on the GPU: a fixture's logits through `--device cuda` against `--device cpu`, with
# a float32 KV cache (the CPU's: equal to rounding) and the default BF16 one.
fx=tests/fixtures/qwen3moe-nvfp4
"$BUILD/src/kestrel" logits --model "$fx" --tokens 1,5,9,13,17,21 --device cpu --out "$OUT/logits_cpu.bin" 2>>"$OUT/cli.txt"
for kv in f32 bf16; do
  "$BUILD/src/kestrel" logits --model "$fx" --tokens 1,5,9,13,17,21 --device cuda --kv-dtype $kv \
    --out "$OUT/logits_cuda_$kv.bin" 2>>"$OUT/cli.txt"
  python3 -c "
import numpy as np, sys
a, b = (np.fromfile(sys.argv[i], dtype=np.float32) for i in (1, 2))
print(f'cli: kestrel logits --device cuda --kv-dtype $kv vs cpu on $fx: rel L2 {np.linalg.norm(a - b) / np.linalg.norm(b):.2e}')
" "$OUT/logits_cuda_$kv.bin" "$OUT/logits_cpu.bin" | tee -a "$OUT/cli.txt"
done
# Perplexity on the GPU against the CPU: a fixture given a byte-level tokenizer of its 256 ids
# (always), and the real model quantized to NVFP4 (when fetched; too large to carry to a GPU machine).
pdir=$(mktemp -d)
cp -r tests/fixtures/glm5-nvfp4 "$pdir/m"
python3 scripts/make_byte_tokenizer.py "$pdir/m/tokenizer.json"
# ppl_cuda_vs_cpu ID LABEL MODEL BYTES CONTEXT STRIDE: perplexity of the first BYTES of the committed text.
ppl_cuda_vs_cpu() {
  head -c "$4" docs/data/pride_and_prejudice_ch1.txt >"$OUT/slice_$1.txt"
  for d in cpu cuda:f32 cuda:auto; do  # device:KV type (auto: bf16, or f32 for MLA models)
    local dev=${d%%:*} flags=()
    [ "$dev" = cuda ] && flags=(--kv-dtype "${d#cuda:}")
    "$BUILD/src/kestrel" perplexity --model "$3" --text "$OUT/slice_$1.txt" --context "$5" --stride "$6" --device "$dev" \
      "${flags[@]}" --json "$OUT/ppl_$1_${d/:/_}.json" >>"$OUT/cli.txt" 2>&1
  done
  for kv in f32 auto; do
    python3 -c "
import json, sys
a, b = (json.load(open(sys.argv[i]))['perplexity'] for i in (1, 2))
print(f'cli: kestrel perplexity --device cuda --kv-dtype $kv {a:.6f} vs cpu {b:.6f} on $2: rel diff {abs(a - b) / b:.2e}')
" "$OUT/ppl_$1_cuda_$kv.json" "$OUT/ppl_$1_cpu.json" | tee -a "$OUT/cli.txt"
  done
}
ppl_cuda_vs_cpu fixture "the glm5-nvfp4 fixture (bytes)" "$pdir/m" 600 200 100
rm -rf "$pdir"
gguf=models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$gguf" ]; then
  qdir=$(mktemp -d)
  "$BUILD/src/kestrel" quantize --model "$gguf" --out "$qdir/nvfp4" --calib-max-tokens 64 >>"$OUT/cli.txt" 2>&1
  ppl_cuda_vs_cpu smollm2 "SmolLM2 NVFP4" "$qdir/nvfp4" 2000 256 128
  rm -rf "$qdir"
fi
"$BUILD/src/kestrel" profile --model "$fx" --steps 10 --plot "$OUT/profile_fixture.svg" >>"$OUT/cli.txt" 2>&1 &&
  echo "cli: kestrel profile on $fx: ok" | tee -a "$OUT/cli.txt"

# Serving over HTTP on the GPU: 48 concurrent clients' greedy replies equal to the same requests
# sent one at a time, on a dense BF16 fixture with its chat tokenizer and on the NVFP4 MoE fixture
# given the same tokenizer; then `kestrel loadgen` at 48 streams, the server healthy afterwards.
if "$BUILD/src/kestrel" serve --help >/dev/null 2>&1; then
  sdir=$(mktemp -d)
  cp -rL "$fx" "$sdir/moe"
  cp tests/fixtures/qwen3-chat/{tokenizer.json,tokenizer_config.json,generation_config.json} "$sdir/moe/"
  for m in tests/fixtures/qwen3-chat "$sdir/moe"; do
    set +e
    python3 tests/server/concurrent_equals_serial.py "$BUILD/src/kestrel" "$m" --streams 48 --requests 96 --max-tokens 32 \
      -- --device cuda >"$OUT/serve_$(basename "$m").log" 2>&1
    rc=$?
    set -e
    echo "cli: kestrel serve --device cuda on $m, 48 concurrent clients against one at a time: exit $rc ($(tail -1 "$OUT/serve_$(basename "$m").log"))" |
      tee -a "$OUT/cli.txt"
    [ $rc -ne 0 ] && tests_rc=$rc
  done
  set +e  # prompt-lookup speculation: checks through the prefill decoder, rewinds, 48 clients at once
  python3 tests/server/concurrent_equals_serial.py "$BUILD/src/kestrel" "$sdir/moe" --streams 48 --requests 96 --max-tokens 32 \
    -- --device cuda --speculative ngram >"$OUT/serve_moe_speculative.log" 2>&1
  rc=$?
  set -e
  echo "cli: kestrel serve --device cuda --speculative ngram on the MoE fixture, 48 concurrent clients against one at a time: exit $rc ($(tail -1 "$OUT/serve_moe_speculative.log"))" |
    tee -a "$OUT/cli.txt"
  [ $rc -ne 0 ] && tests_rc=$rc
  "$BUILD/src/kestrel" serve --model "$sdir/moe" --device cuda --port 0 2>"$OUT/serve_loadgen.log" &
  spid=$!
  for _ in $(seq 100); do grep -q "on http://" "$OUT/serve_loadgen.log" && break; sleep 0.2; done
  port=$(grep -o "on http://[0-9.]*:[0-9]*" "$OUT/serve_loadgen.log" | sed 's/.*://')
  set +e
  "$BUILD/src/kestrel" loadgen --url "http://127.0.0.1:$port" --streams 48 --requests 192 --prompt-tokens 16 --max-tokens 32 --chat \
    --json "$OUT/loadgen_fixture.json" >"$OUT/loadgen_fixture.txt" 2>&1
  rc=$?
  curl -sf "http://127.0.0.1:$port/health" >/dev/null || rc=8
  kill -TERM $spid
  wait $spid || rc=9
  set -e
  echo "cli: kestrel loadgen, 48 streams on the GPU-served MoE fixture: exit $rc" | tee -a "$OUT/cli.txt"
  [ $rc -ne 0 ] && tests_rc=$rc
  # A full-size random-weight model served (byte tokens, and a readable token for every other id):
  # throughput and time to first token at 1, 16 and 64 streams.
  if [ -z "${SKIP_BENCH:-}" ]; then
    mkdir -p "$sdir/tok"
    python3 scripts/make_byte_tokenizer.py "$sdir/tok/tokenizer.json" --vocab 151936
    "$BUILD/src/kestrel" serve --config configs/qwen3-30b-a3b-nvfp4.json --random-weights --tokenizer "$sdir/tok" \
      --max-batch 64 --context 4096 --port 0 2>"$OUT/serve_random.log" &
    spid=$!
    for _ in $(seq 600); do grep -q "on http://" "$OUT/serve_random.log" && break; sleep 0.2; done
    port=$(grep -o "on http://[0-9.]*:[0-9]*" "$OUT/serve_random.log" | sed 's/.*://')
    for n in 1 16 64; do
      echo "== kestrel loadgen --streams $n on serve --config configs/qwen3-30b-a3b-nvfp4.json --random-weights" >>"$OUT/serve_bench.txt"
      "$BUILD/src/kestrel" loadgen --url "http://127.0.0.1:$port" --streams $n --requests $((n < 8 ? 8 : 2 * n)) \
        --prompt-tokens 32 --max-tokens 64 --json "$OUT/loadgen_random_$n.json" >>"$OUT/serve_bench.txt" 2>&1 ||
        echo "cli: kestrel loadgen --streams $n on the random-weight server failed" | tee -a "$OUT/cli.txt"
    done
    # The prefix cache: a 2,000-token prompt's repeat against its first time to first token.
    echo "== prefix cache, serve --config configs/qwen3-30b-a3b-nvfp4.json --random-weights" >>"$OUT/serve_bench.txt"
    python3 tests/server/prefix_cache_ttft.py "$port" >>"$OUT/serve_bench.txt" 2>&1 ||
      { echo "cli: the prefix cache's check on the random-weight server failed" | tee -a "$OUT/cli.txt"; tests_rc=1; }
    kill -TERM $spid
    wait $spid || echo "cli: the random-weight server did not stop cleanly" | tee -a "$OUT/cli.txt"
  fi
  rm -rf "$sdir"
else
  echo "cli: this build has no kestrel serve (cpp-httplib missing: scripts/gpu_deps.sh carries it)" | tee -a "$OUT/cli.txt"
fi

# A split model through the commands: --tp over every GPU present (one GPU: the split code path
# with one rank), and expert parallelism with two or more.
GPUS=$(nvidia-smi -L | wc -l)
split_vs_cpu() {  # label, then layout flags
  local label=$1; shift
  "$BUILD/src/kestrel" logits --model "$fx" --tokens 1,5,9,13,17,21 --device cuda --kv-dtype f32 "$@" \
    --out "$OUT/logits_split.bin" 2>>"$OUT/cli.txt"
  python3 -c "
import numpy as np, sys
a, b = (np.fromfile(sys.argv[i], dtype=np.float32) for i in (1, 2))
print(f'cli: kestrel logits --device cuda $label vs cpu on $fx: rel L2 {np.linalg.norm(a - b) / np.linalg.norm(b):.2e}')
" "$OUT/logits_split.bin" "$OUT/logits_cpu.bin" | tee -a "$OUT/cli.txt"
}
split_vs_cpu "--tp $GPUS" --tp "$GPUS"
[ "$GPUS" -ge 2 ] && split_vs_cpu "--tp $GPUS --ep $GPUS" --tp "$GPUS" --ep "$GPUS"

# Collectives over every GPU present (the default of --gpus): one-shot all-reduce against NCCL.
"$BUILD/src/kestrel" bench-allreduce --sizes 4K,16K,64K,256K,1M --iters 200 --json "$OUT/allreduce.json" >"$OUT/allreduce.txt" 2>&1 ||
  echo "cli: kestrel bench-allreduce failed: see $OUT/allreduce.txt" | tee -a "$OUT/cli.txt"

bench() {  # name, then kestrel bench arguments
  local name=$1; shift
  echo "== $name: kestrel bench $*" >>"$OUT/bench.txt"
  "$BUILD/src/kestrel" bench "$@" --json "$OUT/bench_$name.json" 2>>"$OUT/bench.txt" | tee -a "$OUT/bench.txt"
}
if [ -z "${SKIP_BENCH:-}" ]; then
  bench qwen3-30b-a3b --config configs/qwen3-30b-a3b-nvfp4.json --random-weights --batch 1,2,3,4,8,16,32,64 --context 1024 --steps 50 --ops \
    --plot "$OUT/ops_qwen3-30b-a3b.svg" --prefill 512,4096 --speculative 4
  # Long contexts (8k), and a cache sized as a server sizes it (32k) holding 1k-position sequences.
  bench qwen3-30b-a3b-ctx8k --config configs/qwen3-30b-a3b-nvfp4.json --random-weights --batch 1,8,32 --context 8192 --steps 30
  # The float32 KV cache (the CPU's) against the default BF16 one.
  bench qwen3-30b-a3b-kv-f32 --config configs/qwen3-30b-a3b-nvfp4.json --random-weights --batch 1,8,32 --context 1024 \
    --steps 50 --kv-dtype f32
  bench qwen3-30b-a3b-ctx8k-kv-f32 --config configs/qwen3-30b-a3b-nvfp4.json --random-weights --batch 1,8,32 \
    --context 8192 --steps 30 --kv-dtype f32
  bench qwen3-30b-a3b-cap32k --config configs/qwen3-30b-a3b-nvfp4.json --random-weights --batch 1,8 --context 1024 \
    --capacity 32768 --steps 30
  KESTREL_MOE_GROUPED_MIN_BATCH=1000 bench qwen3-30b-a3b-moe-per-slot --config configs/qwen3-30b-a3b-nvfp4.json --random-weights \
    --batch 2,4,8,32 --context 1024 --steps 50
  KESTREL_MOE_SLOT_MMA=0 bench qwen3-30b-a3b-down-cuda-cores --config configs/qwen3-30b-a3b-nvfp4.json --random-weights \
    --batch 1 --context 1024 --steps 50
  KESTREL_MMA_MIN_BATCH=1 bench qwen3-30b-a3b-mma-b1 --config configs/qwen3-30b-a3b-nvfp4.json --random-weights --batch 1 --context 1024 --steps 50
  # One token's gate/up on CUDA cores from floats instead of tensor cores from the router's fragment rows.
  KESTREL_MOE_ONE_TOKEN_MMA=0 bench qwen3-30b-a3b-gate-up-cuda-cores --config configs/qwen3-30b-a3b-nvfp4.json \
    --random-weights --batch 1 --context 1024 --steps 50
  # The router's counter kernel at 1-4 tokens, and attention's splits at every batch (the cluster
  # kernels' alternatives).
  KESTREL_ROUTE_CLUSTER=0 bench qwen3-30b-a3b-route-counter --config configs/qwen3-30b-a3b-nvfp4.json --random-weights \
    --batch 1,2 --context 1024 --steps 50
  KESTREL_ATT_CLUSTER=0 bench qwen3-30b-a3b-att-splits --config configs/qwen3-30b-a3b-nvfp4.json --random-weights \
    --batch 16,32 --context 1024 --steps 50
  # QK norm, rotary and the cache write in their own kernel instead of inside attention.
  KESTREL_ATT_QK=0 bench qwen3-30b-a3b-qk-kernel --config configs/qwen3-30b-a3b-nvfp4.json --random-weights --batch 1,8 \
    --context 1024 --steps 50
  KESTREL_ATT_QK=0 bench glm-4.5-air-qk-kernel --config configs/glm-4.5-air-nvfp4.json --random-weights --batch 1,8 \
    --context 1024 --steps 30
  # q/k/v and o on the wide kernel instead of the tiled one with K split over clusters.
  KESTREL_LINEAR_SPLIT=0 bench qwen3-30b-a3b-no-split --config configs/qwen3-30b-a3b-nvfp4.json --random-weights \
    --batch 8,16,32,64 --context 1024 --steps 50
  # q/k/v at 2-7 tokens and o at 1-7 from floats (each tile splitting them, one token's o on CUDA
  # cores) instead of fragment rows.
  KESTREL_LINEAR_FRAG=0 bench qwen3-30b-a3b-linear-floats --config configs/qwen3-30b-a3b-nvfp4.json --random-weights \
    --batch 1,2,4 --context 1024 --steps 50
  KESTREL_MOE_FRAG=0 bench qwen3-30b-a3b-no-frag --config configs/qwen3-30b-a3b-nvfp4.json --random-weights \
    --batch 4,8,16,32,64 --context 1024 --steps 50
  KESTREL_PDL=0 bench qwen3-30b-a3b-no-pdl --config configs/qwen3-30b-a3b-nvfp4.json --random-weights --batch 1,8 --context 1024 --steps 50
  # The stage step beside the launched one.
  bench qwen3-30b-a3b-stages --config configs/qwen3-30b-a3b-nvfp4.json --random-weights --batch 1,2,4,8 \
    --context 1024 --steps 30 --stages
  bench glm-4.5-air --config configs/glm-4.5-air-nvfp4.json --random-weights --batch 1,2,4,8 --context 1024 --steps 30
  bench glm-4.5-air-ops --config configs/glm-4.5-air-nvfp4.json --random-weights --batch 1 --context 1024 --steps 30 --ops
  # One token's q/k/v (58.7 M weights) with the RMSNorm fused on CUDA cores instead of tensor cores.
  KESTREL_LINEAR_FRAG_MIN_MWEIGHTS=100000 bench glm-4.5-air-qkv-cuda-cores --config configs/glm-4.5-air-nvfp4.json \
    --random-weights --batch 1 --context 1024 --steps 30
  # o at 2-7 tokens in 8-warp blocks instead of 16 (256 tiles of 192 chunks).
  KESTREL_LINEAR_WIDE16=0 bench glm-4.5-air-wide8 --config configs/glm-4.5-air-nvfp4.json --random-weights --batch 2,4 \
    --context 1024 --steps 30
  # MLA models are larger than one GPU: slices of 5 and 9 layers (3 dense + 2 or 6 MoE); the
  # difference gives one MoE layer's time and floor, extrapolated to the full depth below.
  for m in glm-5 deepseek-v3; do
    for n in 5 9; do
      bench "$m-l$n" --config "configs/$m-nvfp4.json" --random-weights --layers "$n" --batch 1,8 --context 1024 --steps 30 \
        --speculative 4
    done
  done
  bench glm-5-l5-cap32k --config configs/glm-5-nvfp4.json --random-weights --layers 5 --batch 1,8 --context 1024 \
    --capacity 32768 --steps 30
  bench glm-5-l5-ctx4k --config configs/glm-5-nvfp4.json --random-weights --layers 5 --batch 1 --context 4096 --steps 30 --ops
  python3 scripts/extrapolate_layers.py "$OUT" glm-5:78 deepseek-v3:61 | tee -a "$OUT/bench.txt"
fi
# Split decode over every GPU present, against the roofline of the same layout.
if [ -z "${SKIP_BENCH:-}" ] && [ "$GPUS" -ge 2 ]; then
  for m in qwen3-30b-a3b glm-4.5-air; do
    bench "$m-tp$GPUS" --config "configs/$m-nvfp4.json" --random-weights --batch 1,8 --context 1024 --steps 30 --tp "$GPUS" --ops
    bench "$m-tp$GPUS-ep$GPUS" --config "configs/$m-nvfp4.json" --random-weights --batch 1,8 --context 1024 --steps 30 \
      --tp "$GPUS" --ep "$GPUS"
  done
fi

echo
echo "== kestrel GPU suite =="
printf "tests: %s\n" "$(grep -E '^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test' "$OUT/gpu_tests.log" | tr '\n' ' ')"
[ -f "$OUT/gpu_tests_fill0.log" ] &&
  printf "linear tests, groups in one block row: %s\n" "$(grep -E '^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test' "$OUT/gpu_tests_fill0.log" | tr '\n' ' ')"
[ -f "$OUT/gpu_tests_nosplit.log" ] &&
  printf "linear tests, K never split: %s\n" "$(grep -E '^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test' "$OUT/gpu_tests_nosplit.log" | tr '\n' ' ')"
[ -f "$OUT/gpu_tests_nofrag.log" ] &&
  printf "MoE and model tests, activations split per tile: %s\n" "$(grep -E '^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test' "$OUT/gpu_tests_nofrag.log" | tr '\n' ' ')"
[ -f "$OUT/gpu_tests_one_gpu.log" ] &&
  printf "split tests on one GPU: %s\n" "$(grep -E '^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test' "$OUT/gpu_tests_one_gpu.log" | tr '\n' ' ')"
grep -h "random Qwen3" "$OUT/gpu_tests.log" || true
grep "^cli:" "$OUT/cli.txt" || true
[ -f "$OUT/allreduce.json" ] && cat "$OUT/allreduce.txt" || true
[ -f "$OUT/serve_bench.txt" ] && grep -E "^== |ok, |TTFT|tokens/s|^suffix" "$OUT/serve_bench.txt" || true
[ -f "$OUT/bench.txt" ] && grep -E "^== |^prefill|^ *tokens +ms|^ *(batch|[0-9])|^  [a-z_]+ +[0-9]|^  total|^  between ops|^  step \(graph\)|^ *stage step|^extrapolated|^ *[a-z0-9.-]+ +B=" "$OUT/bench.txt" | grep -v "random weights" || true
exit $tests_rc
