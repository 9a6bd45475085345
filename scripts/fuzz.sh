#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (+ASan/UBSan) and runs each for a bounded time.
# Usage: scripts/fuzz.sh [seconds per target, default 60]
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-60}
BUILD=build-fuzz
[ -f "$BUILD/build.ninja" ] || CC=clang CXX=clang++ cmake -S . -B "$BUILD" -G Ninja -DKESTREL_FUZZ=ON \
  -DKESTREL_TESTS=OFF -DKESTREL_CUDA=OFF -DKESTREL_NATIVE=OFF >/dev/null
targets=$(sed -n 's/^foreach(target \(.*\))$/\1/p' fuzz/CMakeLists.txt)
# Targets built only with some dependencies (fuzz_json_schema: where the server is), where configured.
for t in $(sed -n 's/^  add_executable(\(fuzz_[a-z_]*\) .*/\1/p' fuzz/CMakeLists.txt); do
  if cmake --build "$BUILD" --target help | grep -q "^$t:"; then targets="$targets $t"; fi
done
cmake --build "$BUILD" --target $targets
for t in $targets; do
  seeds=fuzz/corpus/${t#fuzz_}
  work=$(mktemp -d)
  echo "fuzzing $t for ${SECS}s (seeds: $seeds)"
  [ -d "$seeds" ] || seeds=""
  if ! "$BUILD/fuzz/$t" -max_total_time="$SECS" -max_len=16384 -timeout=10 -rss_limit_mb=4096 "$work" $seeds \
      >"$work.log" 2>&1; then
    tail -n 40 "$work.log"
    echo "fuzzing: $t found a crash"
    exit 1
  fi
  tail -n 1 "$work.log"
  rm -f "$work.log"
  rm -rf "$work"
done
echo "fuzzing: no crashes"
