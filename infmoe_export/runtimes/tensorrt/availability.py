"""Is a TensorRT this package supports installed, and registering the plugin with it.

Supported: TensorRT >= 10.9 (the first with Python AOT plugins: `tensorrt.plugin.aot_impl`,
`KernelLaunchParams` and the PREFER_AOT/JIT_PYTHON_PLUGINS network flags) and < 12. Engines
are built from strongly typed networks, which 11.x requires (it has no FP16 builder flag), so
10.9-10.x and 11.x take the same path. The range is the `tensorrt` extra of pyproject.toml.
"""

import re
from typing import Optional, Tuple

from ...errors import InfMoEError

MIN_VERSION, BELOW_VERSION = (10, 9), (12, 0)
REQUIREMENT = "tensorrt>=10.9,<12"
INSTALL_HINT = ("pip install 'infmoe-export[tensorrt]' on a machine with an NVIDIA GPU and driver")


def tensorrt_version() -> Optional[str]:
    """The installed TensorRT's version, or None when its Python package does not import."""
    try:
        import tensorrt
    except (ImportError, OSError):  # OSError: the wheel is there but its libraries are not
        return None
    return tensorrt.__version__


def version_problem(version: str) -> Optional[str]:
    """Why TensorRT `version` cannot be used, or None."""
    match = re.match(r"(\d+)\.(\d+)", version)
    found: Tuple[int, int] = (int(match[1]), int(match[2])) if match else (0, 0)
    if MIN_VERSION <= found < BELOW_VERSION:
        return None
    return f"TensorRT {version} is installed but infmoe-export needs {REQUIREMENT}: {INSTALL_HINT}"


def tensorrt_problem() -> Optional[str]:
    """One line saying why the TensorRT backend cannot run here, or None when it can be tried."""
    version = tensorrt_version()
    if version is None:
        return f"TensorRT is not installed: install it with {INSTALL_HINT}"
    return version_problem(version)


def tensorrt_available() -> bool:
    return tensorrt_problem() is None


def require_tensorrt() -> str:
    """The TensorRT version, or InfMoEError with the one line saying what to install."""
    problem = tensorrt_problem()
    if problem:
        raise InfMoEError(problem)
    return tensorrt_version()


def register_plugin() -> None:
    """Register `infmoe::ContinuousSliceFFN` with TensorRT (importing the module does it, once)."""
    require_tensorrt()
    from .plugin import register  # noqa: F401


def require_cuda_torch() -> None:
    """The plugin's JIT implementation hands TensorRT's buffers to torch on the GPU."""
    import torch

    if not torch.cuda.is_available():
        raise InfMoEError("the plugin's JIT implementation (--jit) needs a CUDA build of torch and a GPU "
                          "(this project pins the CPU wheel): install a CUDA torch, or build without --jit")


def gpu_name() -> str:
    """Name of the CUDA device TensorRT builds on, from the driver (torch may be a CPU build)."""
    from .plugin.cuda_driver import device_name

    return device_name() or "unknown"
