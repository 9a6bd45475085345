#!/usr/bin/env bash
# The GPU machine has a compiler and CUDA but no Debian -dev packages: unpack the headers and
# static libraries the build needs into .deps/root (ignored by git), to be carried along with
# .third_party (XGrammar's source).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .deps && mkdir -p .deps/debs .deps/root
(cd .deps/debs && apt-get download nlohmann-json3-dev libgtest-dev libcli11-dev libpcre2-dev libpcre2-8-0 \
  libicu-dev libicu72 libcpp-httplib-dev libcpp-httplib0.11 libssl-dev zlib1g-dev libbrotli-dev libbrotli1 libboost1.81-dev >/dev/null)
for f in .deps/debs/*.deb; do dpkg -x "$f" .deps/root; done
rm -rf .deps/debs .deps/root/usr/share/doc .deps/root/usr/share/man
# Static archives are not linked (except GoogleTest's) and would not fit the carry limit.
find .deps/root -name '*.a' ! -name 'libgtest*.a' -delete
# Boost's headers (Asio and Beast, for `kestrel serve`) are 150 MB unpacked: the tree travels
# compressed, and scripts/gpu_env.sh unpacks it on the GPU machine.
tar -C .deps -cf - root | xz -T0 -6 >.deps/root.tar.xz
rm -rf .deps/root
# XGrammar's source release, which the server's build compiles (carry .third_party too).
scripts/fetch_xgrammar.sh
du -sh .deps
