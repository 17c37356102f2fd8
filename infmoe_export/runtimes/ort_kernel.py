"""The compiled onnxruntime kernel for `infmoe::ContinuousSliceFFN` (plugins/onnxruntime).

The library is built by the package build (pip install / pip wheel: scikit-build-core runs
CMake) and installed as infmoe_export/lib/libinfmoe_ort.so; nothing is built or written here at
run time. `register` puts it on a SessionOptions. When the library is absent (the build found no
compiler), every model still runs on its ONNX fallback function (SPEC §4), only more slowly, and
`register` says so once.
"""

import functools
import importlib.metadata
import importlib.resources
import os
import pathlib
import warnings
from typing import Optional

from ..contract import ACTIVATION_KINDS
from ..errors import InfMoEError

ENV_VAR = "INFMOE_ORT_LIBRARY"  # overrides the installed library (e.g. the ASan build)
LIBRARY_NAME = "libinfmoe_ort.so"
LIBRARY_PATH = "infmoe_export/lib/" + LIBRARY_NAME  # its place in the wheel and site-packages
DISTRIBUTION = "infmoe-export"

_warned = False


@functools.lru_cache(maxsize=1)  # an installation does not move while the process runs
def _installed_library() -> Optional[pathlib.Path]:
    """Where the package build installed the library, or None.

    Two places, in order: the distribution's own file list (RECORD), which names the library in
    site-packages for a wheel install and for an editable one, whose Python files stay in the
    source tree (also when the source tree shadows the installed package on sys.path); then next
    to the imported package (a wheel unpacked without metadata, e.g. on PYTHONPATH)."""
    # Every distribution of that name on sys.path: a stale *.egg-info in the working directory
    # (left by an old setuptools build) must not hide the installed one.
    files = [file for dist in importlib.metadata.distributions(name=DISTRIBUTION) for file in dist.files or []]
    for file in files:
        if file.as_posix() == LIBRARY_PATH:
            path = pathlib.Path(file.locate()).resolve()
            if path.is_file():
                return path
    beside = importlib.resources.files("infmoe_export") / "lib" / LIBRARY_NAME
    if beside.is_file():
        return pathlib.Path(str(beside))
    return None


def custom_op_library() -> Optional[pathlib.Path]:
    """The library to load: $INFMOE_ORT_LIBRARY if set, else the installed one, else None."""
    override = os.environ.get(ENV_VAR)
    if override:
        return pathlib.Path(override)
    return _installed_library()


def _fall_back(reason: str):
    global _warned
    if not _warned:
        warnings.warn(f"{reason}; ContinuousSliceFFN runs on the slower ONNX fallback function "
                      "(reinstall the package with a C++ compiler to build the kernel)", stacklevel=3)
        _warned = True


# Session config entry the library reads when it is registered: "0" registers only the ops that
# have a CUDA kernel (ContinuousSliceFFN). An op with a CPU kernel only would pull its nodes onto
# the CPU in a CUDA session, since onnxruntime inlines a node's fallback function only when no
# provider claims the node; left out, its function runs on the GPU (GroupQueryAttention,
# MatMulNBits, standard ops).
CPU_ONLY_OPS = "infmoe.cpu_only_ops"
# Session config entry read when the library is registered: "int8" gives the quantized ops int8
# activations (integer dot products; docs/guide/quantization.md), "float" (default) SPEC §6's.
ACTIVATIONS = "infmoe.activations"


def activations_of(session_options, default: Optional[str] = "float") -> Optional[str]:
    """The quantized ops' activations these options ask for: their ACTIVATIONS entry, else default."""
    try:
        return session_options.get_session_config_entry(ACTIVATIONS)
    except RuntimeError:  # not set
        return default


def register(session_options, providers=(), activations: Optional[str] = None) -> bool:
    """Register the kernel on an onnxruntime.SessionOptions, for a session with these providers
    (names or (name, options) pairs; with CUDA's, the CPU-only ops are left to their functions)
    and these activations of the quantized ops ("float" or "int8"; None: as the options say,
    else float; the library reads them when registered). False when the library is absent or
    does not load (said once per process): the model then runs on its fallback function."""
    chosen = activations_of(session_options, default=None)
    activations = activations or chosen or "float"
    if activations not in ACTIVATION_KINDS:
        raise InfMoEError(f"activations must be one of {', '.join(ACTIVATION_KINDS)}, got {activations!r}")
    if activations != chosen:  # onnxruntime warns when an entry is set twice
        session_options.add_session_config_entry(ACTIVATIONS, activations)
    if any((p if isinstance(p, str) else p[0]) == "CUDAExecutionProvider" for p in providers):
        session_options.add_session_config_entry(CPU_ONLY_OPS, "0")
    library = custom_op_library()
    if library is None or not library.is_file():
        where = f"{ENV_VAR}={library}" if library is not None else f"no {LIBRARY_PATH} installed"
        _fall_back(f"onnxruntime kernel library not found ({where})")
        return False
    try:
        session_options.register_custom_ops_library(str(library))
    except Exception as error:  # onnxruntime raises its own exception types
        _fall_back(f"cannot load the onnxruntime kernel {library}: {str(error).splitlines()[0]}")
        return False
    return True
