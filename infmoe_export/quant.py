"""Block quantization of the expert weights and the op `infmoe::QContinuousSliceFFN` (SPEC §6).

One row of w_in or w_out (a hidden unit, length D) is cut into blocks of B consecutive columns;
each block gets one scale, max|w| / qmax, and its weights are rounded half to even onto
[-qmax, qmax]. Storage is unsigned with the offset 2^(bits-1) (MatMulNBits' layout): a byte per
weight at int8, two per byte at int4 (even column in the low nibble, a pad nibble of 8 when D is
odd). The dequantized weights w' = q * scale are what every kernel must reproduce (level 1).
"""

import copy
from typing import Dict, NamedTuple, Optional

import torch

from .errors import InfMoEError
from .model import InfMoEGPT, continuous_slice_ffn

PRECISIONS = ("fp32", "fp16", "int8", "int4")
BITS = {"int8": 8, "int4": 4}
DEFAULT_BLOCK_SIZE = 32
Q_OP_TYPE = "QContinuousSliceFFN"
QMATMUL_OP_TYPE = "QMatMul"


def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def check_bits(bits) -> int:
    if isinstance(bits, bool) or bits not in (4, 8):
        raise InfMoEError(f"bits must be 4 or 8, got {bits!r}")
    return bits


def check_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 16 \
            or block_size & (block_size - 1):
        raise InfMoEError(f"block size must be a power of two >= 16, got {block_size!r}")
    return block_size


def n_blocks(d: int, block_size: int) -> int:
    return -(-d // block_size)


def packed_columns(d: int, bits: int) -> int:
    return d if bits == 8 else -(-d // 2)


def _blocked(w: torch.Tensor, block_size: int) -> torch.Tensor:
    """[H, D] -> [H, nb, B], the partial last block padded with zeros (they change no max)."""
    h, d = w.shape
    pad = n_blocks(d, block_size) * block_size - d
    return torch.nn.functional.pad(w, (0, pad)).view(h, -1, block_size)


def quantize(w: torch.Tensor, bits: int, block_size: int):
    """w [H, D] float -> (q int8 [H, D] in [-qmax, qmax], scale float32 [H, ceil(D / B)])."""
    check_bits(bits), check_block_size(block_size)
    w = w.detach().to(torch.float32)
    blocks = _blocked(w, block_size)
    scale = blocks.abs().amax(dim=-1) / qmax(bits)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe.unsqueeze(-1)).clamp(-qmax(bits), qmax(bits))
    q = torch.where(scale.unsqueeze(-1) > 0, q, torch.zeros_like(q))
    return q.reshape(w.shape[0], -1)[:, :w.shape[1]].to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block_size: int, dtype=torch.float32) -> torch.Tensor:
    """w'[i, j] = q[i, j] * scale[i, j div B], computed in float32, returned in dtype."""
    d = q.shape[1]
    w = _blocked(q.to(torch.float32), block_size) * scale.to(torch.float32).unsqueeze(-1)
    return w.reshape(q.shape[0], -1)[:, :d].to(dtype)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed q [H, D] -> the uint8 storage of SPEC §6."""
    stored = (q.to(torch.int16) + 2 ** (bits - 1)).to(torch.uint8)
    if bits == 8:
        return stored
    if stored.shape[1] % 2:  # the pad nibble of an odd D holds the offset (q = 0)
        stored = torch.cat([stored, torch.full_like(stored[:, :1], 8)], dim=1)
    return stored[:, 0::2] | (stored[:, 1::2] << 4)


def unpack(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """The uint8 storage -> signed q [H, D] (int8)."""
    if bits == 8:
        stored = packed.to(torch.int16)
    else:
        low, high = (packed & 0x0F).to(torch.int16), (packed >> 4).to(torch.int16)
        stored = torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)[:, :d]
    return (stored - 2 ** (bits - 1)).to(torch.int8)


def pack_blocks(q: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    """Signed q [N, K] -> the storage of `infmoe::QMatMul` and of onnxruntime's MatMulNBits,
    [N, ceil(K / B), B * bits / 8]: SPEC §6's, each row padded with q = 0 to whole blocks."""
    n, k = q.shape
    padded = torch.nn.functional.pad(q, (0, n_blocks(k, block_size) * block_size - k))
    return pack(padded, bits).reshape(n, n_blocks(k, block_size), -1)


def q_matmul(a: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    """`infmoe::QMatMul` (docs/reference/ops/QMatMul.md): a [..., K] times w'^T, w' [N, K] the
    dequantized weight of pack_blocks' storage."""
    n, blocks, _ = packed.shape
    q = unpack(packed.reshape(n, -1), bits, blocks * block_size)[:, :a.shape[-1]]
    return a @ dequantize(q, scale, block_size, a.dtype).T


ACTIVATION_GROUP = 32  # activation columns per int8 scale (the kernel's infmoe.activations = int8)


def int8_activations(a: torch.Tensor) -> torch.Tensor:
    """a [..., K] as the kernel's int8 activations see it: per row and group of 32 columns,
    qx = clamp(round_half_even(a / s), -127, 127) with s = max |a| / 127 (0 for a zero group),
    returned dequantized (qx * s, float32); a group holding a NaN or infinity becomes NaN."""
    a = a.to(torch.float32)
    k = a.shape[-1]
    groups = -(-k // ACTIVATION_GROUP)
    padded = torch.nn.functional.pad(a, (0, groups * ACTIVATION_GROUP - k)).reshape(*a.shape[:-1], groups, ACTIVATION_GROUP)
    finite = torch.isfinite(padded).all(dim=-1, keepdim=True)
    scale = torch.where(finite, padded.abs().amax(dim=-1, keepdim=True), torch.zeros(())) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(finite, torch.round(padded / safe).clamp(-127, 127), torch.zeros(()))
    out = torch.where(finite, q * scale, torch.full_like(q, float("nan")))
    return out.reshape(*a.shape[:-1], groups * ACTIVATION_GROUP)[..., :k]


class QuantizedWeight(NamedTuple):
    packed: torch.Tensor  # uint8 storage
    scale: torch.Tensor   # [H, ceil(D / B)]

    @classmethod
    def of(cls, w: torch.Tensor, bits: int, block_size: int, scale_dtype=torch.float32):
        q, scale = quantize(w, bits, block_size)
        return cls(pack(q, bits), scale.to(scale_dtype))

    def dequantized(self, bits: int, block_size: int, d: int, dtype=torch.float32) -> torch.Tensor:
        return dequantize(unpack(self.packed, bits, d), self.scale, block_size, dtype)


def check_q_op_inputs(x, starts, w_in_q, w_in_scale, b_in, w_out_q, w_out_scale, b_out, slice_width, bits,
                      block_size, activation="gelu_tanh"):
    """The quantized op's own rules (bits, block size, storage shapes and types), then the float
    op's on the dequantized shapes. Returns (H, D, K). One line per refusal, naming the rule."""
    def refuse(message):
        raise InfMoEError(f"{Q_OP_TYPE}: {message}")

    try:
        check_bits(bits), check_block_size(block_size)
    except InfMoEError as error:
        refuse(str(error))
    if x.dim() < 1:
        refuse(f"X must have shape [..., D], got {list(x.shape)}")
    d = x.shape[-1]
    h = w_in_q.shape[0] if w_in_q.dim() == 2 else -1
    shapes = (("w_in_q", w_in_q, [h, packed_columns(d, bits)]), ("w_out_q", w_out_q, [h, packed_columns(d, bits)]),
              ("w_in_scale", w_in_scale, [h, n_blocks(d, block_size)]),
              ("w_out_scale", w_out_scale, [h, n_blocks(d, block_size)]))
    for name, tensor, shape in shapes:
        if list(tensor.shape) != shape:
            refuse(f"{name} must have shape {shape} for D {d}, {bits} bits and block size {block_size}, "
                   f"got {list(tensor.shape)}")
    for name, tensor in (("w_in_q", w_in_q), ("w_out_q", w_out_q)):
        if tensor.dtype != torch.uint8:
            refuse(f"{name} must be uint8, got {tensor.dtype}")
    for name, tensor in (("w_in_scale", w_in_scale), ("w_out_scale", w_out_scale)):
        if tensor.dtype != x.dtype:
            refuse(f"{name} must have X's dtype {x.dtype}, got {tensor.dtype}")
    return h, d, starts.shape[-1] if starts.dim() else 0


def q_continuous_slice_ffn(x, starts, w_in_q, w_in_scale, b_in, w_out_q, w_out_scale, b_out, slice_width: int,
                           bits: int, block_size: int, activation: str = "gelu_tanh") -> torch.Tensor:
    """`infmoe::QContinuousSliceFFN`: section 3's y with the dequantized weights w' (SPEC §6)."""
    _, d, _ = check_q_op_inputs(x, starts, w_in_q, w_in_scale, b_in, w_out_q, w_out_scale, b_out, slice_width,
                                bits, block_size, activation)
    w_in = dequantize(unpack(w_in_q, bits, d), w_in_scale, block_size, x.dtype)
    w_out = dequantize(unpack(w_out_q, bits, d), w_out_scale, block_size, x.dtype)
    return continuous_slice_ffn(x, starts, w_in, b_in, w_out, b_out, slice_width, activation)


def quantized_tensors(config, bits: Optional[int], other_bits: Optional[int] = None) -> Dict[str, int]:
    """Checkpoint name -> bits of every matrix an export stores as integers: the experts at bits,
    attention and the tied embedding / LM head at other_bits (None: kept float). Every one is
    quantized as stored, [out, in] or [H, D]: rows blocked along D; a conventional MoE's stacked
    experts [E, out, in] the same, row by row (docs/reference/spec.md §7)."""
    names = {"wte.weight": other_bits} if other_bits else {}
    for i in range(config.n_layer):
        if bits:
            names.update({f"h.{i}.moe.w_in": bits, f"h.{i}.moe.w_out": bits})
        if other_bits:
            names.update({f"h.{i}.attn.qkv.weight": other_bits, f"h.{i}.attn.proj.weight": other_bits})
    return names


def dequantized_model(model: InfMoEGPT, bits: Optional[int], block_size: int,
                      other_bits: Optional[int] = None) -> InfMoEGPT:
    """A copy of the model whose quantized matrices (quantized_tensors) are w' (float32): the
    level-1 reference of an export with these settings."""
    copied = copy.deepcopy(model)
    parameters = dict(copied.named_parameters())
    with torch.no_grad():
        for name, n_bits in quantized_tensors(model.config, bits, other_bits).items():
            weight = parameters[name]
            q, scale = quantize(weight.reshape(-1, weight.shape[-1]), n_bits, block_size)
            weight.copy_(dequantize(q, scale, block_size).reshape(weight.shape))
    return copied


def expert_bytes(h: int, d: int, bits: int, block_size: int, scale_bytes: int = 4) -> int:
    """Bytes of one packed expert matrix and its scales."""
    return h * packed_columns(d, bits) + h * n_blocks(d, block_size) * scale_bytes
