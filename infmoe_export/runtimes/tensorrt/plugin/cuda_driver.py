"""What the CUDA driver says about this machine, through libcuda itself (ctypes).

Neither torch (the project pins its CPU build) nor Triton's driver helper (which compiles a C
module and needs a host compiler) is needed: the engine builder and the manifest only ask for
the device's name, its compute capability and the driver's CUDA version.
"""

import ctypes
from typing import Optional, Tuple

# CUdevice_attribute values from the CUDA driver API (cuda.h).
_CAPABILITY_MAJOR, _CAPABILITY_MINOR = 75, 76


def _driver():
    """libcuda with cuInit done, or None where there is no NVIDIA driver (or no device)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return cuda if cuda.cuInit(0) == 0 else None


def _device(cuda) -> Optional[ctypes.c_int]:
    """The device of the current CUDA context (the one TensorRT builds on), else device 0."""
    device = ctypes.c_int()
    if cuda.cuCtxGetDevice(ctypes.byref(device)) == 0 or cuda.cuDeviceGet(ctypes.byref(device), 0) == 0:
        return device
    return None


def device_name() -> Optional[str]:
    cuda = _driver()
    device = _device(cuda) if cuda else None
    if device is None:
        return None
    name = ctypes.create_string_buffer(256)
    return name.value.decode() if cuda.cuDeviceGetName(name, 256, device) == 0 else None


def compute_capability() -> Optional[int]:
    """The device's compute capability as major * 10 + minor (90 for an H100), or None."""
    cuda = _driver()
    device = _device(cuda) if cuda else None
    if device is None:
        return None
    major, minor = ctypes.c_int(), ctypes.c_int()
    if (cuda.cuDeviceGetAttribute(ctypes.byref(major), _CAPABILITY_MAJOR, device)
            or cuda.cuDeviceGetAttribute(ctypes.byref(minor), _CAPABILITY_MINOR, device)):
        return None
    return major.value * 10 + minor.value


def driver_cuda_version() -> Optional[Tuple[int, int]]:
    """The newest CUDA version the installed driver supports, e.g. (12, 4), or None."""
    cuda = _driver()
    if cuda is None:
        return None
    version = ctypes.c_int()
    if cuda.cuDriverGetVersion(ctypes.byref(version)):
        return None
    return version.value // 1000, version.value % 1000 // 10
