"""ContinuousSliceFFN (SPEC §4) as one Triton kernel, shared by the TensorRT plugin and PyTorch.

For every token the kernel visits the union of its K windows once: window k's rows are processed
by window k only where no earlier window covers them, each with weight c_i = coverage / K. Rows
outside the union are never loaded, so the bytes read are |union| x D x 2 weights, which is what
a memory-bound batch-1 decode step costs at best.

Two ways to split the work over programs (one kernel, a constexpr switch):

- SPLIT (decode): grid (tokens, K x row blocks). Each program computes the hidden activations of
  one block of rows over all of D and atomically adds its contribution to an fp32 accumulator that
  the caller initialised with b_out. Many programs per token fill the GPU even at batch 1; the
  float additions happen in a run-dependent order, so results may differ in the last bits.
- COLUMNS (deterministic): grid (tokens, D / BLOCK_D). Each program owns a slice of y, loops over
  all union rows and stores b_out + its sum: no atomics, no pre-initialised output, the same bits
  every run. The hidden activations are recomputed per column slice (w_in is read from L2 after
  the first slice). This is the mode the TensorRT AOT plugin uses: a plugin launches exactly one
  kernel on an uninitialised output buffer.

Argument order is TensorRT's AOT convention: input pointers, extra int32 scalars (none here),
output pointers. Shapes are compile-time constants (an engine fixes H, D, r, K); the token count
only sets the grid.
"""

import math
import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from infmoe_export.errors import InfMoEError

# Fixed launch configuration of the COLUMNS mode (the one baked into TensorRT engines).
COLUMNS_BLOCK_R, COLUMNS_BLOCK_D, NUM_WARPS = 32, 64, 4
SPLIT_BLOCK_R, SPLIT_BLOCK_D = 8, 256  # untuned: no GPU was lent (see docs/tensorrt.md)


@triton.jit
def _gelu_tanh(a):
    # 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3))), tanh through exp; |u| <= 15 keeps exp finite
    # and changes nothing in float32 (tanh(15) rounds to 1).
    u = 0.7978845608028654 * (a + 0.044715 * a * a * a)
    u = tl.minimum(tl.maximum(u, -15.0), 15.0)
    return 0.5 * a * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))


@triton.jit
def _start(starts_ptr, token, k, H: tl.constexpr, R: tl.constexpr, K: tl.constexpr):
    # Clamped, so that no start can make the kernel read outside w_in / w_out.
    s = tl.load(starts_ptr + token * K + k)
    return tl.minimum(tl.maximum(s, 0), H - R).to(tl.int32)


@triton.jit
def _owned_rows(starts_ptr, token, k, j, H: tl.constexpr, R: tl.constexpr, K: tl.constexpr,
                BLOCK_R: tl.constexpr):
    """Rows j*BLOCK_R.. of window k, which of them window k owns, and their weights c_i."""
    s_k = _start(starts_ptr, token, k, H, R, K)
    offsets = j * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = s_k + offsets
    owned = offsets < R
    count = tl.zeros([BLOCK_R], dtype=tl.float32)
    for other in tl.static_range(K):
        s = _start(starts_ptr, token, other, H, R, K)
        covered = (rows >= s) & (rows < s + R)
        count += covered.to(tl.float32)
        owned = tl.where(covered & (other < k), False, owned)  # the first window covering a row owns it
    return rows.to(tl.int64), owned, tl.where(owned, count / K, 0.0)


@triton.jit
def _hidden(x_ptr, w_in_ptr, b_in_ptr, token, rows, owned, weight, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """c_i * act(x . w_in[i] + b_in[i]) for the owned rows (0 elsewhere; only owned rows are read)."""
    pre = tl.zeros(rows.shape, dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + token * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        w = tl.load(w_in_ptr + rows[:, None] * D + cols[None, :],
                    mask=owned[:, None] & (cols < D)[None, :], other=0.0).to(tl.float32)
        pre += tl.sum(w * x[None, :], axis=1)
    bias = tl.load(b_in_ptr + rows, mask=owned, other=0.0).to(tl.float32)
    return _gelu_tanh(pre + bias) * weight


@triton.jit
def _contribution(w_out_ptr, rows, owned, h, cols, D: tl.constexpr):
    """sum_i h_i * w_out[i, cols] over the owned rows."""
    w = tl.load(w_out_ptr + rows[:, None] * D + cols[None, :],
                mask=owned[:, None] & (cols < D)[None, :], other=0.0).to(tl.float32)
    return tl.sum(h[:, None] * w, axis=0)


@triton.jit
def continuous_slice_ffn_kernel(
    x_ptr, starts_ptr, w_in_ptr, b_in_ptr, w_out_ptr, b_out_ptr,  # inputs
    y_ptr,  # output: [tokens, D]; fp32 accumulator holding b_out in SPLIT mode
    H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, K: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    row_blocks: tl.constexpr = (R + BLOCK_R - 1) // BLOCK_R
    if SPLIT:
        block = tl.program_id(1)
        rows, owned, weight = _owned_rows(starts_ptr, token, block // row_blocks, block % row_blocks,
                                          H, R, K, BLOCK_R)
        if tl.sum(owned.to(tl.int32)) > 0:  # a block covered by earlier windows does nothing
            h = _hidden(x_ptr, w_in_ptr, b_in_ptr, token, rows, owned, weight, D, BLOCK_D)
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                tl.atomic_add(y_ptr + token * D + cols, _contribution(w_out_ptr, rows, owned, h, cols, D),
                              mask=cols < D)
    else:
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        acc = tl.load(b_out_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        for k in tl.static_range(K):
            for j in range(row_blocks):
                rows, owned, weight = _owned_rows(starts_ptr, token, k, j, H, R, K, BLOCK_R)
                if tl.sum(owned.to(tl.int32)) > 0:
                    h = _hidden(x_ptr, w_in_ptr, b_in_ptr, token, rows, owned, weight, D, BLOCK_D)
                    acc += _contribution(w_out_ptr, rows, owned, h, cols, D)
        tl.store(y_ptr + token * D + cols, acc.to(y_ptr.dtype.element_ty), mask=cols < D)


# ---------------------------------------------------------------------------------------------
# Python launcher


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_inputs(x, starts, w_in, b_in, w_out, b_out, slice_width: int) -> Tuple[int, int, int]:
    """SPEC §4's rules for the op's inputs; returns (H, D, K). Raises InfMoEError naming the problem."""
    if x.dtype not in (torch.float32, torch.float16):
        raise InfMoEError(f"ContinuousSliceFFN: X must be float32 or float16, got {x.dtype}")
    if x.dim() < 1:
        raise InfMoEError("ContinuousSliceFFN: X must have shape [..., D]")
    D = x.shape[-1]
    if w_in.dim() != 2 or w_in.shape[1] != D:
        raise InfMoEError(f"ContinuousSliceFFN: w_in must have shape [H, {D}], got {list(w_in.shape)}")
    H = w_in.shape[0]
    for name, tensor, shape in (("b_in", b_in, [H]), ("w_out", w_out, [H, D]), ("b_out", b_out, [D])):
        if list(tensor.shape) != shape:
            raise InfMoEError(f"ContinuousSliceFFN: {name} must have shape {shape}, got {list(tensor.shape)}")
    for name, tensor in (("w_in", w_in), ("b_in", b_in), ("w_out", w_out), ("b_out", b_out)):
        if tensor.dtype != x.dtype:
            raise InfMoEError(f"ContinuousSliceFFN: {name} must have X's dtype {x.dtype}, got {tensor.dtype}")
    if starts.dtype != torch.int64:
        raise InfMoEError(f"ContinuousSliceFFN: starts must be int64, got {starts.dtype}")
    if starts.dim() != x.dim() or starts.shape[:-1] != x.shape[:-1] or starts.shape[-1] < 1:
        raise InfMoEError(f"ContinuousSliceFFN: starts must have shape {list(x.shape[:-1])} + [K] "
                          f"with K >= 1, got {list(starts.shape)}")
    if isinstance(slice_width, bool) or not isinstance(slice_width, int) or not 1 <= slice_width <= H:
        raise InfMoEError(f"ContinuousSliceFFN: slice_width must be an integer in [1, {H}], got {slice_width!r}")
    if starts.numel() and (int(starts.min()) < 0 or int(starts.max()) > H - slice_width):
        raise InfMoEError(f"ContinuousSliceFFN: starts must lie in [0, {H - slice_width}], "
                          f"got values in [{int(starts.min())}, {int(starts.max())}]")
    devices = {t.device for t in (x, starts, w_in, b_in, w_out, b_out)}
    if len(devices) > 1:
        raise InfMoEError(f"ContinuousSliceFFN: all inputs must be on one device, got {sorted(map(str, devices))}")
    if x.device.type != "cuda" and not _interpreting():
        raise InfMoEError("ContinuousSliceFFN: the Triton kernel needs CUDA tensors "
                          "(or TRITON_INTERPRET=1 to run it in Triton's CPU interpreter)")
    return H, D, starts.shape[-1]


def use_split(tokens: int, d_model: int) -> bool:
    """SPLIT when the deterministic column grid would leave most of a large GPU idle (decode)."""
    return tokens * triton.cdiv(d_model, COLUMNS_BLOCK_D) < 512


def continuous_slice_ffn_triton(x, starts, w_in, b_in, w_out, b_out, slice_width: int,
                                *, deterministic: Optional[bool] = None) -> torch.Tensor:
    """y = ContinuousSliceFFN(x, starts, ...) of SPEC §4 with the Triton kernel.

    deterministic=None picks by shape (use_split); True forces the COLUMNS mode (bitwise
    reproducible, what TensorRT engines run); False forces SPLIT (atomics, fastest at decode).
    """
    H, D, K = check_inputs(x, starts, w_in, b_in, w_out, b_out, slice_width)
    lead = x.shape[:-1]
    tokens = math.prod(lead)
    if tokens == 0:
        return torch.empty_like(x)
    x2 = x.reshape(tokens, D).contiguous()
    s2 = starts.reshape(tokens, K).contiguous()
    weights = [t.contiguous() for t in (w_in, b_in, w_out, b_out)]
    split = use_split(tokens, D) if deterministic is None else not deterministic
    if split:
        row_blocks = triton.cdiv(slice_width, SPLIT_BLOCK_R)
        # fp32 accumulator starting at b_out: fp16 outputs are rounded once, at the end.
        acc = b_out.float().repeat(tokens, 1)  # a copy: never accumulate into b_out itself
        continuous_slice_ffn_kernel[(tokens, K * row_blocks)](
            x2, s2, *weights, acc, H=H, D=D, R=slice_width, K=K,
            BLOCK_R=SPLIT_BLOCK_R, BLOCK_D=SPLIT_BLOCK_D, SPLIT=True, num_warps=NUM_WARPS)
        y = acc.to(x.dtype)
    else:
        y = torch.empty(tokens, D, dtype=x.dtype, device=x.device)
        continuous_slice_ffn_kernel[(tokens, triton.cdiv(D, COLUMNS_BLOCK_D))](
            x2, s2, *weights, y, H=H, D=D, R=slice_width, K=K,
            BLOCK_R=COLUMNS_BLOCK_R, BLOCK_D=COLUMNS_BLOCK_D, SPLIT=False, num_warps=NUM_WARPS)
    return y.reshape(*lead, D)


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compilation (for the TensorRT AOT plugin)


def compile_ptx(dtype: str, H: int, D: int, R: int, K: int, target=None) -> dict:
    """Compile the COLUMNS-mode kernel to PTX for TensorRT to launch without Python.

    dtype is "fp32" or "fp16"; target a triton GPUTarget (default: the current GPU). Returns
    the kernel name, PTX, block size, shared memory and grid_y (the column-block count).

    Triton >= 3.3 appends hidden global/profile scratch pointers to every kernel's parameters;
    TensorRT passes exactly (inputs, extra scalars, outputs), so the unused trailing pointers
    are removed from the PTX entry (after checking the kernel needs no scratch memory).
    """
    if dtype not in ("fp32", "fp16"):
        raise InfMoEError(f"ContinuousSliceFFN: no kernel for dtype {dtype!r} (float32 or float16 only)")
    if not (1 <= R <= H and D >= 1 and K >= 1):
        raise InfMoEError(f"ContinuousSliceFFN: invalid specialisation H={H} D={D} r={R} K={K}")
    pointer = f"*{dtype}"
    signature = {"x_ptr": pointer, "starts_ptr": "*i64", "w_in_ptr": pointer, "b_in_ptr": pointer,
                 "w_out_ptr": pointer, "b_out_ptr": pointer, "y_ptr": pointer}
    constants = {"H": H, "D": D, "R": R, "K": K, "BLOCK_R": COLUMNS_BLOCK_R, "BLOCK_D": COLUMNS_BLOCK_D,
                 "SPLIT": False}
    signature.update({name: "constexpr" for name in constants})
    source = triton.compiler.ASTSource(fn=continuous_slice_ffn_kernel, signature=signature, constexprs=constants)
    if target is None:
        target = triton.runtime.driver.active.get_current_target()
    compiled = triton.compile(source, target=target, options={"num_warps": NUM_WARPS})
    metadata = compiled.metadata
    ptx = strip_scratch_params(compiled.asm["ptx"], metadata.name, n_params=len(signature) - len(constants),
                               scratch=(getattr(metadata, "global_scratch_size", 0),
                                        getattr(metadata, "profile_scratch_size", 0)))
    return {"name": metadata.name, "ptx": ptx, "block_x": metadata.num_warps * 32,
            "shared_mem": metadata.shared, "grid_y": triton.cdiv(D, COLUMNS_BLOCK_D)}


def strip_scratch_params(ptx: str, name: str, n_params: int, scratch=(0, 0)) -> str:
    """Keep only the first n_params parameters of entry `name`; the rest must be unused pointers."""
    if any(scratch):
        raise InfMoEError(f"ContinuousSliceFFN: kernel {name} needs Triton scratch memory {scratch}, "
                          "which a TensorRT AOT plugin cannot provide")
    lines = ptx.splitlines(keepends=True)
    declared = [i for i, line in enumerate(lines) if f"{name}_param_" in line and ".param" in line
                and "ld.param" not in line]
    extra = declared[n_params:]
    if len(declared) < n_params or len(extra) > 2:
        raise InfMoEError(f"ContinuousSliceFFN: unexpected PTX entry for {name}: "
                          f"{len(declared)} parameters, expected {n_params} (+ up to 2 scratch pointers)")
    for index in range(n_params, len(declared)):
        if f"[{name}_param_{index}]" in ptx:
            raise InfMoEError(f"ContinuousSliceFFN: PTX of {name} reads hidden parameter {index}")
    if extra:
        last = declared[n_params - 1]
        lines[last] = lines[last].rstrip().rstrip(",") + "\n"
        lines = [line for i, line in enumerate(lines) if i not in extra]
    return "".join(lines)
