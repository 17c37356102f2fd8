"""The network TensorRT builds: the exported model checked and prepared for the plugin, the
network's creation flags, and the optimization profiles.

Everything here but `parse_network` works without TensorRT.
"""

from typing import Dict, List, Sequence

import onnx

from ...contract import BATCH, DOMAIN, OP_TYPE, OP_VERSION, PAST, SEQUENCE, TOTAL, DecoderIO, ExportedModel
from ...errors import InfMoEError
from ...quant import Q_OP_TYPE

# The ops the plugins implement; the quantized one's packed weights are inputs 2 and 5 (SPEC §6).
PLUGIN_OPS = (OP_TYPE, Q_OP_TYPE)
PACKED_INPUTS = (2, 5)

# The initializer every plugin node's starts are reshaped with (pin_expert_budget).
PINNED_K = "infmoe_trt_pinned_starts_shape"
# starts is [batch, sequence, K] in every exported model (contract.py); Reshape's 0 keeps a dim.
STARTS_LEADING_DIMS = (BATCH, SEQUENCE)


def plugin_nodes(model: onnx.ModelProto, path) -> List[onnx.NodeProto]:
    """The model's ContinuousSliceFFN and QContinuousSliceFFN nodes, refusing a model the parser
    would not map to the plugins: a local function named like an op makes the parser expand it
    instead of using the plugin, and the node needs the attributes the plugin lookup and the
    plugin itself read."""
    for function in model.functions:
        if function.domain == DOMAIN and function.name in PLUGIN_OPS:
            raise InfMoEError(f"{path} carries the fallback function {DOMAIN}::{function.name}; TensorRT would expand "
                              "it instead of using the plugin: export it with `infmoe-export onnx --no-function`")
    nodes = []
    for node in model.graph.node:
        if node.domain != DOMAIN:
            continue
        if node.op_type not in PLUGIN_OPS:
            raise InfMoEError(f"{path}: node {node.name!r} has unknown op {node.domain}::{node.op_type}")
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        wanted = {"plugin_namespace": DOMAIN.encode(), "plugin_version": str(OP_VERSION).encode(),
                  "activation": b"gelu_tanh"}
        for name, value in wanted.items():
            if attrs.get(name) != value:
                raise InfMoEError(f"{path}: node {node.name!r} needs attribute {name}={value.decode()!r}, "
                                  f"got {attrs.get(name)!r}")
        integers = ("slice_width", "bits", "block_size") if node.op_type == Q_OP_TYPE else ("slice_width",)
        for name in integers:  # their values are the plugin's to check (descriptors)
            if not isinstance(attrs.get(name), int):
                raise InfMoEError(f"{path}: node {node.name!r} needs an integer attribute {name}")
        nodes.append(node)
    return nodes


def retype_packed_weights(model: onnx.ModelProto, nodes: Sequence[onnx.NodeProto], path) -> int:
    """Hand every QContinuousSliceFFN node its packed weights as int8 initializers holding the same
    bytes: TensorRT has no uint8 constants (INetworkDefinition::addConstant refuses kUINT8, and
    older ONNX parsers widen uint8 weights to int32), and the kernel reads the bytes unsigned
    whatever their type. Each int8 tensor is a copy of the uint8 one's proto with the type
    changed (external data: the same file range, nothing read); a uint8 original nobody else
    uses is dropped. Returns the number of tensors retyped."""
    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    retyped = {}
    for node in nodes:
        if node.op_type != Q_OP_TYPE:
            continue
        for index in PACKED_INPUTS:
            name = node.input[index]
            tensor = initializers.get(name)
            if tensor is None:
                raise InfMoEError(f"{path}: node {node.name!r} input {index} ({name!r}) must be an initializer: "
                                  "the plugin compiles the kernel for the weights' shapes")
            if tensor.data_type != onnx.TensorProto.UINT8:
                raise InfMoEError(f"{path}: node {node.name!r} input {index} ({name!r}) must be uint8 (SPEC §6), "
                                  f"got {onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)}")
            if name not in retyped:
                copy = onnx.TensorProto()
                copy.CopyFrom(tensor)
                copy.name, copy.data_type = f"{name}_int8", onnx.TensorProto.INT8
                retyped[name] = copy
            node.input[index] = retyped[name].name
    used = {name for node in model.graph.node for name in node.input} | {o.name for o in model.graph.output}
    kept = [t for t in model.graph.initializer if t.name not in retyped or t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + list(retyped.values()))
    return len(retyped)


def pin_expert_budget(model: onnx.ModelProto, k: int, path) -> int:
    """Give every plugin node starts of static shape [..., K]: starts goes through a Reshape to
    [0, 0, K] (0 keeps batch and sequence), so K is a build-time constant for the AOT kernel
    even where TensorRT would not fold the quantile noise's Expand. Returns the number of
    plugin nodes (at least one)."""
    nodes = plugin_nodes(model, path)
    if not nodes:
        raise InfMoEError(f"{path} has no {DOMAIN}::{OP_TYPE} or {Q_OP_TYPE} node: a TensorRT engine here is built "
                          "for the plugin; export a model with the op (`infmoe-export onnx --no-function`)")
    shape = [0] * len(STARTS_LEADING_DIMS) + [k]
    model.graph.initializer.append(onnx.helper.make_tensor(PINNED_K, onnx.TensorProto.INT64, [len(shape)], shape))
    graph = list(model.graph.node)
    for node in nodes:
        pinned = f"{node.input[1]}_k{k}_{node.name}"
        reshape = onnx.helper.make_node("Reshape", [node.input[1], PINNED_K], [pinned], name=f"{node.name}_pin_k")
        graph.insert(graph.index(node), reshape)
        node.input[1] = pinned
    del model.graph.node[:]
    model.graph.node.extend(graph)
    return len(nodes)


def plugin_model(exported: ExportedModel) -> onnx.ModelProto:
    """The exported model as TensorRT's parser gets it: checked, K pinned, packed weights int8;
    weights stay where they are (external data is read by the parser next to exported.path)."""
    if exported.io.target == "onnxruntime":
        raise InfMoEError(f"{exported.path} was exported for onnxruntime (com.microsoft ops, which TensorRT's parser "
                          "does not know): export it with `infmoe-export onnx --target tensorrt --no-function`")
    model = onnx.load(str(exported.path), load_external_data=False)
    retype_packed_weights(model, plugin_nodes(model, exported.path), exported.path)
    pin_expert_budget(model, exported.k, exported.path)
    return model


def creation_flags(trt, jit: bool) -> int:
    """Network creation flags: strongly typed (every tensor keeps the type the model gives it,
    so an fp16 export runs its FFN in float16 and its router, LayerNorms and attention in
    float32), and which implementation of the plugin to use."""
    flags = trt.NetworkDefinitionCreationFlag
    chosen = [flags.PREFER_JIT_PYTHON_PLUGINS if jit else flags.PREFER_AOT_PYTHON_PLUGINS]
    if hasattr(flags, "STRONGLY_TYPED"):  # always on, and deprecated, from TensorRT 11
        chosen.append(flags.STRONGLY_TYPED)
    mask = 0
    for flag in chosen:
        mask |= 1 << int(flag)
    return mask


def parse_network(exported: ExportedModel, jit: bool):
    """(builder, network, parser) for the exported model (needs TensorRT). Polygraphy's
    NetworkFromOnnxPath cannot set the plugin preference flags, so the network is made here."""
    import tensorrt as trt
    from polygraphy.backend.trt import util as trt_util

    model = plugin_model(exported)
    logger = trt_util.get_trt_logger()
    builder = trt.Builder(logger)
    network = builder.create_network(creation_flags(trt, jit))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(model.SerializeToString(), str(exported.path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        first = errors[0].splitlines()[0] if errors else "unknown error"
        raise InfMoEError(f"TensorRT could not parse {exported.path}: {first}")
    return builder, network, parser


# ---------------------------------------------------------------------------------------------
# Optimization profiles


def profile_shapes(decoder_io: DecoderIO, max_batch: int, max_seq: int) -> List[dict]:
    """The prefill and decode profiles: {name, shapes: {input: {min, opt, max}}}.

    prefill: sequence 1..max_seq with an empty cache; decode: one new token after a cache of
    0..max_seq - 1 tokens (so past + new <= max_seq). Batch 1..max_batch; opt is batch 1, the
    latency case, and half the longest sequence.
    """
    if max_batch < 1:
        raise InfMoEError(f"--max-batch must be at least 1, got {max_batch}")
    if not 1 <= max_seq <= decoder_io.config.n_positions:
        raise InfMoEError(f"--max-seq must be in [1, {decoder_io.config.n_positions}] (the model's n_positions), "
                          f"got {max_seq}")
    half = max(1, max_seq // 2)
    ranges = {"prefill": {BATCH: (1, 1, max_batch), SEQUENCE: (1, half, max_seq), PAST: (0, 0, 0),
                          TOTAL: (1, half, max_seq)},
              "decode": {BATCH: (1, 1, max_batch), SEQUENCE: (1, 1, 1), PAST: (0, half - 1, max_seq - 1),
                         TOTAL: (1, half, max_seq)}}
    if not decoder_io.past:  # no cache inputs: one profile, attention_mask spans the sequence only
        ranges = {"prefill": ranges["prefill"]}
    shapes = decoder_io.shapes()
    profiles = []
    for name, dims in ranges.items():
        inputs = {}
        for tensor in decoder_io.input_names:
            bounds = [dims[d] if isinstance(d, str) else (d, d, d) for d in shapes[tensor]]
            inputs[tensor] = {key: [b[i] for b in bounds] for i, key in enumerate(("min", "opt", "max"))}
        profiles.append({"name": name, "shapes": inputs})
    return profiles


def pick_profile(profiles: List[dict], shapes: Dict[str, Sequence[int]]) -> int:
    """Index of the first profile whose ranges hold every input shape."""
    names = set(profiles[0]["shapes"])
    if set(shapes) != names:
        raise InfMoEError(f"the engine's inputs are {sorted(names)}, got {sorted(shapes)}")
    for index, profile in enumerate(profiles):
        if all(len(shapes[name]) == len(r["min"])
               and all(lo <= s <= hi for lo, s, hi in zip(r["min"], shapes[name], r["max"]))
               for name, r in profile["shapes"].items()):
            return index
    ranges = "; ".join(f"{p['name']}: " + ", ".join(f"{n} {r['min']}..{r['max']}" for n, r in p["shapes"].items())
                       for p in profiles)
    given = ", ".join(f"{n} {list(s)}" for n, s in shapes.items())
    raise InfMoEError(f"input shapes ({given}) fit no optimization profile of the engine ({ranges})")
