#!/usr/bin/env bash
# Times loading a 17 GB NVFP4 checkpoint onto the GPU from a warm page cache, on the GPU machine:
# writes a random Qwen3-30B-A3B checkpoint of full shapes (make_random_checkpoint.py; kept in DIR
# and reused), builds kestrel (scripts/gpu_env.sh) meanwhile, reads the checkpoint once so that
# it is in the page cache, then runs `kestrel bench --model DIR`, which prints the upload
# ("weights on the GPU: ... GiB in ... s") and the time from opening the checkpoint to ready.
#   scripts/time_load.sh [DIR]      (default /tmp/qwen3-30b-a3b-random)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-/tmp/qwen3-30b-a3b-random}
LOG=${OUT:-/tmp}
source scripts/gpu_env.sh
writer=
if [ ! -f "$DIR/model.safetensors.index.json" ]; then  # the index is written last
  python3 scripts/make_random_checkpoint.py "$DIR" 2>"$LOG/make_checkpoint.log" &
  writer=$!
fi
gpu_build "$LOG/build.log" kestrel || exit 1
if [ -n "$writer" ]; then
  wait "$writer" || { cat "$LOG/make_checkpoint.log"; exit 1; }
fi
tail -1 "$LOG/make_checkpoint.log" 2>/dev/null || true
du -sh "$DIR"
start=$(date +%s%N)
cat "$DIR"/*.safetensors >/dev/null
echo "page cache warmed: read $DIR in $(( ($(date +%s%N) - start) / 1000000 )) ms"
"$BUILD/src/kestrel" bench --model "$DIR" --batch 1 --steps 5 2>&1
