"""ContinuousSliceFFN (docs/reference/spec.md) as one Triton kernel, shared by the TensorRT plugin and PyTorch.

The algorithm is docs/reference/spec.md's. For every token the kernel visits the union of its K windows
once: window k's rows are processed by window k only where no earlier window covers them
("ownership"), each with weight c_i = n_i / K where n_i counts the windows covering row i. Every
union row has exactly one owner (the first window covering it) and no other row is owned, so the
sum over owned rows is the sum over the union, each unit once, with the coverage of the
definition. Rows outside the union are never loaded, so the bytes read are |union| x D x 2
weights, which is what a memory-bound batch-1 decode step costs at best.

Invalid input: the Python launcher refuses it (model.check_op_inputs: shapes, activation,
slice_width, K, starts, dtypes) before any launch. Shapes, r and K are compile-time constants
(compile.compile_ptx refuses impossible ones), so the only thing the device kernel itself can meet is a
start outside [0, H - r] -- inside a TensorRT engine no host check runs. It then writes NaN to
every element of that token's output row (never a finite number), and clamps the start only to
keep its loads inside w_in / w_out.

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

The quantized op (SPEC §6, `infmoe::QContinuousSliceFFN`) is the same body with a different
weight load (_weights): q_continuous_slice_ffn_kernel reads the packed bytes of the owned rows
(1 byte per weight at int8, half a byte at int4) and the block scales, and forms w' = q * scale
in float32 before the same products. Only the union's packed rows are read, so a decode step
reads bits/32 of the float32 kernel's weight bytes plus the scales.

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

from ....errors import InfMoEError
from ....model import GELU_TANH_C, GELU_TANH_CUBIC, check_op_inputs
from ....quant import Q_OP_TYPE, check_q_op_inputs

# Fixed launch configuration of the COLUMNS mode (the one baked into TensorRT engines).
COLUMNS_BLOCK_R, COLUMNS_BLOCK_D, NUM_WARPS = 32, 64, 4
SPLIT_BLOCK_R, SPLIT_BLOCK_D = 8, 256  # untuned: timed once on an H200, not yet tuned (docs/design/tensorrt.md)
# The GELU constants of model.py, as compile-time constants (a jit function reads only constexpr globals).
_GELU_C = tl.constexpr(GELU_TANH_C)
_GELU_CUBIC = tl.constexpr(GELU_TANH_CUBIC)


@triton.jit
def _gelu_tanh(a):
    # 0.5 a (1 + tanh(C (a + CUBIC a^3))) with model.py's constants, tanh through exp;
    # |u| <= 15 keeps exp finite and changes nothing in float32 (tanh(15) rounds to 1).
    u = _GELU_C * (a + _GELU_CUBIC * a * a * a)
    u = tl.minimum(tl.maximum(u, -15.0), 15.0)
    return 0.5 * a * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))


@triton.jit
def _start(starts_ptr, token, k, H: tl.constexpr, R: tl.constexpr, K: tl.constexpr):
    # Clamped only so that no start can make the kernel read outside w_in / w_out; a token with
    # an out-of-range start gets a NaN row (_bad_token), so the clamped window never shows.
    s = tl.load(starts_ptr + token * K + k)
    return tl.minimum(tl.maximum(s, 0), H - R).to(tl.int32)


@triton.jit
def _bad_token(starts_ptr, token, H: tl.constexpr, R: tl.constexpr, K: tl.constexpr):
    """True when any of the token's K starts lies outside [0, H - R] (compared as int64)."""
    s = tl.load(starts_ptr + token * K)
    bad = (s < 0) | (s > H - R)
    for k in tl.static_range(1, K):
        s = tl.load(starts_ptr + token * K + k)
        bad = bad | (s < 0) | (s > H - R)
    return bad


@triton.jit
def _owned_rows(starts_ptr, token, k, j, H: tl.constexpr, R: tl.constexpr, K: tl.constexpr,
                BLOCK_R: tl.constexpr):
    """Rows j*BLOCK_R.. of window k, which of them window k owns, and their weights c_i.

    Coverage, ownership-plus-count form: n_i counts the K windows containing row i (the
    definition, an exact small integer) and c_i = n_i / K; the row is owned by the first window
    containing it, so across k every union row is weighted once."""
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
def _weights(w_ptr, scale_ptr, rows, cols, mask, D: tl.constexpr, BITS: tl.constexpr, QBLOCK: tl.constexpr):
    """w[rows, cols] as float32 (0 where masked): the float weights (BITS 0), or w' = q * scale
    of SPEC §6 from the packed bytes and the block scales (BITS 8 or 4, blocks of QBLOCK)."""
    if BITS == 0:
        return tl.load(w_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        PACKED: tl.constexpr = D if BITS == 8 else (D + 1) // 2
        BLOCKS: tl.constexpr = (D + QBLOCK - 1) // QBLOCK
        # & 0xFF reads the byte unsigned whether it arrives as uint8 (PyTorch) or int8 (TensorRT,
        # which network.plugin_model retypes it to: TensorRT has no uint8 constants).
        byte = tl.load(w_ptr + rows[:, None] * PACKED + (cols // (8 // BITS))[None, :],
                       mask=mask, other=0).to(tl.int32) & 0xFF
        if BITS == 4:  # even column in the low nibble, odd in the high one
            byte = (byte >> ((cols % 2) * 4)[None, :]) & 0xF
        scale = tl.load(scale_ptr + rows[:, None] * BLOCKS + (cols // QBLOCK)[None, :],
                        mask=mask, other=0.0).to(tl.float32)
        return (byte - (1 << (BITS - 1))).to(tl.float32) * scale


@triton.jit
def _hidden(x_ptr, w_in_ptr, w_in_scale_ptr, b_in_ptr, token, rows, owned, weight, D: tl.constexpr,
            BLOCK_D: tl.constexpr, BITS: tl.constexpr, QBLOCK: tl.constexpr):
    """c_i * act(x . w_in[i] + b_in[i]) for the owned rows (0 elsewhere; only owned rows are read)."""
    pre = tl.zeros(rows.shape, dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + token * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        w = _weights(w_in_ptr, w_in_scale_ptr, rows, cols, owned[:, None] & (cols < D)[None, :], D, BITS, QBLOCK)
        pre += tl.sum(w * x[None, :], axis=1)
    bias = tl.load(b_in_ptr + rows, mask=owned, other=0.0).to(tl.float32)
    return _gelu_tanh(pre + bias) * weight


@triton.jit
def _contribution(w_out_ptr, w_out_scale_ptr, rows, owned, h, cols, D: tl.constexpr, BITS: tl.constexpr,
                  QBLOCK: tl.constexpr):
    """sum_i h_i * w_out[i, cols] over the owned rows."""
    w = _weights(w_out_ptr, w_out_scale_ptr, rows, cols, owned[:, None] & (cols < D)[None, :], D, BITS, QBLOCK)
    return tl.sum(h[:, None] * w, axis=0)


@triton.jit
def _slice_ffn(x_ptr, starts_ptr, w_in_ptr, w_in_scale_ptr, b_in_ptr, w_out_ptr, w_out_scale_ptr, b_out_ptr,
               y_ptr, H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, K: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, BITS: tl.constexpr, QBLOCK: tl.constexpr):
    """Both kernels' body; y_ptr is [tokens, D], an fp32 accumulator holding b_out in SPLIT mode."""
    token = tl.program_id(0).to(tl.int64)
    row_blocks: tl.constexpr = (R + BLOCK_R - 1) // BLOCK_R
    # 0 for a valid token, NaN for one with an out-of-range start: added to what it writes.
    poison = tl.where(_bad_token(starts_ptr, token, H, R, K), float("nan"), 0.0)
    if SPLIT:
        block = tl.program_id(1)
        rows, owned, weight = _owned_rows(starts_ptr, token, block // row_blocks, block % row_blocks,
                                          H, R, K, BLOCK_R)
        if tl.sum(owned.to(tl.int32)) > 0:  # a block covered by earlier windows does nothing
            h = _hidden(x_ptr, w_in_ptr, w_in_scale_ptr, b_in_ptr, token, rows, owned, weight, D, BLOCK_D,
                        BITS, QBLOCK)
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                # Window 0's first block always owns rows, so a bad token always receives a NaN.
                part = _contribution(w_out_ptr, w_out_scale_ptr, rows, owned, h, cols, D, BITS, QBLOCK)
                tl.atomic_add(y_ptr + token * D + cols, part + poison, mask=cols < D)
    else:
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        acc = tl.load(b_out_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        for k in tl.static_range(K):
            for j in range(row_blocks):
                rows, owned, weight = _owned_rows(starts_ptr, token, k, j, H, R, K, BLOCK_R)
                if tl.sum(owned.to(tl.int32)) > 0:
                    h = _hidden(x_ptr, w_in_ptr, w_in_scale_ptr, b_in_ptr, token, rows, owned, weight, D,
                                BLOCK_D, BITS, QBLOCK)
                    acc += _contribution(w_out_ptr, w_out_scale_ptr, rows, owned, h, cols, D, BITS, QBLOCK)
        tl.store(y_ptr + token * D + cols, (acc + poison).to(y_ptr.dtype.element_ty), mask=cols < D)


@triton.jit
def continuous_slice_ffn_kernel(
    x_ptr, starts_ptr, w_in_ptr, b_in_ptr, w_out_ptr, b_out_ptr,  # inputs
    y_ptr,  # output
    H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, K: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
):
    """`infmoe::ContinuousSliceFFN`: float weights (the scale pointers are never read at BITS 0)."""
    _slice_ffn(x_ptr, starts_ptr, w_in_ptr, w_in_ptr, b_in_ptr, w_out_ptr, w_out_ptr, b_out_ptr, y_ptr,
               H, D, R, K, BLOCK_R, BLOCK_D, SPLIT, 0, 1)


@triton.jit
def q_continuous_slice_ffn_kernel(
    x_ptr, starts_ptr, w_in_q_ptr, w_in_scale_ptr, b_in_ptr, w_out_q_ptr, w_out_scale_ptr, b_out_ptr,  # inputs
    y_ptr,  # output
    H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, K: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, BITS: tl.constexpr, QBLOCK: tl.constexpr,
):
    """`infmoe::QContinuousSliceFFN` (SPEC §6): the same body on packed weights and block scales."""
    _slice_ffn(x_ptr, starts_ptr, w_in_q_ptr, w_in_scale_ptr, b_in_ptr, w_out_q_ptr, w_out_scale_ptr, b_out_ptr,
               y_ptr, H, D, R, K, BLOCK_R, BLOCK_D, SPLIT, BITS, QBLOCK)


# ---------------------------------------------------------------------------------------------
# Python launcher


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check_launch(op: str, x, tensors) -> None:
    """The kernel's own limits: float32/float16, one device, CUDA or the interpreter."""
    if x.dtype not in (torch.float32, torch.float16):
        raise InfMoEError(f"{op}: X must be float32 or float16, got {x.dtype}")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise InfMoEError(f"{op}: all inputs must be on one device, got {sorted(map(str, devices))}")
    if x.device.type != "cuda" and not _interpreting():
        raise InfMoEError(f"{op}: the Triton kernel needs CUDA tensors "
                          "(or TRITON_INTERPRET=1 to run it in Triton's CPU interpreter)")


def _valid_stand_in(starts: torch.Tensor) -> torch.Tensor:
    """starts' shape and dtype with every start 0 (valid), on the host: the other rules still see
    them, and nothing waits for the device (so such a launch can be captured in a CUDA graph)."""
    return torch.zeros(starts.shape, dtype=starts.dtype)


def check_inputs(x, starts, w_in, b_in, w_out, b_out, slice_width: int, activation: str = "gelu_tanh",
                 *, check_starts: bool = True) -> Tuple[int, int, int]:
    """The op's validation rules (model.check_op_inputs, docs/reference/spec.md) plus the kernel's own
    limits (float32/float16, one device, CUDA or the interpreter); returns (H, D, K). Raises
    InfMoEError naming the problem. check_starts=False skips only the start range, leaving it to
    the device kernel (NaN rows), as inside a TensorRT engine; for tests of that path."""
    H, D, K = check_op_inputs(x, starts if check_starts else _valid_stand_in(starts), w_in, b_in, w_out, b_out,
                              slice_width, activation)
    _check_launch("ContinuousSliceFFN", x, (x, starts, w_in, b_in, w_out, b_out))
    return H, D, K


def check_q_inputs(x, starts, w_in_q, w_in_scale, b_in, w_out_q, w_out_scale, b_out, slice_width: int, bits: int,
                   block_size: int, activation: str = "gelu_tanh", *,
                   check_starts: bool = True) -> Tuple[int, int, int]:
    """QContinuousSliceFFN's rules (quant.check_q_op_inputs: bits, block size, storage), the
    float op's on the dequantized shapes, and the kernel's limits; returns (H, D, K)."""
    H, D, _ = check_q_op_inputs(x, starts, w_in_q, w_in_scale, b_in, w_out_q, w_out_scale, b_out, slice_width,
                                bits, block_size, activation)
    dequantized = torch.empty((H, D), dtype=x.dtype, device="meta")  # shape and dtype only, never allocated
    _, _, K = check_op_inputs(x, starts if check_starts else _valid_stand_in(starts), dequantized, b_in,
                              dequantized, b_out, slice_width, activation)
    _check_launch(Q_OP_TYPE, x, (x, starts, w_in_q, w_in_scale, b_in, w_out_q, w_out_scale, b_out))
    return H, D, K


def use_split(tokens: int, d_model: int) -> bool:
    """SPLIT when the deterministic column grid would leave most of a large GPU idle (decode)."""
    return tokens * triton.cdiv(d_model, COLUMNS_BLOCK_D) < 512


def _launch(kernel, x, starts, weights, H: int, D: int, K: int, slice_width: int, deterministic: Optional[bool],
            **constants) -> torch.Tensor:
    """Runs kernel (either entry) on checked inputs; weights: the inputs after starts, in order."""
    lead = x.shape[:-1]
    tokens = math.prod(lead)
    if tokens == 0:
        return torch.empty_like(x)
    x2 = x.reshape(tokens, D).contiguous()
    s2 = starts.reshape(tokens, K).contiguous()
    weights = [t.contiguous() for t in weights]
    split = use_split(tokens, D) if deterministic is None else not deterministic
    if split:
        row_blocks = triton.cdiv(slice_width, SPLIT_BLOCK_R)
        # fp32 accumulator starting at b_out: fp16 outputs are rounded once, at the end.
        acc = weights[-1].float().repeat(tokens, 1)  # a copy of b_out: never accumulate into b_out itself
        kernel[(tokens, K * row_blocks)](
            x2, s2, *weights, acc, H=H, D=D, R=slice_width, K=K,
            BLOCK_R=SPLIT_BLOCK_R, BLOCK_D=SPLIT_BLOCK_D, SPLIT=True, num_warps=NUM_WARPS, **constants)
        y = acc.to(x.dtype)
    else:
        y = torch.empty(tokens, D, dtype=x.dtype, device=x.device)
        kernel[(tokens, triton.cdiv(D, COLUMNS_BLOCK_D))](
            x2, s2, *weights, y, H=H, D=D, R=slice_width, K=K,
            BLOCK_R=COLUMNS_BLOCK_R, BLOCK_D=COLUMNS_BLOCK_D, SPLIT=False, num_warps=NUM_WARPS, **constants)
    return y.reshape(*lead, D)


def quant_constants(bits: int, block_size: int) -> dict:
    """The quantized kernel's extra compile-time arguments."""
    return {"BITS": bits, "QBLOCK": block_size}


def continuous_slice_ffn_triton(x, starts, w_in, b_in, w_out, b_out, slice_width: int,
                                activation: str = "gelu_tanh", *, deterministic: Optional[bool] = None,
                                check_starts: bool = True) -> torch.Tensor:
    """y = ContinuousSliceFFN(x, starts, ...) of docs/reference/spec.md with the Triton kernel.

    deterministic=None picks by shape (use_split); True forces the COLUMNS mode (bitwise
    reproducible, what TensorRT engines run); False forces SPLIT (atomics, fastest at decode).
    Invalid input raises InfMoEError before any launch; check_starts=False (tests) lets the
    device kernel meet out-of-range starts, which it answers with NaN rows.
    """
    H, D, K = check_inputs(x, starts, w_in, b_in, w_out, b_out, slice_width, activation, check_starts=check_starts)
    return _launch(continuous_slice_ffn_kernel, x, starts, (w_in, b_in, w_out, b_out), H, D, K, slice_width,
                   deterministic)


def q_continuous_slice_ffn_triton(x, starts, w_in_q, w_in_scale, b_in, w_out_q, w_out_scale, b_out, slice_width: int,
                                  bits: int, block_size: int, activation: str = "gelu_tanh", *,
                                  deterministic: Optional[bool] = None, check_starts: bool = True) -> torch.Tensor:
    """y = QContinuousSliceFFN(...) of SPEC §6 with the Triton kernel: continuous_slice_ffn_triton's
    modes and verdicts, on the packed uint8 weights and block scales of quant.QuantizedWeight."""
    H, D, K = check_q_inputs(x, starts, w_in_q, w_in_scale, b_in, w_out_q, w_out_scale, b_out, slice_width, bits,
                             block_size, activation, check_starts=check_starts)
    return _launch(q_continuous_slice_ffn_kernel, x, starts, (w_in_q, w_in_scale, b_in, w_out_q, w_out_scale, b_out),
                   H, D, K, slice_width, deterministic, **quant_constants(bits, block_size))
