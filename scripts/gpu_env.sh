# Sourced by the scripts that run on the GPU machine: point the build at the headers and
# libraries in .deps (scripts/gpu_deps.sh unpacks them; the GPU machine has no -dev packages),
# and define gpu_build LOG TARGET...: configure and build $BUILD (default build-gpu) for sm_90a.
BUILD=${BUILD:-build-gpu}
if [ -f .deps/root.tar.xz ] && [ ! -d .deps/root ]; then
  mkdir -p .deps/root.partial && tar -C .deps/root.partial -xJf .deps/root.tar.xz && mv .deps/root.partial/root .deps/root
  rm -rf .deps/root.partial
fi
if [ -d .deps/root ]; then
  DEPS=$PWD/.deps/root
  export CMAKE_PREFIX_PATH=$DEPS/usr
  export PKG_CONFIG_PATH=$DEPS/usr/lib/x86_64-linux-gnu/pkgconfig:$DEPS/usr/share/pkgconfig
  export PKG_CONFIG_SYSROOT_DIR=$DEPS
  export CXXFLAGS="-isystem $DEPS/usr/include ${CXXFLAGS:-}"
  export LD_LIBRARY_PATH=$DEPS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
gpu_build() {
  local log=$1; shift
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKESTREL_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a >"$log" 2>&1 ||
    { tail -30 "$log"; return 1; }
  cmake --build "$BUILD" --target "$@" -j "$(nproc)" >>"$log" 2>&1 || { grep -E "error" "$log" | head -30; return 1; }
}
