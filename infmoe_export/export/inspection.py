"""What an ONNX file holds, against what an infmoe-export model should hold, and the repair of
what the ecosystem's tools break (docs/guide/interop.md):

- metadata dropped (graph-surgeon round trips, some converters): recovered from config.json of
  an exported folder, written back by repair;
- the fallback function dropped while the metadata still claims it (a model saved by an
  onnxruntime session that had the kernel): added back by repair;
- the custom op inlined away (tools that open an onnxruntime session without the kernel:
  quant_pre_process, the transformers optimizer at level >= 1): it still runs, in standard ops;
  the fix is to post-process without the session step (said, not repaired);
- graph hygiene: initializers without a parameter name, per-node metadata, graph outputs that
  other nodes consume.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Union

import onnx
import onnx_ir as ir

from ..contract import (DOMAIN, MOE_OP_TYPES, MS_DOMAIN, OP_TYPE, DecoderIO, custom_op_types, folder_metadata,
                        holds_functions, load_graph, moe_op_types)
from ..quant import Q_OP_TYPE
from ..errors import InfMoEError
from .exporter import save_model
from .function import ir_functions


@dataclass
class Inspection:
    path: Path
    size_bytes: int
    opsets: Dict[str, int]
    metadata: Dict[str, str]
    metadata_source: str                 # "model", "config.json" (recovered) or "missing"
    io: Optional[DecoderIO]
    inputs: Dict[str, list]
    outputs: Dict[str, list]
    op_nodes: int                        # expert op nodes: ContinuousSliceFFN (a conventional MoE: MoE / QMoE)
    has_function: bool                   # the file holds the function
    claims_function: bool                # the metadata says it does
    unnamed_weights: List[str]           # initializers of > 1 element not named after a parameter
    node_metadata_bytes: int
    consumed_outputs: List[str]
    problems: List[str] = field(default_factory=list)   # each with its fix

    def polygraphy_command(self) -> Optional[str]:
        """`polygraphy run` with input shapes that agree (its default makes every dynamic dim 1,
        so the mask and the cache disagree): batch 1, 4 new tokens, an empty cache."""
        if self.io is None:
            return None
        c = self.io.config
        shapes = ["input_ids:[1,4]", "attention_mask:[1,4]"]
        shapes += [f"{name}:[1,{c.n_head},0,{c.head_dim}]" for name in self.io.past_names]
        if self.io.noise == "sampled":
            shapes.append(f"expert_noise:[1,4,{self.io.k}]")
        return f"polygraphy run {self.path} --onnxrt --input-shapes " + " ".join(shapes)

    def as_dict(self) -> dict:
        return {"path": str(self.path), "size_bytes": self.size_bytes, "opsets": self.opsets,
                "metadata_source": self.metadata_source, "metadata": self.metadata,
                "k": self.io.k if self.io else None, "noise": self.io.noise if self.io else None,
                "past": self.io.past if self.io else None, "dtype": self.io.dtype if self.io else None,
                "inputs": self.inputs, "outputs": self.outputs, "custom_op_nodes": self.op_nodes,
                "has_function": self.has_function, "claims_function": self.claims_function,
                "unnamed_weights": self.unnamed_weights, "node_metadata_bytes": self.node_metadata_bytes,
                "consumed_outputs": self.consumed_outputs, "polygraphy": self.polygraphy_command(),
                "problems": self.problems}


def model_path(path: Union[str, os.PathLike]) -> Path:
    """A .onnx file, or an exported folder (its model.onnx)."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.onnx"
    if not path.is_file():
        raise InfMoEError(f"ONNX model {path} does not exist or is not a file")
    return path


def _dims(value: onnx.ValueInfoProto) -> list:
    shape = value.type.tensor_type.shape
    return [d.dim_param or (d.dim_value if d.HasField("dim_value") else "?") for d in shape.dim]


def inspect_model(path: Union[str, os.PathLike], *, kernel_available: bool = False) -> Inspection:
    path = model_path(path)
    proto = load_graph(path)
    graph = proto.graph
    metadata = {p.key: p.value for p in proto.metadata_props}
    source = "model" if "infmoe.config" in metadata else "missing"
    if source == "missing":
        kept = folder_metadata(path)
        if kept is not None:
            metadata, source = kept, "config.json"
    decoder_io = None
    if source != "missing":
        decoder_io = DecoderIO.from_metadata(metadata)
    expert_ops = {(MS_DOMAIN, t) for t in MOE_OP_TYPES} if decoder_io is not None and decoder_io.is_moe else \
        {(DOMAIN, OP_TYPE), (DOMAIN, Q_OP_TYPE)}
    op_nodes = sum(1 for node in graph.node if (node.domain, node.op_type) in expert_ops)
    has_function = holds_functions(graph.node, proto.functions)
    claims = metadata.get("infmoe.has_function") == "1"
    # Weights, not shapes and axes: int64 constants (a Reshape's target, a Pad's pads) keep the exporter's names.
    unnamed = [t.name for t in graph.initializer if (t.name.startswith("val_") or t.name.startswith("onnx::"))
               and _numel(t) > 1 and t.data_type != onnx.TensorProto.INT64]
    node_meta = sum(len(p.key) + len(p.value) for node in graph.node for p in node.metadata_props)
    produced_outputs = {o.name for o in graph.output}
    consumed = sorted({name for node in graph.node for name in node.input if name in produced_outputs})
    size = path.stat().st_size + sum(p.stat().st_size for p in path.parent.glob(path.name + ".data"))
    found = Inspection(path, size, {o.domain or "ai.onnx": o.version for o in proto.opset_import}, metadata,
                       source, decoder_io, {v.name: _dims(v) for v in graph.input}, {v.name: _dims(v) for v in graph.output},
                       op_nodes, has_function, claims, unnamed, node_meta, consumed)
    fix = f"infmoe-export inspect {path} --repair FIXED.onnx"
    if source == "missing":
        found.problems.append("no infmoe metadata and no exported folder's config.json beside it: infmoe-export's "
                              "runners cannot read it; re-export it (`infmoe-export onnx --out DIR`) or put it back "
                              "in its exported folder")
    elif source == "config.json":
        found.problems.append(f"the model's metadata was dropped (e.g. by a graph-surgeon round trip); recovered "
                              f"from config.json beside it. Write it back into the file: {fix}")
    if _function_op_types(graph.node) and not has_function:
        if claims:
            found.problems.append("the metadata says the model has the fallback function but the file does not "
                                  "(saved by an onnxruntime session that had the kernel?); without the kernel it "
                                  f"fails with 'not a registered function/op'. Add the function back: {fix}")
        elif not kernel_available and custom_op_types(graph.node):  # onnxruntime's MoE runs in any onnxruntime
            found.problems.append("ContinuousSliceFFN without the fallback function: it runs only with the "
                                  "onnxruntime kernel, which is not installed here (docs/guide/onnxruntime.md), "
                                  f"or add the function: {fix}")
    if decoder_io is not None and decoder_io.experts_in_op and op_nodes == 0:
        expert_op = "MoE / QMoE" if decoder_io.is_moe else "ContinuousSliceFFN"
        found.problems.append(f"no {expert_op} node: the op was inlined into standard ops (a tool ran it "
                              "through an onnxruntime session without the kernel: quant_pre_process, the "
                              "transformers optimizer at opt_level >= 1, ORT-format conversion). It runs, slower, "
                              "and neither the kernel nor TensorRT's plugin can take it; post-process the export "
                              "without that step (docs/guide/interop.md)")
    if unnamed:
        found.problems.append(f"{len(unnamed)} weights without a parameter name ({', '.join(unnamed[:3])}, ...): "
                              "re-export with this version")
    if consumed:
        found.problems.append(f"graph outputs consumed inside the graph ({', '.join(consumed[:2])}, ...): fp16 "
                              "converters break on them; re-export with this version")
    return found


def _function_op_types(nodes) -> set:
    """The ops of nodes that carry a fallback function: the infmoe ops, onnxruntime's MoE / QMoE."""
    return custom_op_types(nodes) | moe_op_types(nodes)


def _numel(tensor: onnx.TensorProto) -> int:
    n = 1
    for d in tensor.dims:
        n *= d
    return n


def repair_model(path: Union[str, os.PathLike], out: Union[str, os.PathLike]) -> List[str]:
    """Write path to out with its metadata restored (from the folder's config.json) and the
    fallback function added back where the graph has the op but not the function. Returns what
    was done. Weights go into out (external data beside it above ~2 GiB)."""
    path, out = model_path(path), Path(out)
    found = inspect_model(path)
    if found.metadata_source == "missing":
        raise InfMoEError(f"cannot repair {path}: " + found.problems[0])
    model = ir.load(str(path))
    done = []
    if found.metadata_source == "config.json":
        done.append("restored the metadata from config.json")
    metadata = dict(found.metadata)
    metadata.pop("infmoe.function_dropped", None)
    added = bool(_function_op_types(model.graph) and not found.has_function)
    if added:
        opset = model.opset_imports.get("", 18)
        for function in ir_functions(opset, _function_op_types(model.graph), found.io.kv_cache):
            model.functions[function.identifier()] = function
        model.opset_imports.setdefault(DOMAIN, 1)
        done.append(f"added the fallback function (opset {opset})")
    metadata["infmoe.has_function"] = str(int(found.has_function or added))
    model.metadata_props.update(metadata)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_model(model, out)
    return done or ["nothing to repair: copied"]
