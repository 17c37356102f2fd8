#!/usr/bin/env bash
# Build the kernel and its C++ test driver (tests/driver.cc) and run the driver against reference
# data written by the Python references (tests/write_reference.py): every CPU computation of the
# kernel (the float and quantized expert ops, QMatMul, DecoderAttention, WindowStarts, CheckStarts).
#   cross_test.sh aarch64 [CASES.bin]   cross-compile (library + driver) with aarch64-linux-gnu-g++
#                                       for armv8-a, run the driver under qemu-aarch64
#   cross_test.sh native [CASES.bin]    build for this machine; run the driver once per CPU variant
#                                       it supports, twice more with the float decode's streaming
#                                       forced each way (INFMOE_INTEL_STREAMS=0 and 1), and
#                                       (x86-64, when qemu-x86_64 exists) under
#                                       qemu-x86_64 -cpu qemu64, a CPU without any AVX, where the
#                                       dispatch must choose the baseline and nothing may trap
#   cross_test.sh cuda [CASES.bin]      build for this machine with the CUDA kernel (needs nvcc) and
#                                       run the driver once, the ffn cases also on the GPU (needs
#                                       one); build-test-cuda/infmoe_cuda_bench then times its decode
# Without CASES.bin, fresh random cases are written with $PYTHON (default: the repository's
# .venv/bin/python). Headers: as for the library (ORT_INCLUDE_DIR / EIGEN_INCLUDE_DIR, else
# third_party/ from fetch_deps.sh). Build folders: plugins/onnxruntime/build-test-<target>/.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)  # the plugin folder
repo=$(cd "$here/../.." && pwd)
target=${1:-}
data=${2:-}
case "$target" in
  aarch64 | native | cuda) ;;
  *) echo "usage: cross_test.sh aarch64|native|cuda [CASES.bin]" >&2; exit 2 ;;
esac

build="$here/build-test-$target"
config=(-DCMAKE_BUILD_TYPE=Release -DINFMOE_TESTS=ON -DINFMOE_CUDA=$([ "$target" = cuda ] && echo ON || echo OFF)
        -DINFMOE_REQUIRE_KERNEL=ON)
if [ -n "${EIGEN_INCLUDE_DIR:-}" ]; then config+=(-DEIGEN_INCLUDE_DIR="$EIGEN_INCLUDE_DIR"); fi
if [ "$target" = aarch64 ]; then
  for tool in aarch64-linux-gnu-g++ qemu-aarch64; do
    command -v "$tool" >/dev/null || { echo "cross_test: $tool not found (apt-get install g++-aarch64-linux-gnu qemu-user)" >&2; exit 3; }
  done
  config+=(-DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64
           -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ -DCMAKE_CXX_FLAGS=-march=armv8-a)
fi
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$here" -B "$build" "${generator[@]}" "${config[@]}" >/dev/null
cmake --build "$build" --parallel >"$build/build.log" 2>&1 || { tail -30 "$build/build.log" >&2; exit 1; }
# The variant objects must define no global symbol but their own entry points (CMakeLists.txt).
leaked=$(cd "$build" && nm --defined-only -g ffn_*.o | grep -v -e '^$' -e ':$' -e ' _ZN6infmoe' || true)
[ -z "$leaked" ] || { echo "cross_test: variant objects export shared symbols:"; echo "$leaked"; exit 1; } >&2
echo "cross_test: built $(cd "$build" && ls libinfmoe_ort.so infmoe_ffn_test | tr '\n' ' ')($target)"

if [ -z "$data" ]; then
  data="$build/cases.bin"
  "${PYTHON:-$repo/.venv/bin/python}" "$here/tests/write_reference.py" "$data"
fi

status=0
if [ "$target" = aarch64 ]; then
  readelf -h "$build/libinfmoe_ort.so" | grep -q 'AArch64' || { echo "cross_test: the library is not AArch64" >&2; exit 1; }
  echo "cross_test: libinfmoe_ort.so and the driver are AArch64 ELF; running under qemu-aarch64"
  qemu-aarch64 -L /usr/aarch64-linux-gnu "$build/infmoe_ffn_test" "$data" || status=1
elif [ "$target" = cuda ]; then
  "$build/infmoe_ffn_test" "$data" || status=1
else
  ran=""
  for variant in avx512 avx2 baseline; do
    out=$(INFMOE_CPU_VARIANT=$variant "$build/infmoe_ffn_test" "$data") || status=1
    got=$(sed -n 's/.*CPU variant \([a-z0-9]*\).*/\1/p' <<<"$out" | head -1)
    case " $ran " in *" $got "*) continue ;; esac  # the CPU lacks $variant: already run as $got
    ran="$ran $got"
    echo "$out"
  done
  # Float decode streams rows one way on Intel's cores and another elsewhere (IntelStreams in the
  # library): both ways here, whatever this CPU is, with its widest variant.
  for streams in 0 1; do
    out=$(INFMOE_INTEL_STREAMS=$streams "$build/infmoe_ffn_test" "$data") || status=1
    echo "$out" | tail -1
  done
  if [ "$(uname -m)" = x86_64 ] && command -v qemu-x86_64 >/dev/null; then
    echo "cross_test: under qemu-x86_64 -cpu qemu64 (SSE2 only, no AVX): the dispatch must pick the baseline"
    out=$(qemu-x86_64 -cpu qemu64 "$build/infmoe_ffn_test" "$data") || status=1
    echo "$out" | tail -1
    grep -q "CPU variant baseline" <<<"$out" || { echo "cross_test: dispatch did not pick the baseline under qemu64" >&2; status=1; }
  fi
fi
exit $status
