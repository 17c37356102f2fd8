#!/usr/bin/env bash
# Developer builds of the onnxruntime custom-op library outside pip. The package itself is built
# by `pip install .` / `pip wheel .` (scikit-build-core runs this folder's CMakeLists.txt and puts
# the library into the wheel); nothing here writes into the Python package.
#   build.sh          Release -> plugins/onnxruntime/build/libinfmoe_ort.so
#   build.sh --asan   AddressSanitizer + UBSan -> plugins/onnxruntime/build-asan/libinfmoe_ort.so (fuzz.py)
# Load either with INFMOE_ORT_LIBRARY=<path>. Headers: ORT_INCLUDE_DIR if set, else fetched by
# fetch_deps.sh. CUDA: INFMOE_CUDA=ON|OFF (default: ON when nvcc compiles the kernel); the ASan
# build is CPU only.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)  # the plugin folder
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
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ "$variant" = asan ]; then
  build="$here/build-asan"
  cmake -S "$here" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DINFMOE_ASAN=ON -DINFMOE_CUDA=OFF \
    -DINFMOE_REQUIRE_KERNEL=ON >/dev/null
else
  build="$here/build"
  cmake -S "$here" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DINFMOE_REQUIRE_KERNEL=ON >/dev/null
fi
cmake --build "$build" --parallel
echo "build.sh: $build/libinfmoe_ort.so ($variant); use it with INFMOE_ORT_LIBRARY=$build/libinfmoe_ort.so"
