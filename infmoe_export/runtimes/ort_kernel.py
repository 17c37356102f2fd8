"""The compiled onnxruntime kernel for `infmoe::ContinuousSliceFFN` (plugins/onnxruntime).

Find it, build it, register it on a SessionOptions. When the library is absent, every model
still runs on its ONNX fallback function (SPEC §4), only more slowly; `register` says so once.
"""

import os
import pathlib
import subprocess
import warnings
from typing import Optional

from ..errors import InfMoEError

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent
REPO_DIR = PACKAGE_DIR.parent
# build.sh copies the Release library here (git-ignored); INFMOE_ORT_LIBRARY overrides it.
LIBRARY_PATH = PACKAGE_DIR / "lib" / "libinfmoe_ort.so"
BUILD_SCRIPT = REPO_DIR / "plugins" / "onnxruntime" / "build.sh"
ENV_VAR = "INFMOE_ORT_LIBRARY"

_warned = False


def custom_op_library() -> Optional[pathlib.Path]:
    """The library to load: $INFMOE_ORT_LIBRARY if set, else the built one, else None."""
    override = os.environ.get(ENV_VAR)
    if override:
        return pathlib.Path(override)
    return LIBRARY_PATH if LIBRARY_PATH.is_file() else None


def build_kernel(quiet: bool = True) -> pathlib.Path:
    """Build the library with plugins/onnxruntime/build.sh and return its path."""
    if not BUILD_SCRIPT.is_file():
        raise InfMoEError(f"cannot build the onnxruntime kernel: {BUILD_SCRIPT} is missing "
                          "(not a source checkout)")
    captured = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) if quiet else {}
    result = subprocess.run(["bash", str(BUILD_SCRIPT)], **captured)
    if result.returncode != 0:
        last = (result.stdout or "").strip().splitlines()[-1:] or [f"exit status {result.returncode}"]
        raise InfMoEError(f"building the onnxruntime kernel failed: {last[0]}")
    if not LIBRARY_PATH.is_file():
        raise InfMoEError(f"building the onnxruntime kernel did not produce {LIBRARY_PATH}")
    return LIBRARY_PATH


def _fall_back(reason: str):
    global _warned
    if not _warned:
        warnings.warn(f"{reason}; ContinuousSliceFFN runs on the slower ONNX fallback function "
                      "(build the kernel with plugins/onnxruntime/build.sh)", stacklevel=3)
        _warned = True


def register(session_options) -> bool:
    """Register the kernel on an onnxruntime.SessionOptions. False when the library is absent or
    does not load (said once per process): the model then runs on its fallback function."""
    library = custom_op_library()
    if library is None or not library.is_file():
        where = f"{ENV_VAR}={library}" if library is not None else str(LIBRARY_PATH)
        _fall_back(f"onnxruntime kernel library not found ({where})")
        return False
    try:
        session_options.register_custom_ops_library(str(library))
    except Exception as error:  # onnxruntime raises its own exception types
        _fall_back(f"cannot load the onnxruntime kernel {library}: {str(error).splitlines()[0]}")
        return False
    return True
