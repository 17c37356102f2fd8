"""ContinuousSliceFFN (docs/spec.md) as one Triton kernel, shared by the TensorRT plugin and PyTorch.

The algorithm is docs/spec.md's. For every token the kernel visits the union of its K windows
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
from infmoe_export.model import GELU_TANH_C, GELU_TANH_CUBIC, check_op_inputs

# Fixed launch configuration of the COLUMNS mode (the one baked into TensorRT engines).
COLUMNS_BLOCK_R, COLUMNS_BLOCK_D, NUM_WARPS = 32, 64, 4
SPLIT_BLOCK_R, SPLIT_BLOCK_D = 8, 256  # untuned: no GPU was lent (see docs/tensorrt.md)
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
    # 0 for a valid token, NaN for one with an out-of-range start: added to what it writes.
    poison = tl.where(_bad_token(starts_ptr, token, H, R, K), float("nan"), 0.0)
    if SPLIT:
        block = tl.program_id(1)
        rows, owned, weight = _owned_rows(starts_ptr, token, block // row_blocks, block % row_blocks,
                                          H, R, K, BLOCK_R)
        if tl.sum(owned.to(tl.int32)) > 0:  # a block covered by earlier windows does nothing
            h = _hidden(x_ptr, w_in_ptr, b_in_ptr, token, rows, owned, weight, D, BLOCK_D)
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                # Window 0's first block always owns rows, so a bad token always receives a NaN.
                tl.atomic_add(y_ptr + token * D + cols,
                              _contribution(w_out_ptr, rows, owned, h, cols, D) + poison, mask=cols < D)
    else:
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        acc = tl.load(b_out_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        for k in tl.static_range(K):
            for j in range(row_blocks):
                rows, owned, weight = _owned_rows(starts_ptr, token, k, j, H, R, K, BLOCK_R)
                if tl.sum(owned.to(tl.int32)) > 0:
                    h = _hidden(x_ptr, w_in_ptr, b_in_ptr, token, rows, owned, weight, D, BLOCK_D)
                    acc += _contribution(w_out_ptr, rows, owned, h, cols, D)
        tl.store(y_ptr + token * D + cols, (acc + poison).to(y_ptr.dtype.element_ty), mask=cols < D)


# ---------------------------------------------------------------------------------------------
# Python launcher


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_inputs(x, starts, w_in, b_in, w_out, b_out, slice_width: int, activation: str = "gelu_tanh",
                 *, check_starts: bool = True) -> Tuple[int, int, int]:
    """The op's validation rules (model.check_op_inputs, docs/spec.md) plus the kernel's own
    limits (float32/float16, one device, CUDA or the interpreter); returns (H, D, K). Raises
    InfMoEError naming the problem. check_starts=False skips only the start range, leaving it to
    the device kernel (NaN rows), as inside a TensorRT engine; for tests of that path."""
    if check_starts:
        H, D, K = check_op_inputs(x, starts, w_in, b_in, w_out, b_out, slice_width, activation)
    else:  # the same rules with every start replaced by a valid one (0)
        H, D, K = check_op_inputs(x, torch.zeros_like(starts), w_in, b_in, w_out, b_out, slice_width, activation)
    if x.dtype not in (torch.float32, torch.float16):
        raise InfMoEError(f"ContinuousSliceFFN: X must be float32 or float16, got {x.dtype}")
    devices = {t.device for t in (x, starts, w_in, b_in, w_out, b_out)}
    if len(devices) > 1:
        raise InfMoEError(f"ContinuousSliceFFN: all inputs must be on one device, got {sorted(map(str, devices))}")
    if x.device.type != "cuda" and not _interpreting():
        raise InfMoEError("ContinuousSliceFFN: the Triton kernel needs CUDA tensors "
                          "(or TRITON_INTERPRET=1 to run it in Triton's CPU interpreter)")
    return H, D, K


def use_split(tokens: int, d_model: int) -> bool:
    """SPLIT when the deterministic column grid would leave most of a large GPU idle (decode)."""
    return tokens * triton.cdiv(d_model, COLUMNS_BLOCK_D) < 512


def continuous_slice_ffn_triton(x, starts, w_in, b_in, w_out, b_out, slice_width: int,
                                activation: str = "gelu_tanh", *, deterministic: Optional[bool] = None,
                                check_starts: bool = True) -> torch.Tensor:
    """y = ContinuousSliceFFN(x, starts, ...) of docs/spec.md with the Triton kernel.

    deterministic=None picks by shape (use_split); True forces the COLUMNS mode (bitwise
    reproducible, what TensorRT engines run); False forces SPLIT (atomics, fastest at decode).
    Invalid input raises InfMoEError before any launch; check_starts=False (tests) lets the
    device kernel meet out-of-range starts, which it answers with NaN rows.
    """
    H, D, K = check_inputs(x, starts, w_in, b_in, w_out, b_out, slice_width, activation, check_starts=check_starts)
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

