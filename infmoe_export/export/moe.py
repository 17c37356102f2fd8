"""A conventional top-k MoE (model_type moe-gpt2, docs/reference/spec.md §7) exported the usual
way on CPU: each layer's experts are one onnxruntime `com.microsoft` MoE node (fp32) or QMoE node
(int8 / int4, block-wise), with a standard-op fallback function of the same domain and name
(function.py), so that onnxruntime runs its kernel and any other runtime the function.

Everything else is the ∞-MoE export's (exporter.py): the same inputs, outputs, cache, metadata,
targets (portable; onnxruntime's fused attention) and quantized attention and LM head. Per layer:

    logits = ln_2 @ router_weight^T                     [..., E], a MatMul
    y      = MoE(ln_2, logits as [N, E], fc1_experts_weights, fc1_experts_bias,
                 fc2_experts_weights, fc2_experts_bias; k = top_k, activation_type "gelu",
                 normalize_routing_weights = 1 for router_softmax "selected", 0 for "all")

onnxruntime's MoE takes the softmax over all E logits and, with normalize_routing_weights = 1,
divides the k picked by their sum (spec §7's "selected"; 0 keeps them: "all"). Its QMoE (1.32, CPU)
always divides them (without its router_weights input): at int8 / int4 "all" is that output times
the sum of the k picked probabilities, a Softmax, TopK, ReduceSum and Mul beside the node (exact:
the weights scale every expert's output, fc2 bias included).

The checkpoint's w_in, b_in, w_out, b_out are the op's fc1 / fc2 weights and biases as they are
(spec §7's layout), but in reverse expert order, and so are the router's rows: onnxruntime's CPU
kernel gives equal logits to the highest expert index, the reference to the lowest, and reversed
the one is the other (graph expert j is checkpoint expert E - 1 - j). The fallback function
follows the kernel, so it keeps the rule too.

QMoE's storage is SPEC §6's (quant.py): fc1 [E, h, D] blocked along D, fc2 [E, D, h] blocked along
h, both along each expert matrix's input dimension, float32 scales, no zero points; accuracy_level
0 (float activations for int4 experts; int8 experts take int8 activations unless a session asks
otherwise, see runtimes/ort_moe.py). QMoE's schema asks D and h to be multiples of the block size:
where one is not, D gets zero columns (the layer's input padded, its output cut back) and h zero
hidden units (each act(0) meets a zero fc2 column), which changes no block's scale and no output
(SPEC §6 pads the last block with zeros too).
"""

from typing import Optional

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper
from torch import nn

from ..contract import MS_DOMAIN
from ..quant import QuantizedWeight

# onnxruntime's MoE / QMoE inputs after `input` and `router_probs`, in their order.
FLOAT_INPUTS = ("fc1_experts_weights", "fc1_experts_bias", "fc2_experts_weights", "fc2_experts_bias")
QUANTIZED_INPUTS = ("fc1_experts_weights", "fc1_scales", "fc1_experts_bias", "fc2_experts_weights", "fc2_scales",
                    "fc2_experts_bias")


def moe_attributes(k: int, normalize_routing_weights: int, bits: Optional[int] = None,
                   block_size: Optional[int] = None, accuracy_level: int = 0) -> dict:
    """The attributes of an MoE node (bits None) or a block-wise QMoE node: top k of the router
    logits, GPT-2's tanh GELU (onnxruntime's CPU "gelu"), the routing weights normalized over the
    k (1) or the softmax over all E as it is (0); accuracy_level 4 gives int4 experts int8
    activations."""
    attributes = dict(k=k, activation_type="gelu", normalize_routing_weights=int(normalize_routing_weights))
    if bits is not None:
        attributes.update(expert_weight_bits=bits, block_size=block_size, accuracy_level=accuracy_level)
    return attributes


class ExportTopKMoE(nn.Module):
    """A TopKMoE layer (model.py) as it is exported: its router a MatMul, its experts one MoE or
    QMoE node (module doc). forward(x, eps) returns (y, the experts each token runs [..., top_k],
    best first, checkpoint numbering), as the layer does; eps is unused."""

    def __init__(self, moe: nn.Module, bits: Optional[int], block_size: int):
        super().__init__()
        experts, hidden, d_model = moe.w_in.shape
        self.top_k, self.d_model = moe.top_k, d_model
        normalized = moe.router_softmax == "selected"
        # QMoE normalizes whatever the attribute says: "all" is scaled back in forward.
        self.scale_by_picked = bool(bits) and not normalized
        self.attributes = moe_attributes(moe.top_k, normalized or bool(bits), bits, block_size)
        self.op_type, self.input_names = ("QMoE", QUANTIZED_INPUTS) if bits else ("MoE", FLOAT_INPUTS)
        reverse = torch.arange(experts - 1, -1, -1)
        self.pad_d = -d_model % block_size if bits else 0
        pad_h = -hidden % block_size if bits else 0
        w_in = F.pad(moe.w_in.detach()[reverse], (0, self.pad_d, 0, pad_h))      # [E, h', D']
        w_out = F.pad(moe.w_out.detach()[reverse], (0, pad_h, 0, self.pad_d))    # [E, D', h']
        tensors = {"fc1_experts_bias": F.pad(moe.b_in.detach()[reverse], (0, pad_h)),
                   "fc2_experts_bias": F.pad(moe.b_out.detach()[reverse], (0, self.pad_d))}
        if bits:
            for name, w in (("fc1", w_in), ("fc2", w_out)):
                q = QuantizedWeight.of(w.reshape(-1, w.shape[-1]), bits, block_size)
                tensors[f"{name}_experts_weights"] = q.packed.reshape(*w.shape[:2], -1)
                tensors[f"{name}_scales"] = q.scale.reshape(*w.shape[:2], -1)
        else:
            tensors.update(fc1_experts_weights=w_in, fc2_experts_weights=w_out)
        for name in self.input_names:
            self.register_buffer(name, tensors[name].contiguous())
        # A parameter, so that the exporter names its transposed copy after it (exporter._name_initializers).
        self.router_weight = nn.Parameter(moe.router.weight.detach()[reverse].clone(), requires_grad=False)

    def forward(self, x, eps=None):
        logits = F.linear(x, self.router_weight)                              # graph expert order
        h = F.pad(x, (0, self.pad_d)) if self.pad_d else x
        inputs = (h, logits.reshape(-1, logits.shape[-1]), *(getattr(self, name) for name in self.input_names))
        y = torch.onnx.ops.symbolic(f"{MS_DOMAIN}::{self.op_type}", inputs, self.attributes, dtype=x.dtype,
                                    shape=h.shape, version=1)
        if self.pad_d:
            y = y[..., :self.d_model]
        if self.scale_by_picked:
            y = y * torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1).values.sum(-1, keepdim=True)
        # The experts for the expert_starts outputs: ONNX TopK gives equal values to the lowest
        # index, the reference's rule, on the logits in checkpoint order.
        experts = torch.topk(logits.flip(-1), self.top_k, dim=-1).indices
        return y, experts


def experts_outputs(model: onnx.ModelProto) -> list:
    """Append to model (a graph with MoE / QMoE nodes, in layer order) the nodes computing each
    layer's experts [..., top_k] as ExportTopKMoE does, from the node's router logits, as graph
    outputs; returns their names. validate and the level-2 scoring read them from a copy of a
    file without the expert_starts outputs."""
    graph, names = model.graph, []
    nodes = [n for n in graph.node if n.domain == MS_DOMAIN and n.op_type in ("MoE", "QMoE")]
    for layer, node in enumerate(nodes):
        k = next(a.i for a in node.attribute if a.name == "k")
        prefix, name = f"/experts.{layer}", f"experts.{layer}"
        constants = {"last": [-1], "before_first": [-2 ** 63], "k": [k]}
        graph.initializer.extend(numpy_helper.from_array(np.asarray(v, np.int64), f"{prefix}/{c}")
                                 for c, v in constants.items())
        graph.node.extend([
            helper.make_node("Slice", [node.input[1], f"{prefix}/last", f"{prefix}/before_first", f"{prefix}/last",
                                       f"{prefix}/last"], [f"{prefix}/logits"], name=f"{prefix}/Slice"),
            helper.make_node("TopK", [f"{prefix}/logits", f"{prefix}/k"], [f"{prefix}/values", f"{prefix}/flat"],
                             axis=-1, name=f"{prefix}/TopK"),
            helper.make_node("Shape", [node.input[0]], [f"{prefix}/tokens"], end=-1, name=f"{prefix}/Shape"),
            helper.make_node("Concat", [f"{prefix}/tokens", f"{prefix}/k"], [f"{prefix}/shape"], axis=0,
                             name=f"{prefix}/Concat"),
            helper.make_node("Reshape", [f"{prefix}/flat", f"{prefix}/shape"], [name], name=f"{prefix}/Reshape")])
        graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.INT64, None))
        names.append(name)
    return names
