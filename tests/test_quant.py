"""SPEC §6 quantization against a plain per-element loop, and the op's level-1 reference."""

import random

import pytest
import torch

from infmoe_export.errors import InfMoEError
from infmoe_export.model import continuous_slice_ffn
from infmoe_export.quant import (QuantizedWeight, check_q_op_inputs, dequantize, pack, q_continuous_slice_ffn,
                                 quantize, unpack)


def loop_quantize(w, bits, block):
    """SPEC §6 read literally, one element at a time (Python floats are doubles: compare the
    float32 scale the spec stores, and round w / scale in float32 as the kernels do)."""
    qm = 2 ** (bits - 1) - 1
    h, d = w.shape
    nb = -(-d // block)
    q = [[0] * d for _ in range(h)]
    scale = torch.zeros(h, nb)
    for i in range(h):
        for b in range(nb):
            cols = range(b * block, min((b + 1) * block, d))
            s = torch.tensor(max(abs(float(w[i, j])) for j in cols), dtype=torch.float32) / qm
            scale[i, b] = s
            for j in cols:
                if s > 0:
                    value = torch.round(w[i, j] / s).item()  # torch.round: half to even
                    q[i][j] = int(max(-qm, min(qm, value)))
    return torch.tensor(q, dtype=torch.int8), scale


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("d,block", [(37, 16), (33, 32), (64, 32), (5, 16)])
def test_quantize_matches_the_per_element_rule(bits, d, block):
    w = torch.randn(7, d) * torch.rand(7, 1) * 3
    w[2, :min(block, d)] = 0  # an all-zero block
    w[3, 0] = 1e30  # an extreme value: the rest of its block rounds to 0
    q, scale = quantize(w, bits, block)
    q_loop, scale_loop = loop_quantize(w, bits, block)
    assert torch.equal(scale, scale_loop)
    assert torch.equal(q, q_loop)
    assert scale[2, 0] == 0 and not q[2, :min(block, d)].any()
    w_prime = dequantize(q, scale, block)
    assert torch.equal(w_prime[3, 0], w[3, 0]) or abs(float(w_prime[3, 0] / w[3, 0]) - 1) < 1e-6


def test_round_half_even_ties():
    # Block max 7 at int4: scale 1, so the weights are their own quotients; x.5 ties go to even.
    w = torch.tensor([[7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] + [0.0] * 8])
    q, scale = quantize(w, 4, 16)
    assert float(scale[0, 0]) == 1.0
    assert q[0, :8].tolist() == [7, 0, 2, 2, 0, -2, -2, 4]


@pytest.mark.parametrize("d", [1, 6, 7, 37])
def test_pack_layout(d):
    q = torch.randint(-7, 8, (3, d), dtype=torch.int8)
    packed = pack(q, 4)
    assert packed.shape == (3, (d + 1) // 2) and packed.dtype == torch.uint8
    for i in range(3):
        for j in range(d):
            byte = int(packed[i, j // 2])
            nibble = byte & 0xF if j % 2 == 0 else byte >> 4  # even column: the low nibble
            assert nibble == int(q[i, j]) + 8
        if d % 2:
            assert int(packed[i, -1]) >> 4 == 8  # the pad nibble holds the offset
    assert torch.equal(unpack(packed, 4, d), q)
    q8 = torch.randint(-127, 128, (3, d), dtype=torch.int8)
    assert torch.equal(pack(q8, 8), (q8.to(torch.int16) + 128).to(torch.uint8))
    assert torch.equal(unpack(pack(q8, 8), 8, d), q8)


@pytest.mark.parametrize("bits", [8, 4])
def test_op_reference_is_the_float_op_on_w_prime(bits):
    h, d, r, k = random.choice([(41, 19, 7, 3), (23, 37, 23, 1), (50, 33, 1, 4)])
    x = torch.randn(2, 3, d)
    starts = torch.randint(0, h - r + 1, (2, 3, k))
    starts[0, 0, 0], starts[-1, -1, -1] = 0, h - r
    w_in, w_out = torch.randn(h, d), torch.randn(h, d)
    b_in, b_out = torch.randn(h), torch.randn(d)
    qi, qo = QuantizedWeight.of(w_in, bits, 16), QuantizedWeight.of(w_out, bits, 16)
    y = q_continuous_slice_ffn(x, starts, qi.packed, qi.scale, b_in, qo.packed, qo.scale, b_out, r, bits, 16)
    wi, wo = qi.dequantized(bits, 16, d), qo.dequantized(bits, 16, d)
    assert torch.equal(y, continuous_slice_ffn(x, starts, wi, b_in, wo, b_out, r))
    # close to the float op: the quantization error is bounded by half a step per weight
    assert (wi - w_in).abs().max() <= qi.scale.max() / 2 + 1e-6


def test_bad_quantized_inputs_are_named():
    d, h = 19, 11
    x, starts = torch.randn(2, d), torch.zeros(2, 1, dtype=torch.int64)
    qw = QuantizedWeight.of(torch.randn(h, d), 4, 16)
    args = [x, starts, qw.packed, qw.scale, torch.randn(h), qw.packed, qw.scale, torch.randn(d), 3]
    for bits, block, needle in ((3, 16, "bits"), (4, 24, "block size"), (4, 8, "block size"), (8, 16, "w_in_q")):
        with pytest.raises(InfMoEError, match=needle):
            check_q_op_inputs(*args, bits, block)
    with pytest.raises(InfMoEError, match="w_in_scale must have X's dtype"):
        check_q_op_inputs(x, starts, qw.packed, qw.scale.half(), *args[4:], 4, 16)
    with pytest.raises(InfMoEError, match="block size"):
        quantize(torch.randn(3, 5), 4, 0)
