"""The Triton ContinuousSliceFFN kernel against the reference op, in Triton's CPU interpreter.

TRITON_INTERPRET=1 must be set before the kernel module is imported (triton.jit reads it when it
decorates). Shapes are small and odd because the interpreter runs every program in Python.

Tolerances: float32 rtol = atol = 1e-5 against the float32 reference. float16: inputs rounded
to float16, reference computed in float32 from those same values, rtol = atol = 4e-3 (the
kernel accumulates in float32; the difference is the final float16 rounding, 2^-11 relative,
plus accumulation order).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from infmoe_export.errors import InfMoEError  # noqa: E402
from infmoe_export.model import continuous_slice_ffn  # noqa: E402
from infmoe_export.runtimes.tensorrt import import_infmoe_trt  # noqa: E402

kernel = import_infmoe_trt("kernel")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3}


def make_inputs(lead, H, D, r, K, dtype=torch.float32, starts=None, seed=0):
    """Fresh random inputs, weights scaled like a trained layer so outputs stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, D, generator=g)
    w_in = torch.randn(H, D, generator=g) / D ** 0.5
    b_in = torch.randn(H, generator=g) * 0.5
    w_out = torch.randn(H, D, generator=g) / r ** 0.5
    b_out = torch.randn(D, generator=g)
    if starts is None:
        starts = torch.randint(0, H - r + 1, (*lead, K), generator=g)
    tensors = [t.to(dtype) for t in (x, w_in, b_in, w_out, b_out)]
    return tensors[0], starts, *tensors[1:]


def check(lead, H, D, r, K, dtype=torch.float32, starts=None, deterministic=None, seed=0):
    x, s, w_in, b_in, w_out, b_out = make_inputs(lead, H, D, r, K, dtype, starts, seed)
    y = kernel.continuous_slice_ffn_triton(x, s, w_in, b_in, w_out, b_out, r, deterministic=deterministic)
    ref = continuous_slice_ffn(x.float(), s, w_in.float(), b_in.float(), w_out.float(), b_out.float(), r)
    assert y.dtype == dtype and y.shape == x.shape
    assert not torch.equal(ref, torch.zeros_like(ref))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol)
    return y


MODES = pytest.mark.parametrize("deterministic", [True, False], ids=["columns", "split"])


@MODES
@pytest.mark.parametrize("K", range(1, 9))
def test_random_starts_every_k(K, deterministic):
    check((3,), H=41, D=23, r=7, K=K, deterministic=deterministic, seed=K)


@MODES
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_window_edges_r1(dtype, deterministic):
    # r = 1: single-unit windows at the first and the last position (0 and H - r), and a repeat.
    H = 37
    starts = torch.tensor([[0, H - 1, H - 1], [H - 1, 0, 17]])
    check((2,), H=H, D=19, r=1, K=3, dtype=dtype, starts=starts, deterministic=deterministic)


@MODES
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_whole_ffn_r_equals_h(dtype, deterministic):
    # r = H: every window is the whole FFN and every start is 0 (the dense GPT-2 MLP).
    H = 29
    check((2, 2), H=H, D=13, r=H, K=4, dtype=dtype, starts=torch.zeros(2, 2, 4, dtype=torch.int64),
          deterministic=deterministic)


@MODES
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_overlapping_and_disjoint_windows(dtype, deterministic):
    H, r = 43, 9
    starts = torch.tensor([
        [3, 4, 5, 4],              # heavy overlap, one window repeated: coverage up to 3/4
        [0, 10, 20, H - r],        # disjoint, touching 0 and H - r
        [30, 0, 31, 12],           # a mix, out of order
    ])
    check((3,), H=H, D=21, r=r, K=4, dtype=dtype, starts=starts, deterministic=deterministic)


def test_many_tokens_and_leading_dims():
    # [batch, seq, D] like the decoder, with the K = 8 budget; the default picks the mode by size.
    check((2, 5), H=31, D=17, r=5, K=8, seed=3)


def test_single_token_without_leading_dims():
    check((), H=23, D=11, r=4, K=2, seed=4)


def test_columns_mode_is_bitwise_reproducible():
    inputs = make_inputs((3,), 41, 23, 7, 5, seed=5)
    first = kernel.continuous_slice_ffn_triton(*inputs, 7, deterministic=True)
    again = kernel.continuous_slice_ffn_triton(*inputs, 7, deterministic=True)
    assert torch.equal(first, again)


def test_does_not_modify_inputs():
    # The split mode accumulates into a copy of b_out, never into b_out itself (one token).
    inputs = make_inputs((1,), 23, 11, 4, 3, seed=6)
    before = [t.clone() for t in inputs]
    kernel.continuous_slice_ffn_triton(*inputs, 4, deterministic=False)
    assert all(torch.equal(a, b) for a, b in zip(inputs, before))


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(starts=a["starts"] - 50), "starts must lie in"),
    (lambda a: a.update(starts=a["starts"] + 50), "starts must lie in"),
    (lambda a: a.update(starts=a["starts"].int()), "starts must be int64"),
    (lambda a: a.update(starts=a["starts"][:1]), "starts must have shape"),
    (lambda a: a.update(w_in=a["w_in"][:, :-1]), "w_in must have shape"),
    (lambda a: a.update(b_in=a["b_in"][:-1]), "b_in must have shape"),
    (lambda a: a.update(w_out=a["w_out"][:-1]), "w_out must have shape"),
    (lambda a: a.update(b_out=a["b_out"][:-1]), "b_out must have shape"),
    (lambda a: a.update(w_out=a["w_out"].double()), "w_out must have X's dtype"),
    (lambda a: a.update(x=a["x"].double()), "X must be float32 or float16"),
    (lambda a: a.update(slice_width=24), "slice_width must be an integer in"),
    (lambda a: a.update(slice_width=0), "slice_width must be an integer in"),
])
def test_bad_inputs_are_refused(change, message):
    x, starts, w_in, b_in, w_out, b_out = make_inputs((2,), 23, 11, 4, 3, seed=7)
    args = dict(x=x, starts=starts, w_in=w_in, b_in=b_in, w_out=w_out, b_out=b_out, slice_width=4)
    change(args)
    with pytest.raises(InfMoEError, match=message):
        kernel.continuous_slice_ffn_triton(**args)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InfMoEError, match="needs CUDA tensors"):
        kernel.continuous_slice_ffn_triton(*make_inputs((1,), 23, 11, 4, 2), 4)
