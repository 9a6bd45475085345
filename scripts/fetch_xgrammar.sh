#!/usr/bin/env bash
# XGrammar's C++ core (grammar-constrained sampling for `kestrel serve`), built by CMake from its
# pinned source release into .third_party/ (ignored by git).
# Used by scripts/install_deps.sh and scripts/gpu_deps.sh (the GPU machine has no network: carry
# .third_party there).
set -euo pipefail
cd "$(dirname "$0")/.."
XGRAMMAR_VERSION=0.2.9
XGRAMMAR_SHA256=87b466bca2475e29bb0323abc62c6c33cbcbcff47e5fb800a3e2099ac9620b90
XGRAMMAR_URL=https://files.pythonhosted.org/packages/3a/2f/5bf8e8fa6619cff534932f79b0abc81a417d354bc5093252c1a6081d0a93/xgrammar-$XGRAMMAR_VERSION.tar.gz
if [ ! -f .third_party/xgrammar-$XGRAMMAR_VERSION/include/xgrammar/xgrammar.h ]; then
  mkdir -p .third_party
  curl -fsSL --retry 3 -o .third_party/xgrammar.tar.gz "$XGRAMMAR_URL"
  echo "$XGRAMMAR_SHA256  .third_party/xgrammar.tar.gz" | sha256sum -c --quiet -
  tar -xzf .third_party/xgrammar.tar.gz -C .third_party
  rm .third_party/xgrammar.tar.gz
fi
