#!/usr/bin/env bash
# The GPU machine has a compiler and CUDA but no Debian -dev packages: unpack the headers and
# static libraries the build needs into .deps/root (ignored by git), to be carried along.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .deps && mkdir -p .deps/debs .deps/root
(cd .deps/debs && apt-get download nlohmann-json3-dev libgtest-dev libcli11-dev libpcre2-dev libpcre2-8-0 \
  libicu-dev libicu72 libcpp-httplib-dev libcpp-httplib0.11 libssl-dev zlib1g-dev libbrotli-dev libbrotli1 >/dev/null)
for f in .deps/debs/*.deb; do dpkg -x "$f" .deps/root; done
rm -rf .deps/debs .deps/root/usr/share/doc .deps/root/usr/share/man
# Static archives are not linked (except GoogleTest's) and would not fit the carry limit.
find .deps/root -name '*.a' ! -name 'libgtest*.a' -delete
du -sh .deps
