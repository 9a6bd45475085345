#!/usr/bin/env bash
# Installs what building and testing kestrel needs on Debian (run as root, or with sudo).
set -euo pipefail
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
PKGS=(cmake ninja-build g++ pkg-config libgtest-dev nlohmann-json3-dev libcli11-dev libpcre2-dev libicu-dev clang libclang-rt-14-dev
      libcpp-httplib-dev libboost1.81-dev python3-venv curl)
missing=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# XGrammar's C++ core (grammar-constrained sampling for `kestrel serve`), built by CMake from its
# pinned source release into .third_party/ (ignored by git).
XGRAMMAR_VERSION=0.2.9
XGRAMMAR_SHA256=87b466bca2475e29bb0323abc62c6c33cbcbcff47e5fb800a3e2099ac9620b90
XGRAMMAR_URL=https://files.pythonhosted.org/packages/3a/2f/5bf8e8fa6619cff534932f79b0abc81a417d354bc5093252c1a6081d0a93/xgrammar-$XGRAMMAR_VERSION.tar.gz
cd "$(dirname "$0")/.."
if [ ! -f .third_party/xgrammar-$XGRAMMAR_VERSION/include/xgrammar/xgrammar.h ]; then
  mkdir -p .third_party
  curl -fsSL --retry 3 -o .third_party/xgrammar.tar.gz "$XGRAMMAR_URL"
  echo "$XGRAMMAR_SHA256  .third_party/xgrammar.tar.gz" | sha256sum -c --quiet -
  tar -xzf .third_party/xgrammar.tar.gz -C .third_party
  rm .third_party/xgrammar.tar.gz
fi
# The openai client, jsonschema and schemathesis for the server tests, in .venv (Debian's Python is
# externally managed).
[ -x .venv/bin/python3 ] || python3 -m venv .venv
.venv/bin/python3 -c "import openai" 2>/dev/null || .venv/bin/pip install -q "openai>=1.0"
.venv/bin/python3 -c "import jsonschema" 2>/dev/null || .venv/bin/pip install -q jsonschema
[ -x .venv/bin/schemathesis ] || .venv/bin/pip install -q "schemathesis>=4"
