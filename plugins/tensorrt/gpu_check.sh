#!/usr/bin/env bash
# The TensorRT path on a real GPU, in one command: what no machine of this project could run.
#
#     bash plugins/tensorrt/gpu_check.sh [OUT]          # OUT defaults to runs/gpu_check
#
# Needs an NVIDIA GPU and driver, and this checkout installed with TensorRT:
#     bash setup.sh && .venv/bin/pip install '.[tensorrt]'
# (plus a CUDA build of torch 2.13 for the Triton benchmark and the JIT plugin; without one those
# steps say SKIP). Every step prints PASS, FAIL or SKIP with its reason and the log to read; the
# last line is the summary, and the exit status is 0 only when no step failed.
#
#   1. environment   GPU, driver, TensorRT version in the supported range (tensorrt>=10.9,<12)
#   2. kernel        python -m benchmarks.triton_kernel: both kernel modes vs the reference on the
#                    GPU, float, int8 and int4 weights, the AOT PTX loads in this driver, batch-1
#                    decode bandwidth
#      cuda-kernel   plugins/onnxruntime/tools/cross_test.sh cuda: the C++ driver's cases, the float op's
#                    also on the GPU (the onnxruntime library's CUDA computation)
#      cuda-bench    its batch-1 decode against the GPU's copy bandwidth
#                    (plugins/onnxruntime/tests/bench_cuda.cc)
#   3. tests         tests/test_tensorrt.py and tests/test_trt_quant.py, whose engine tests (AOT and
#                    JIT, prefill + decode vs PyTorch; int8 / int4 vs the dequantized weights) run
#                    only here
#   4. engines       infmoe-export trt --k 1,2,8 (AOT plugin, fp32, strongly typed, TF32 off)
#   5. parity        infmoe-export parity --backends trt: SPEC §5 against PyTorch, K = 1, 2, 8
#   6. decode        infmoe-export bench --seq 1 --batch 1: decode latency, PyTorch vs TensorRT
#   7. run           infmoe-export run --engines: generation from an AOT engine (no Python plugin)
#   8. precisions    infmoe-export trt --k 2 --dtype P for P = fp16, int8, int4, then a generation
#                    from each

set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
CLI=${INFMOE_EXPORT:-$(dirname "$PY")/infmoe-export}
OUT=${1:-runs/gpu_check}
mkdir -p "$OUT"
LOGS="$OUT/logs"
mkdir -p "$LOGS"
PASSED=() FAILED=() SKIPPED=()

verdict() {  # verdict NAME STATUS DETAIL
    printf '%-5s %-12s %s\n' "$2" "$1" "$3"
    case $2 in PASS) PASSED+=("$1") ;; FAIL) FAILED+=("$1") ;; *) SKIPPED+=("$1") ;; esac
}

step() {  # step NAME SECONDS COMMAND...: run it, log it, PASS on exit 0
    local name=$1 seconds=$2
    shift 2
    echo "----- $name: $*"
    timeout "$seconds" "$@" 2>&1 | tee "$LOGS/$name.log"
    local code=${PIPESTATUS[0]}
    if [ "$code" = 0 ]; then
        verdict "$name" PASS "log: $LOGS/$name.log"
    else
        local why
        why=$(grep -m1 -E '^(error|FAILED|E )' "$LOGS/$name.log" || tail -n 1 "$LOGS/$name.log")
        [ "$code" = 124 ] && why="timed out after ${seconds}s"
        verdict "$name" FAIL "exit $code: $why (log: $LOGS/$name.log)"
    fi
}

# 1. environment
echo "----- environment"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader | tee "$LOGS/environment.log"
fi
TRT=$("$PY" -c 'from infmoe_export.runtimes.tensorrt import require_tensorrt; print(require_tensorrt())' 2>&1 | tail -n 1)
GPU=$("$PY" -c 'from infmoe_export.runtimes.tensorrt.plugin.cuda_driver import *; print(device_name(), compute_capability(), driver_cuda_version())' 2>&1 | tail -n 1)
CUDA_TORCH=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
if [[ "$GPU" == None* ]]; then
    verdict environment FAIL "no NVIDIA GPU through the CUDA driver (libcuda.so.1)"
elif [[ "$TRT" == *rror* ]]; then
    verdict environment FAIL "$TRT"
else
    verdict environment PASS "TensorRT $TRT; GPU, capability, driver CUDA: $GPU; CUDA torch: $CUDA_TORCH"
fi
HAVE_TRT=$([[ "$GPU" != None* && "$TRT" != *rror* ]] && echo 1 || echo 0)

# 2. the Triton kernel on the device
if [ "$CUDA_TORCH" = 1 ]; then
    step kernel 1200 "$PY" -m benchmarks.triton_kernel
else
    verdict kernel SKIP "torch has no CUDA here: install a CUDA build of torch 2.13 to run python -m benchmarks.triton_kernel"
fi

# 2b. the onnxruntime library's CUDA computation: the C++ driver's cases on the GPU, then its decode
if command -v nvcc >/dev/null && [[ "$GPU" != None* ]]; then
    step cuda-kernel 900 env PYTHON="$PY" bash plugins/onnxruntime/tools/cross_test.sh cuda
    step cuda-bench 300 plugins/onnxruntime/build-test-cuda/infmoe_cuda_bench
else
    for name in cuda-kernel cuda-bench; do verdict $name SKIP "needs nvcc and an NVIDIA GPU"; done
fi

if [ "$HAVE_TRT" = 1 ]; then
    # 3. the test file, engine tests included
    step tests 1800 "$PY" -m pytest tests/test_tensorrt.py tests/test_trt_quant.py -q -rs -p no:cacheprovider

    # 4. engines for K = 1, 2, 8 (models exported with starts, for parity)
    ENGINES="$OUT/engines"
    step engines 3600 "$CLI" trt --out "$ENGINES" --k 1,2,8 --with-starts
    if [ -f "$ENGINES/manifest.json" ]; then
        step manifest 60 "$PY" -c "
import sys
from infmoe_export.runtimes.tensorrt import read_manifest
m = read_manifest(sys.argv[1])
built = [(e['k'], e['plugin'], e['precision'], e['tf32'], e['gpu'], e['tensorrt_version']) for e in m['engines']]
print('built (K, plugin, precision, tf32, gpu, TensorRT):', built)
assert [b[:3:2] for b in built] == [(1, 'fp32'), (2, 'fp32'), (8, 'fp32')], built
" "$ENGINES"

        # 5. parity against PyTorch
        step parity 3600 "$CLI" parity --model "$ENGINES/onnx/fp32" --engines "$ENGINES" --k 1,2,8 --backends trt \
            --out "$OUT/parity"

        # 6. decode timing
        step decode 3600 "$CLI" bench --model "$ENGINES/onnx/fp32" --engines "$ENGINES" --backends torch,trt \
            --k 1,2,8 --batch 1 --seq 1 --json "$OUT/decode.json"

        # 7. generation from an AOT engine
        step run 600 "$CLI" run --engines "$ENGINES" --k 2 --prompt "import " --max-new-tokens 32
    else
        for name in manifest parity decode run; do verdict $name SKIP "no engines were built (see the engines step)"; done
    fi

    # 8. float16, int8, int4: strongly typed engines from exports of that precision
    for precision in fp16 int8 int4; do
        step "$precision" 3600 "$CLI" trt --out "$OUT/engines_$precision" --k 2 --dtype "$precision"
        if [ -f "$OUT/engines_$precision/manifest.json" ]; then
            step "$precision-run" 600 "$CLI" run --engines "$OUT/engines_$precision" --prompt "import " \
                --max-new-tokens 32
        fi
    done
else
    for name in tests engines manifest parity decode run fp16 int8 int4; do
        verdict $name SKIP "needs TensorRT and an NVIDIA GPU (see the environment step)"
    done
fi

echo "----- summary: ${#PASSED[@]} passed, ${#FAILED[@]} failed, ${#SKIPPED[@]} skipped" \
     "${FAILED[*]:+(failed: ${FAILED[*]})}"
[ ${#FAILED[@]} -eq 0 ]
