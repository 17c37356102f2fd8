"""Ahead-of-time compilation of the COLUMNS-mode kernel to PTX, for the TensorRT AOT plugin.

What is compiled, for which GPU and in which PTX version is decided here, from the CUDA driver
(cuda_driver.py) and never by asking Triton for the "current target" (that builds Triton's C
driver helper and so needs a host compiler on the build machine):

- target: the device's compute capability (or the one given);
- PTX ISA version: the newest the installed driver loads, capped at what Triton's bundled
  ptxas knows. Triton otherwise writes its own toolkit's version (PTX ISA 9.4 for Triton 3.9,
  CUDA 13.4), which a driver older than CUDA 13.4 refuses to load.

The PTX entry keeps exactly the pointer parameters TensorRT passes (the op's inputs, then Y: 7
for ContinuousSliceFFN, 9 for QContinuousSliceFFN; no extra scalars): Triton's hidden scratch
pointers are checked unused and removed.
"""

from typing import Optional, Tuple

from ....errors import InfMoEError
from ....quant import Q_OP_TYPE, check_bits, check_block_size

from . import cuda_driver
from .triton_kernel import (COLUMNS_BLOCK_D, COLUMNS_BLOCK_R, NUM_WARPS, continuous_slice_ffn_kernel,
                     q_continuous_slice_ffn_kernel, quant_constants)

# PTX ISA version of each CUDA 12 release (NVIDIA's PTX ISA "Release History" table): 12.6
# brought no new ISA, so from 12.7 on the minor numbers are one apart. CUDA 11.x is 7.x, and
# from CUDA 13 on PTX 9.x follows CUDA 13.x.
_CUDA12_PTX = {0: 80, 1: 81, 2: 82, 3: 83, 4: 84, 5: 85, 6: 85, 7: 86, 8: 87, 9: 88}
DTYPES = ("fp32", "fp16")


def ptx_isa_for_cuda(version: Tuple[int, int]) -> int:
    """The newest PTX ISA version CUDA `version` = (major, minor) loads, as major*10 + minor
    (CUDA 12.4 -> 84, i.e. PTX ISA 8.4)."""
    major, minor = version
    if major == 11:
        return 70 + minor
    if major == 12:
        return _CUDA12_PTX.get(minor, max(_CUDA12_PTX.values()))
    if major >= 13:
        return 90 + 10 * (major - 13) + minor
    raise InfMoEError(f"the NVIDIA driver supports CUDA {major}.{minor}; the TensorRT plugin needs a driver "
                      "for CUDA 11.0 or newer: update the NVIDIA driver")


def gpu_target(capability: Optional[int] = None):
    """Triton's GPUTarget for compute capability `capability` (default: this machine's GPU)."""
    from triton.backends.compiler import GPUTarget

    if capability is None:
        capability = cuda_driver.compute_capability()
        if capability is None:
            raise InfMoEError("no NVIDIA GPU is visible through the CUDA driver (libcuda): the TensorRT plugin "
                              "compiles its kernel for the GPU it builds on")
    return GPUTarget("cuda", capability, 32)


def ptx_version(capability: int, driver: Optional[Tuple[int, int]] = None) -> Optional[int]:
    """The PTX ISA version to write for this driver (default: the installed one's), capped at
    the version of the ptxas Triton uses for `capability`; None where no driver answers (then
    Triton's default stands)."""
    # Triton's own choice of ptxas: which bundled one serves which target differs between
    # releases (sm_90 took the older ptxas up to Triton 3.7, the newer one from 3.9).
    from triton.backends.nvidia.compiler import get_ptxas

    driver = driver or cuda_driver.driver_cuda_version()
    if driver is None:
        return None
    tool = get_ptxas(capability)
    wanted = ptx_isa_for_cuda(driver)
    if tool is None:
        return wanted
    major, minor = (int(part) for part in tool.version.split(".")[:2])
    return min(wanted, ptx_isa_for_cuda((major, minor)))


def columns_constants(H: int, D: int, R: int, K: int, bits: Optional[int] = None,
                      block_size: Optional[int] = None) -> dict:
    """The kernel's compile-time arguments in COLUMNS mode (what engines and --jit launch); bits
    and block_size for QContinuousSliceFFN."""
    constants = {"H": H, "D": D, "R": R, "K": K, "BLOCK_R": COLUMNS_BLOCK_R, "BLOCK_D": COLUMNS_BLOCK_D,
                 "SPLIT": False}
    return constants if bits is None else dict(constants, **quant_constants(bits, block_size))


def columns_grid_y(D: int) -> int:
    """Column blocks per token: the launch grid is (tokens, columns_grid_y(D))."""
    return -(-D // COLUMNS_BLOCK_D)


def kernel_signature(dtype: str, bits: Optional[int]):
    """(Triton kernel, its pointer signature) for X of `dtype`; bits None: the float op. The
    packed weights are int8 pointers because TensorRT passes them as int8 (network.plugin_model);
    the kernel reads the bytes unsigned either way."""
    pointer = f"*{dtype}"
    if bits is None:
        return continuous_slice_ffn_kernel, {
            "x_ptr": pointer, "starts_ptr": "*i64", "w_in_ptr": pointer, "b_in_ptr": pointer, "w_out_ptr": pointer,
            "b_out_ptr": pointer, "y_ptr": pointer}
    return q_continuous_slice_ffn_kernel, {
        "x_ptr": pointer, "starts_ptr": "*i64", "w_in_q_ptr": "*i8", "w_in_scale_ptr": pointer, "b_in_ptr": pointer,
        "w_out_q_ptr": "*i8", "w_out_scale_ptr": pointer, "b_out_ptr": pointer, "y_ptr": pointer}


def compile_ptx(dtype: str, H: int, D: int, R: int, K: int, *, bits: Optional[int] = None,
                block_size: Optional[int] = None, capability: Optional[int] = None,
                driver: Optional[Tuple[int, int]] = None) -> dict:
    """PTX of the COLUMNS kernel specialised on H, D, r, K (and, for QContinuousSliceFFN, bits
    and block_size), for `capability` (default: this machine's GPU) and the PTX version `driver`
    (default: the installed driver) loads.

    Returns the kernel name, PTX, block size, shared memory, grid_y and the PTX version."""
    import triton

    op = "ContinuousSliceFFN" if bits is None else Q_OP_TYPE
    if dtype not in DTYPES:
        raise InfMoEError(f"{op}: no kernel for dtype {dtype!r} (float32 or float16 only)")
    if not (1 <= R <= H and D >= 1 and K >= 1):
        raise InfMoEError(f"{op}: invalid specialisation H={H} D={D} r={R} K={K}")
    if bits is not None:
        try:
            check_bits(bits), check_block_size(block_size)
        except InfMoEError as error:
            raise InfMoEError(f"{op}: {error}") from None
    target = gpu_target(capability)
    kernel, signature = kernel_signature(dtype, bits)
    constants = columns_constants(H, D, R, K, bits, block_size)
    signature.update({name: "constexpr" for name in constants})
    options = {"num_warps": NUM_WARPS}
    version = ptx_version(target.arch, driver)
    if version is not None:
        options["ptx_version"] = version
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants)
    compiled = triton.compile(source, target=target, options=options)
    metadata = compiled.metadata
    ptx = strip_scratch_params(compiled.asm["ptx"], metadata.name, n_params=len(signature) - len(constants),
                               scratch=(getattr(metadata, "global_scratch_size", 0),
                                        getattr(metadata, "profile_scratch_size", 0)))
    return {"name": metadata.name, "ptx": ptx, "block_x": metadata.num_warps * 32, "shared_mem": metadata.shared,
            "grid_y": columns_grid_y(D), "ptx_version": version}


def strip_scratch_params(ptx: str, name: str, n_params: int, scratch=(0, 0)) -> str:
    """Keep only the first n_params parameters of entry `name`; the rest must be unused pointers."""
    if any(scratch):
        raise InfMoEError(f"kernel {name} needs Triton scratch memory {scratch}, "
                          "which a TensorRT AOT plugin cannot provide")
    lines = ptx.splitlines(keepends=True)
    declared = [i for i, line in enumerate(lines) if f"{name}_param_" in line and ".param" in line
                and "ld.param" not in line]
    extra = declared[n_params:]
    if len(declared) < n_params or len(extra) > 2:
        raise InfMoEError(f"unexpected PTX entry for {name}: "
                          f"{len(declared)} parameters, expected {n_params} (+ up to 2 scratch pointers)")
    for index in range(n_params, len(declared)):
        if f"[{name}_param_{index}]" in ptx:
            raise InfMoEError(f"PTX of {name} reads hidden parameter {index}")
    if extra:
        last = declared[n_params - 1]
        lines[last] = lines[last].rstrip().rstrip(",") + "\n"
        lines = [line for i, line in enumerate(lines) if i not in extra]
    return "".join(lines)
