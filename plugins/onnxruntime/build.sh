#!/usr/bin/env bash
# Build the onnxruntime custom-op library (Release) and copy it to infmoe_export/lib/,
# where infmoe_export.runtimes.ort_kernel finds it.
#   build.sh          Release build -> infmoe_export/lib/libinfmoe_ort.so
#   build.sh --asan   AddressSanitizer build -> plugins/onnxruntime/build-asan/libinfmoe_ort.so
# Headers: ORT_INCLUDE_DIR if set, else fetched by fetch_deps.sh. CUDA: INFMOE_CUDA=ON|OFF
# (default: ON when nvcc is found); the ASan build is CPU only. INFMOE_ARCH: the -march value
# (default native: tuned for this machine's CPU; set e.g. x86-64-v3 for a library to copy elsewhere).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
variant=release
if [ "${1:-}" = "--asan" ]; then
  variant=asan
elif [ $# -gt 0 ]; then
  echo "usage: build.sh [--asan]" >&2
  exit 2
fi

for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "build.sh: $tool not found" >&2; exit 1; }
done
if [ -z "${ORT_INCLUDE_DIR:-}" ]; then
  "$here/fetch_deps.sh"
fi

cuda=${INFMOE_CUDA:-}
if [ -z "$cuda" ]; then
  cuda=OFF
  command -v nvcc >/dev/null && cuda=ON
fi
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)

if [ "$variant" = asan ]; then
  build="$here/build-asan"
  cmake -S "$here" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DINFMOE_ASAN=ON -DINFMOE_CUDA=OFF \
    -DINFMOE_ARCH="${INFMOE_ARCH-native}" >/dev/null
  cmake --build "$build" --parallel
  echo "build.sh: $build/libinfmoe_ort.so (AddressSanitizer)"
else
  build="$here/build"
  release() {
    cmake -S "$here" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DINFMOE_CUDA="$1" \
      -DINFMOE_ARCH="${INFMOE_ARCH-native}" >/dev/null && cmake --build "$build" --parallel
  }
  if ! release "$cuda"; then
    # An nvcc that was only detected, not asked for, must not cost the CPU kernel.
    [ "$cuda" = ON ] && [ -z "${INFMOE_CUDA:-}" ] || exit 1
    echo "build.sh: the CUDA kernel did not build; building the CPU kernel only" >&2
    cuda=OFF
    release OFF
  fi
  mkdir -p "$repo/infmoe_export/lib"
  # Copy then rename, so a running process never sees a half-written library.
  cp "$build/libinfmoe_ort.so" "$repo/infmoe_export/lib/.libinfmoe_ort.so.tmp"
  mv -f "$repo/infmoe_export/lib/.libinfmoe_ort.so.tmp" "$repo/infmoe_export/lib/libinfmoe_ort.so"
  echo "build.sh: $repo/infmoe_export/lib/libinfmoe_ort.so (CUDA kernel: $cuda)"
fi
