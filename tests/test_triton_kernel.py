"""The Triton kernel's own properties, in Triton's CPU interpreter. Its values and verdicts
against the reference (valid and invalid input, fp32 and fp16, both modes, the device kernel
without the launcher's check) are rows of tests/test_op_conformance.py.

conftest.py sets TRITON_INTERPRET=1 before anything imports triton (the mode is fixed then).
Shapes are small because the interpreter runs every program in Python.
"""

import pytest
import torch

from infmoe_export.errors import InfMoEError
from infmoe_export.model import continuous_slice_ffn

pytest.importorskip("triton")
from infmoe_export.runtimes.tensorrt.plugin import triton_kernel


def make_inputs(lead, H, D, r, K, seed=0):
    """Random inputs, weights scaled like a trained layer so outputs stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, D, generator=g)
    starts = torch.randint(0, H - r + 1, (*lead, K), generator=g)
    w_in = torch.randn(H, D, generator=g) / D ** 0.5
    b_in = torch.randn(H, generator=g) * 0.5
    w_out = torch.randn(H, D, generator=g) / r ** 0.5
    b_out = torch.randn(D, generator=g)
    return x, starts, w_in, b_in, w_out, b_out


def test_columns_mode_is_bitwise_reproducible():
    inputs = make_inputs((3,), 41, 23, 7, 5, seed=5)
    first = triton_kernel.continuous_slice_ffn_triton(*inputs, 7, deterministic=True)
    again = triton_kernel.continuous_slice_ffn_triton(*inputs, 7, deterministic=True)
    assert torch.equal(first, again)


def test_does_not_modify_inputs():
    # The split mode accumulates into a copy of b_out, never into b_out itself (one token).
    inputs = make_inputs((1,), 23, 11, 4, 3, seed=6)
    before = [t.clone() for t in inputs]
    triton_kernel.continuous_slice_ffn_triton(*inputs, 4, deterministic=False)
    assert all(torch.equal(a, b) for a, b in zip(inputs, before))


@pytest.mark.parametrize("deterministic", [True, False], ids=["columns", "split"])
def test_device_kernel_poisons_only_the_bad_token(deterministic):
    """Without the launcher's check (as in a TensorRT engine) a bad start makes its token's row
    NaN in both modes; the other tokens keep the reference's values."""
    H, r = 29, 6
    x, starts, w_in, b_in, w_out, b_out = make_inputs((4,), H, 9, r, 3, seed=8)
    starts[2, 1] = H - r + 1
    y = triton_kernel.continuous_slice_ffn_triton(x, starts, w_in, b_in, w_out, b_out, r,
                                                  deterministic=deterministic, check_starts=False)
    assert y[2].isnan().all()
    good = [0, 1, 3]
    ref = continuous_slice_ffn(x[good], starts[good], w_in, b_in, w_out, b_out, r)
    torch.testing.assert_close(y[good], ref, rtol=1e-5, atol=1e-5)


def test_only_float32_and_float16():
    inputs = [t.double() if t.is_floating_point() else t for t in make_inputs((2,), 23, 11, 4, 3, seed=7)]
    with pytest.raises(InfMoEError, match="X must be float32 or float16"):
        triton_kernel.continuous_slice_ffn_triton(*inputs, 4)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InfMoEError, match="needs CUDA tensors"):
        triton_kernel.continuous_slice_ffn_triton(*make_inputs((1,), 23, 11, 4, 2), 4)
