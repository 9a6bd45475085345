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
cd "$(dirname "$0")/.."
scripts/fetch_xgrammar.sh
# The openai client, jsonschema and schemathesis for the server tests, in .venv (Debian's Python is
# externally managed).
[ -x .venv/bin/python3 ] || python3 -m venv .venv
.venv/bin/python3 -c "import openai" 2>/dev/null || .venv/bin/pip install -q "openai>=1.0"
.venv/bin/python3 -c "import jsonschema" 2>/dev/null || .venv/bin/pip install -q jsonschema
[ -x .venv/bin/schemathesis ] || .venv/bin/pip install -q "schemathesis>=4"
