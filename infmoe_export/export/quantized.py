"""The integer parts of an int8 / int4 export (SPEC §6, docs/guide/quantization.md).

Expert weights go to `infmoe::QContinuousSliceFFN` as uint8 storage and float32 scales (buffers
of the traced module, see exporter._ExportMoE), a dense model's too on the onnxruntime target
(DecoderIO.experts_in_op). Every other quantized matrix (attention, the tied embedding / LM head,
and the experts of a dense model elsewhere, a standard MLP) becomes a standard `DequantizeLinear` (opset 21: blocked, signed INT8 / INT4, no
zero point) in front of its MatMul or Gather: the graph is traced in float32 and this pass
swaps each such initializer for the dequantized value of the same weight, so the numbers are
quant.py's w' and the graph is otherwise the float graph.

onnxruntime fuses DequantizeLinear + MatMul into MatMulNBits (attention), but not the tied
embedding: its Gather and the LM head's Transpose + MatMul dequantize all of wte on every run
(many times a float32 step at GPT-2's vocabulary, docs/guide/quantization.md). The
onnxruntime target therefore stores each such matrix once in MatMulNBits' layout and reads it
with infmoe::QMatMul (every MatMul: attention and the LM head; its fallback function is
MatMulNBits itself; our kernel reads faster: python -m benchmarks.qmatmul) and com.microsoft
GatherBlockQuantized (the embedding): same w'.
"""

from typing import Dict, Optional

import ml_dtypes
import numpy as np
import onnx_ir as ir
import torch

from ..contract import DOMAIN, OP_VERSION, DecoderIO
from ..errors import InfMoEError
from ..quant import QMATMUL_OP_TYPE, n_blocks, pack_blocks, quantize, quantized_tensors

# DequantizeLinear takes block_size and INT4 from opset 21 on.
QDQ_OPSET = 21
_STORAGE = {8: np.int8, 4: ml_dtypes.int4}
MS_DOMAIN = "com.microsoft"


def qdq_matrices(decoder_io: DecoderIO) -> Dict[str, int]:
    """Checkpoint name -> bits of every matrix that is stored as DequantizeLinear: all quantized
    ones but the experts of the expert op (DecoderIO.experts_in_op)."""
    c = decoder_io.config
    return {name: bits for name, bits in quantized_tensors(c, decoder_io.bits, decoder_io.other_bits).items()
            if not decoder_io.experts_in_op or ".moe." not in name}


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
        if decoder_io.target == "onnxruntime":
            _onnxruntime_readers(graph, name, q, scale, bits, block)
        for stored, transposed in ((name, False), (f"{name}.T", True)):
            value = graph.initializers.get(stored)
            if value is None:
                continue
            if not value.uses():  # every reader rewired above
                graph.initializers.pop(stored)
                continue
            q_array, scale_array = (q.T, scale.T) if transposed else (q, scale)
            q_value = _initializer(graph, f"{stored}_quantized", q_array.numpy().astype(_STORAGE[bits]))
            scale_value = _initializer(graph, f"{stored}_scale", scale_array.numpy())
            node = ir.Node("", "DequantizeLinear", [q_value, scale_value], name=f"/{stored}/DequantizeLinear",
                           attributes=[ir.AttrInt64("axis", 0 if transposed else 1), ir.AttrInt64("block_size", block)])
            graph.append(node)
            graph.initializers.pop(stored)
            ir.convenience.replace_all_uses_with(value, node.outputs[0])
            out = node.outputs[0]
            out.name, out.shape, out.type = stored, value.shape, value.type


def _initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.Tensor(np.ascontiguousarray(array)))
    value.shape, value.type = value.const_value.shape, ir.TensorType(value.const_value.dtype)
    graph.register_initializer(value)
    return value


def _onnxruntime_readers(graph: ir.Graph, name: str, q: torch.Tensor, scale: torch.Tensor, bits: int, block: int):
    """The onnxruntime target's readers of a quantized matrix (module doc) take one packed copy,
    [rows, blocks, bytes per block] (quant.pack_blocks): every MatMul of it (on '<name>.T', or on
    Transpose(name): the input dimension is the blocked one) becomes infmoe::QMatMul, the tied
    embedding's Gather com.microsoft GatherBlockQuantized. Other readers keep their QDQ."""
    rows, d = q.shape
    blocks = n_blocks(d, block)
    module = name.rsplit(".", 1)[0]  # node names as the exporter's: /wte/..., /h.0.attn.qkv/...
    made = {}

    def storage():
        if not made:
            made["packed"] = _initializer(graph, f"{name}_packed", pack_blocks(q, bits, block).numpy())
            made["scales"] = _initializer(graph, f"{name}_packed_scale", scale.numpy())
        return made["packed"], made["scales"]

    quantized = [ir.AttrInt64("bits", bits), ir.AttrInt64("block_size", block)]

    def replace(node: ir.Node, new_nodes: list):
        graph.insert_before(node, new_nodes)
        old, new = node.outputs[0], new_nodes[-1].outputs[0]
        new.shape, new.type = old.shape, old.type
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        new.name = old.name

    def matmul(node: ir.Node):
        graph.opset_imports.setdefault(DOMAIN, OP_VERSION)
        replace(node, [ir.Node(DOMAIN, QMATMUL_OP_TYPE, [node.inputs[0], *storage()], name=node.name,
                               attributes=[ir.AttrInt64("K", d), ir.AttrInt64("N", rows), *quantized])])

    weight, transposed = graph.initializers.get(name), graph.initializers.get(f"{name}.T")
    for node, index in list(weight.uses()) if weight is not None else ():
        if node.op_type == "Gather" and index == 0 and node.attributes.get_int("axis", 0) == 0:
            packed, scales = storage()
            shape = _initializer(graph, f"{name}_packed_rows", np.array([rows, packed.shape[1] * packed.shape[2]]))
            flat = ir.Node("", "Reshape", [packed, shape], name=f"/{module}/Reshape")
            gather = ir.Node(MS_DOMAIN, "GatherBlockQuantized", [flat.outputs[0], node.inputs[1], scales],
                             name=f"/{module}/GatherBlockQuantized",
                             attributes=[ir.AttrInt64("gather_axis", 0), ir.AttrInt64("quantize_axis", 1), *quantized])
            graph.opset_imports.setdefault(MS_DOMAIN, 1)
            new_nodes = [flat, gather]
            if blocks * block != d:  # the padding columns
                ends = _initializer(graph, f"{name}_columns", np.array([d]))
                starts = _initializer(graph, f"{name}_column_0", np.array([0]))
                axes = _initializer(graph, f"{name}_last_axis", np.array([-1]))
                new_nodes.append(ir.Node("", "Slice", [gather.outputs[0], starts, ends, axes], name=f"/{module}/Slice"))
            replace(node, new_nodes)
        elif node.op_type == "Transpose" and all(use.op_type == "MatMul" and i == 1 for use, i in node.outputs[0].uses()):
            for use, _ in list(node.outputs[0].uses()):
                matmul(use)
            graph.remove(node, safe=True)
    for node, index in list(transposed.uses()) if transposed is not None else ():
        if node.op_type == "MatMul" and index == 1:
            matmul(node)
