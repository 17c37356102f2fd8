#!/usr/bin/env bash
# One-time set-up: a virtual environment in .venv with the package and its test tools, and the
# onnxruntime custom-op library built from plugins/onnxruntime (skipped, with one line, when it
# cannot be built: everything then runs on the ONNX fallback function).
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
# torch is pinned first so that no later range pulls a CUDA build (see pyproject.toml).
.venv/bin/pip install --quiet "torch==2.13.0"
.venv/bin/pip install --quiet -e ".[dev]"
if [ -x plugins/onnxruntime/build.sh ]; then
  plugins/onnxruntime/build.sh || echo "setup: the onnxruntime kernel was not built; the fallback function will be used"
fi
echo "setup: done. Try: .venv/bin/infmoe-export doctor"
