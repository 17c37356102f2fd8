"""The integer parts of an int8 / int4 export (SPEC §6, docs/quantization.md).

Expert weights of a sparse model go to `infmoe::QContinuousSliceFFN` as uint8 storage and
float32 scales (buffers of the traced module, see exporter._ExportMoE). Every other quantized
matrix (attention, the tied embedding / LM head, and the experts of a dense model, which has
no custom op) becomes a standard `DequantizeLinear` (opset 21: blocked, signed INT8 / INT4, no
zero point) in front of its MatMul or Gather: the graph is traced in float32 and this pass
swaps each such initializer for the dequantized value of the same weight, so the numbers are
quant.py's w' and the graph is otherwise the float graph.
"""

from typing import Dict, Optional

import ml_dtypes
import numpy as np
import onnx_ir as ir
import torch

from ..contract import DecoderIO
from ..errors import InfMoEError
from ..quant import quantize, quantized_tensors

# DequantizeLinear takes block_size and INT4 from opset 21 on.
QDQ_OPSET = 21
_STORAGE = {8: np.int8, 4: ml_dtypes.int4}


def qdq_matrices(decoder_io: DecoderIO) -> Dict[str, int]:
    """Checkpoint name -> bits of every matrix that is stored as DequantizeLinear: all quantized
    ones but a sparse model's experts (those are the custom op's)."""
    c = decoder_io.config
    return {name: bits for name, bits in quantized_tensors(c, decoder_io.bits, decoder_io.other_bits).items()
            if c.is_dense or ".moe." not in name}


def resolve_opset(opset: Optional[int], decoder_io: DecoderIO, default: int) -> int:
    """The opset to export: the given one, or default; QDQ needs QDQ_OPSET or later."""
    needs = QDQ_OPSET if qdq_matrices(decoder_io) else None
    if opset is None:
        return max(default, needs or default)
    if needs and isinstance(opset, int) and opset < needs:
        what = "--quantize-other" if decoder_io.other_bits else f"a dense model at {decoder_io.dtype}"
        raise InfMoEError(f"opset {opset} is too old for {what}: DequantizeLinear with a block size needs "
                          f"opset >= {needs}")
    return opset


def insert_dequantize(graph: ir.Graph, weights: Dict[str, torch.Tensor], decoder_io: DecoderIO):
    """Replace every initializer named after a matrix of qdq_matrices (as stored, [out, in], or
    as torch.onnx's transposed copy '<name>.T', [in, out]) by DequantizeLinear of its quantized
    weight, blocked along the input dimension either way; weights: checkpoint name -> tensor."""
    block = decoder_io.block_size
    for name, bits in qdq_matrices(decoder_io).items():
        q, scale = quantize(weights[name], bits, block)
        for stored, transposed in ((name, False), (f"{name}.T", True)):
            value = graph.initializers.get(stored)
            if value is None:
                continue
            q_array, scale_array = (q.T, scale.T) if transposed else (q, scale)
            q_value = ir.Value(name=f"{stored}_quantized", const_value=ir.Tensor(
                np.ascontiguousarray(q_array.numpy()).astype(_STORAGE[bits])))
            scale_value = ir.Value(name=f"{stored}_scale", const_value=ir.Tensor(
                np.ascontiguousarray(scale_array.numpy())))
            for initializer in (q_value, scale_value):
                initializer.shape, initializer.type = initializer.const_value.shape, ir.TensorType(
                    initializer.const_value.dtype)
                graph.register_initializer(initializer)
            node = ir.Node("", "DequantizeLinear", [q_value, scale_value], name=f"/{stored}/DequantizeLinear",
                           attributes=[ir.AttrInt64("axis", 0 if transposed else 1), ir.AttrInt64("block_size", block)])
            graph.append(node)
            graph.initializers.pop(stored)
            ir.convenience.replace_all_uses_with(value, node.outputs[0])
            out = node.outputs[0]
            out.name, out.shape, out.type = stored, value.shape, value.type
