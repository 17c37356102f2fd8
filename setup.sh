#!/usr/bin/env bash
# One-time set-up: a virtual environment in .venv with the package (editable) and its test tools.
# Installing the package builds the onnxruntime custom-op library from plugins/onnxruntime with
# CMake (scikit-build-core); without a C++ compiler the package is installed without it and
# everything runs on the ONNX fallback function (this script then says so).
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
# torch is pinned first so that no later range pulls a CUDA build (see pyproject.toml).
.venv/bin/pip install --quiet "torch==2.13.0"
.venv/bin/pip install --quiet -e ".[dev]"
if ! .venv/bin/python -c "import sys; from infmoe_export.runtimes.ort_kernel import custom_op_library; sys.exit(custom_op_library() is None)"; then
  echo "setup: the onnxruntime kernel was not built (no C++ compiler or headers); the fallback function will be used"
fi
echo "setup: done. Try: .venv/bin/infmoe-export doctor"
