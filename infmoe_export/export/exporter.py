"""Export an InfMoEGPT to ONNX with one `infmoe::ContinuousSliceFFN` node per layer (SPEC §4), or a
conventional MoE (MoEGPT) with one onnxruntime MoE / QMoE node per layer (moe.py).

The torch.onnx dynamo exporter traces the reference model itself (model.py), with one change:
each layer's expert part becomes `torch.onnx.ops.symbolic("infmoe::ContinuousSliceFFN")`, so
the router, window_starts and everything else are exported from the very code that defines
them (same op order: sigmoid, * (H - r + 1), floor, min(H - r), cast — floors agree).
Afterwards the fallback function, the Optimum-style dim names and the metadata are added and
the file is written atomically.
"""

import contextlib
import copy
import logging
import os
import signal
import tempfile
import threading
import warnings
from pathlib import Path
from typing import List, Optional, Sequence, Union

import numpy as np
import onnx
import onnx_ir as ir
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

from ..contract import (BATCH, DEFAULT_TARGET, DOMAIN, LOGITS_SEQUENCE, LOGITS_TO_KEEP, OP_TYPE, OP_VERSION, PAST,
                        SEQUENCE, DecoderIO, ExportedModel, custom_op_types, moe_op_types)
from ..errors import InfMoEError
from ..files import output_file
from ..model import InfMoEGPT, gelu_tanh, quantile_noise
from ..quant import DEFAULT_BLOCK_SIZE, Q_OP_TYPE, QuantizedWeight
from .function import ir_functions
from .moe import ExportTopKMoE
from .ort_target import OrtDecoder, finish_ort_graph
from .quantized import insert_dequantize, resolve_opset

# torch.onnx's dynamo exporter emits opset 18 and up (its op library is written for 18); the
# newest is the newest the installed onnx knows (28 with onnx 1.23; 18-28 exported and
# validated in onnxruntime 1.32). Both bounds are checked before any work.
MIN_OPSET, MAX_OPSET, DEFAULT_OPSET = 18, onnx.defs.onnx_opset_version(), 18
# protobuf cannot hold a model over 2 GiB: above this, weights go to "<name>.data".
EXTERNAL_DATA_BYTES = 2**31 - 2**26


class _ExportMoE(nn.Module):
    """An InfMoE layer whose expert part is the custom op (the dense case: plain MatMuls).

    dtype is the expert part's precision. The router and everything upstream of it stay fp32
    even in an fp16 export: a start resolves 1 / (H - r + 1) of sigmoid's range (1/4609 at
    GPT-2 Small size), and fp16 activations upstream move it by whole windows (docs/guide/export.md).

    With bits (int8/int4 where DecoderIO.experts_in_op) the expert matrices become the uint8
    storage and float32 scales of `infmoe::QContinuousSliceFFN` (SPEC §6); biases stay float32.
    A dense model takes that op too then: its K windows all cover the whole of H."""

    def __init__(self, moe: nn.Module, dtype: torch.dtype, bits: Optional[int] = None,
                 block_size: int = DEFAULT_BLOCK_SIZE):
        super().__init__()
        self.moe, self.dtype, self.bits, self.block_size = moe, dtype, bits, block_size
        for name in ("w_in", "b_in", "w_out", "b_out"):
            getattr(moe, name).data = getattr(moe, name).data.to(dtype)
        for name in ("w_in", "w_out") if bits else ():
            packed, scale = QuantizedWeight.of(getattr(moe, name), bits, block_size)
            self.register_buffer(f"{name}_q", packed)
            self.register_buffer(f"{name}_scale", scale)
            delattr(moe, name)

    def forward(self, x, eps):
        m = self.moe
        starts = m.router.window_starts(x, eps, m.ffn_hidden, m.slice_width)
        h = x.to(self.dtype)
        if m.slice_width == m.ffn_hidden and not self.bits:  # every window is the whole FFN: an ordinary MLP
            y = gelu_tanh(F.linear(h, m.w_in, m.b_in)) @ m.w_out + m.b_out
        else:
            attributes = dict(slice_width=m.slice_width, activation="gelu_tanh", plugin_namespace=DOMAIN,
                              plugin_version=str(OP_VERSION))
            if self.bits:
                attributes.update(bits=self.bits, block_size=self.block_size)
                op_type, inputs = Q_OP_TYPE, (h, starts, self.w_in_q, self.w_in_scale, m.b_in, self.w_out_q,
                                              self.w_out_scale, m.b_out)
            else:
                op_type, inputs = OP_TYPE, (h, starts, m.w_in, m.b_in, m.w_out, m.b_out)
            y = torch.onnx.ops.symbolic(f"{DOMAIN}::{op_type}", inputs, attributes, dtype=h.dtype, shape=h.shape,
                                        version=OP_VERSION)
        return y.to(x.dtype), starts


class _ExportModule(nn.Module):
    """The reference model with flat, ONNX-named inputs and outputs (see decoder_io.py)."""

    def __init__(self, model: InfMoEGPT, decoder_io: DecoderIO):
        super().__init__()
        self.io = decoder_io
        self.model = copy.deepcopy(model).eval()
        dtype = torch.float16 if decoder_io.dtype == "fp16" else torch.float32
        # Otherwise a dense model's experts are plain MatMuls: quantized by DequantizeLinear (quantized.py).
        bits = decoder_io.bits if decoder_io.experts_in_op else None
        for block in self.model.h:
            block.moe = ExportTopKMoE(block.moe, bits, decoder_io.block_size) if decoder_io.is_moe else \
                _ExportMoE(block.moe, dtype, bits, decoder_io.block_size)
        if decoder_io.noise == "quantile" and not decoder_io.is_moe:  # baked in as a constant
            self.register_buffer("quantile_eps", quantile_noise(decoder_io.k), persistent=False)

    def forward(self, *inputs):
        named = dict(zip(self.io.input_names, inputs))
        input_ids = named["input_ids"]
        batch, sequence = input_ids.shape
        past = None
        if self.io.past:
            flat = [named[name] for name in self.io.past_names]
            past = tuple(zip(flat[0::2], flat[1::2]))
        eps = named.get("expert_noise")
        if eps is None and not self.io.is_moe:  # a conventional MoE has no noise
            eps = self.quantile_eps.expand(batch, sequence, self.io.k)
        output = self.model(input_ids, named["attention_mask"], past, k=self.io.k, expert_noise=eps,
                            return_starts=self.io.with_starts)
        return tuple(self.io.flatten(output).values())


def check_opset(opset) -> int:
    if not isinstance(opset, int) or isinstance(opset, bool) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise InfMoEError(f"opset {opset} is not supported: ContinuousSliceFFN and its fallback function "
                          f"are exported for opsets {MIN_OPSET}..{MAX_OPSET}")
    return opset


@contextlib.contextmanager
def _quiet():
    """torch.onnx logs progress and warnings meant for its developers; keep the CLI quiet."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _interrupts_held():
    """A Ctrl-C during the body is taken when it returns: torch.onnx's export calls back into
    Python from native code that a KeyboardInterrupt raised there aborts the whole process with
    (std::terminate), so no cleanup runs. Off the main thread (no signals there) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held and callable(previous):
            previous(signal.SIGINT, None)
        elif held and previous == signal.SIG_DFL:
            raise KeyboardInterrupt


def _rename_dims(graph: ir.Graph, decoder_io: DecoderIO):
    """Give every dynamic dim its Optimum-style name: torch.export calls some 's53', and
    writes sums in either order ('sequence + past_sequence')."""
    wanted = decoder_io.shapes()
    wanted["logits"] = [BATCH, SEQUENCE, decoder_io.config.vocab_size]  # as traced, before _keep_logits
    mapping = {}
    for value in [*graph.inputs, *graph.outputs]:
        for dim, name in zip(value.shape, wanted[value.name]):
            if isinstance(dim, ir.SymbolicDim) and isinstance(name, str) and dim.value != name:
                mapping[dim.value] = name
    if not mapping:
        return
    values = [*graph.inputs, *graph.outputs, *(out for node in graph.all_nodes() for out in node.outputs)]
    for value in values:
        if value.shape is not None and any(isinstance(d, ir.SymbolicDim) and d.value in mapping for d in value.shape):
            value.shape = ir.Shape([mapping.get(d.value, d.value) if isinstance(d, ir.SymbolicDim) else d
                                    for d in value.shape])


# ---------------------------------------------------------------------------------------------
# Graph hygiene: what the ecosystem's tools (Netron, quantizers, symbolic shape inference, fp16
# converters, graph surgeon) need from the file, beyond what onnxruntime needs.


def _checkpoint_name(module_path: str) -> str:
    """'model.h.0.moe.moe.w_in' (a path in _ExportModule) -> 'h.0.moe.w_in' (the checkpoint's key)."""
    name = module_path[len("model."):] if module_path.startswith("model.") else module_path
    return name.replace(".moe.moe.", ".moe.")


def _name_initializers(graph: ir.Graph, module: nn.Module):
    """Every weight named after its checkpoint tensor: 'h.0.moe.w_in' as is, 'h.0.attn.qkv.weight.T'
    for the transposed copy that torch.onnx folds a Linear's weight into (it would be 'val_50').
    Small constants (shapes, axes, the quantile noise) keep their names."""
    params = {_checkpoint_name(name): p.detach() for name, p in module.named_parameters()}
    by_shape = {}
    for name, tensor in params.items():
        by_shape.setdefault(tuple(tensor.shape), []).append((name, tensor))
        if tensor.dim() == 2:
            by_shape.setdefault(tuple(tensor.shape[::-1]), []).append((name + ".T", tensor.T))
    taken = set(graph.initializers)
    for old, value in list(graph.initializers.items()):
        wanted = _checkpoint_name(old) if old.startswith("model.") else None
        if wanted is None and value.const_value is not None and value.const_value.size > 1:
            array = value.const_value.numpy()
            for name, tensor in by_shape.get(array.shape, []):
                if array.dtype.kind == "f" and torch.equal(torch.from_numpy(array.copy()).to(tensor.dtype), tensor):
                    wanted = name
                    break
        if wanted and wanted != old and wanted not in taken:
            graph.initializers.pop(old)
            value.name = wanted
            graph.register_initializer(value)
            taken.add(wanted)


def _name_nodes(graph: ir.Graph):
    """Nodes named by module path and op, as Hugging Face exports are ('/h.0/attn/qkv/MatMul'),
    from torch.onnx's name scopes; then every per-node metadata entry (stack traces, FX node
    text, the exporting machine's paths: ~220 kB on the bundled model) is dropped."""
    used = set()
    for node in graph.all_nodes():
        scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
        parts = []
        if scopes:
            try:
                paths = [_checkpoint_name(p) for p in eval(scopes, {"__builtins__": {}}) if isinstance(p, str)]
            except Exception:  # a format we do not know: keep the exporter's name
                paths = []
            modules = [p for p in paths[:-1] if p and p != "model" and not p.startswith("_")]  # last: the op
            previous = ""
            for path in modules:
                relative = path[len(previous) + 1:] if previous and path.startswith(previous + ".") else path
                if path != previous:
                    parts.append(relative)
                previous = path
        if parts or scopes:
            base = "/" + "/".join(parts + [node.op_type])
            name, n = base, 0
            while name in used:
                n += 1
                name = f"{base}_{n}"
            node.name = name
        used.add(node.name)
        node.metadata_props.clear()
        node.doc_string = None
    for value in [*graph.inputs, *graph.outputs, *graph.initializers.values(),
                  *(out for node in graph.all_nodes() for out in node.outputs)]:
        value.metadata_props.clear()
        value.doc_string = None
    graph.metadata_props.clear()
    graph.doc_string = None


def _outputs_not_consumed(graph: ir.Graph):
    """A graph output that other nodes also read (present.i.* feeds the attention MatMul) breaks
    tools that rewrite outputs (onnxconverter_common's float16 inserts a Cast there): give each
    such output its own Identity, so a graph output is produced and never consumed."""
    for index, value in enumerate(list(graph.outputs)):
        if not value.uses() or value.producer() is None:
            continue
        name = value.name
        value.name = f"{name}.internal"
        identity = ir.Node("", "Identity", [value], num_outputs=1, name=f"/output/{name}/Identity")
        out = identity.outputs[0]
        out.name, out.shape, out.type = name, value.shape, value.type
        graph.insert_after(value.producer(), identity)
        graph.outputs[index] = out


def _slice_positions_from_the_end(graph: ir.Graph, decoder_io: DecoderIO):
    """Position ids are cumsum(attention_mask)[:, past_sequence:]; torch.onnx slices from
    Shape(past_key_values.0.key)[2]. onnxruntime's symbolic shape inference (quant_pre_process,
    the transformers optimizer) reads the mask's dim 'past_sequence + sequence' as one symbol and
    cannot simplify (past_sequence + sequence) - past_sequence to sequence, so inference stops
    ('Incomplete symbolic shape inference'). Slicing [:, -sequence:] is the same slice (the mask
    has past + sequence columns) and infers to [batch, sequence]."""
    if not decoder_io.past:
        return
    input_ids = graph.inputs[0]
    mask = graph.inputs[1]
    past_inputs = {v for v in graph.inputs if v.name.startswith("past_key_values.")}

    def from_past_length(value) -> bool:
        # Shape(past, start=2, end=3), possibly through a Squeeze/Reshape/Cast of that
        seen = 0
        while value is not None and value.producer() is not None and seen < 4:
            node = value.producer()
            if node.op_type == "Shape":
                attrs = node.attributes
                start = attrs["start"].value if "start" in attrs else 0
                return node.inputs[0] in past_inputs and start == 2
            if node.op_type not in ("Squeeze", "Unsqueeze", "Reshape", "Cast"):
                return False
            value, seen = node.inputs[0], seen + 1
        return False

    def depends_on_mask(value) -> bool:
        stack, seen = [value], set()
        while stack:
            v = stack.pop()
            if v is mask:
                return True
            if v is None or id(v) in seen or v.producer() is None:
                continue
            seen.add(id(v))
            stack.extend(v.producer().inputs)
        return False

    sequence = None
    for node in list(graph):
        if node.op_type != "Slice" or len(node.inputs) < 4 or not from_past_length(node.inputs[1]):
            continue
        if not depends_on_mask(node.inputs[0]):
            continue
        axes = node.inputs[3].const_value.numpy().tolist() if node.inputs[3].const_value is not None else None
        if axes not in ([1], [-1]):
            continue
        if sequence is None:
            shape = ir.Node("", "Shape", [input_ids], attributes=[ir.AttrInt64("start", 1), ir.AttrInt64("end", 2)],
                            name="/positions/Shape")
            neg = ir.Node("", "Neg", shape.outputs, name="/positions/Neg")
            shape.outputs[0].name, neg.outputs[0].name = "sequence_length", "minus_sequence_length"
            graph.insert_before(node, [shape, neg])
            sequence = neg.outputs[0]
        node.replace_input_with(1, sequence)


def _keep_logits(graph: ir.Graph):
    """The LM head on the last logits_to_keep positions only (contract.LOGITS_TO_KEEP): an
    overridable initializer, 0 by default (every position: what Optimum and validation read), so
    no client has to feed it; `run` and the benchmarks' prefill feed 1 (the next token needs no
    other row, and the LM head is a fifth of a 512-token prefill's arithmetic). Four nodes:
    hidden[:, -max(n, 0):] before the head (a start of -0 keeps every position; one before the
    first clamps to it)."""
    logits = next(v for v in graph.outputs if v.name == "logits")
    head = logits.producer()

    def initializer(name, value):
        made = ir.Value(name=name, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(value.shape),
                        const_value=ir.tensor(value, name=name))
        graph.register_initializer(made)
        return made

    def node(op, inputs):
        made = ir.Node("", op, inputs, name=f"/logits_to_keep/{op}")
        graph.insert_before(head, made)
        return made.outputs[0]

    keep = initializer(LOGITS_TO_KEEP, np.array(0, np.int64))
    graph.inputs.append(keep)
    count = node("Max", [keep, initializer("/logits_to_keep/zero", np.array(0, np.int64))])
    start = node("Reshape", [node("Neg", [count]), initializer("/logits_to_keep/shape", np.array([1], np.int64))])
    sliced = node("Slice", [head.inputs[0], start, initializer("/logits_to_keep/end", np.array([2**63 - 1], np.int64)),
                            initializer("/logits_to_keep/axis", np.array([1], np.int64))])
    head.replace_input_with(0, sliced)
    logits.shape = ir.Shape([logits.shape[0], LOGITS_SEQUENCE, logits.shape[2]])


def save_model(model: ir.Model, path: Path):
    """Write model to path, its weights to "<name>.data" when protobuf cannot hold them: into a
    temporary directory beside path, then renamed, so a failure leaves no partial file."""
    weight_bytes = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    external = weight_bytes > EXTERNAL_DATA_BYTES
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    data_name = f"{path.name}.data"
    try:
        ir.save(model, staging / path.name, external_data=data_name if external else None)
        if external:
            # Two files cannot be renamed at once: move the old graph aside first, so that a crash
            # between the renames leaves no model.onnx rather than an old graph on new weights.
            if path.exists():
                os.replace(path, staging / f"{path.name}.old")
            os.replace(staging / data_name, path.parent / data_name)
        os.replace(staging / path.name, path)
    except OSError as error:
        raise InfMoEError(f"cannot write {path}: {error.strerror or error}") from None
    finally:
        for leftover in staging.iterdir():
            leftover.unlink()
        staging.rmdir()


def export_onnx(model: InfMoEGPT, path: Union[str, os.PathLike], *, k: Optional[int] = None,
                noise: str = "quantile", past: bool = True, opset: Optional[int] = None, dtype: str = "fp32",
                block_size: int = DEFAULT_BLOCK_SIZE, quantize_other: str = "none", function: bool = True,
                with_starts: bool = False, target: str = DEFAULT_TARGET, activations: str = "float",
                kv_cache: str = "float32") -> ExportedModel:
    """Export model for expert budget k (default: its num_samples) to path; target: the graph's
    runtime (contract.TARGETS: standard ops, or onnxruntime's fused attention, ort_target.py).
    dtype is the experts' precision (contract.DTYPES; int8/int4 with block_size, SPEC §6),
    quantize_other that of attention and the tied embedding / LM head (docs/guide/quantization.md);
    activations the quantized ops' kind a session runs by default (contract.ACTIVATION_KINDS,
    written as metadata; a session's option overrides it); kv_cache the element type of the KV
    cache's inputs and outputs (contract.KV_CACHES: float16 on the onnxruntime target with past
    only); opset defaults to DEFAULT_OPSET, or 21 where DequantizeLinear needs it.

    Either architecture, by its config's model_type: a conventional MoE (MoEGPT) gets onnxruntime's
    MoE / QMoE experts (moe.py); its K is top_k and its noise none (DecoderIO refuses others), at
    fp32, int8 or int4, for the portable or onnxruntime target."""
    decoder_io = DecoderIO(model.config, model.config.default_k if k is None else k, noise, past, with_starts, dtype,
                           block_size=block_size, quantize_other=quantize_other, target=target,
                           activations=activations, kv_cache=kv_cache)
    opset = check_opset(resolve_opset(opset, decoder_io, DEFAULT_OPSET))
    path = output_file(path)

    module = _ExportModule(model, decoder_io)
    if target == "onnxruntime":
        module = OrtDecoder(module)
    config = model.config
    batch, sequence = Dim(BATCH), Dim(SEQUENCE, max=config.n_positions)
    axes = {"input_ids": {0: batch, 1: sequence}, "attention_mask": {0: batch, 1: Dim.AUTO},
            "expert_noise": {0: batch, 1: sequence}}
    axes.update({name: {0: batch, 2: Dim(PAST, max=config.n_positions)} for name in decoder_io.past_names})
    example = decoder_io.dummy_inputs()
    args = tuple(torch.from_numpy(array) for array in example.values())
    try:
        with _quiet(), _interrupts_held(), torch.no_grad():
            program = torch.onnx.export(
                module, args, dynamo=True, input_names=decoder_io.input_names, output_names=decoder_io.output_names,
                dynamic_shapes=(tuple(axes[name] for name in decoder_io.input_names),), opset_version=opset,
                optimize=True, verbose=False)
    except Exception as error:  # torch.onnx wraps everything in its own error types
        summary = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise InfMoEError(f"torch.onnx export failed: {summary}") from error

    onnx_model = program.model
    _rename_dims(onnx_model.graph, decoder_io)
    _name_initializers(onnx_model.graph, module)
    insert_dequantize(onnx_model.graph, {name: p.detach() for name, p in model.named_parameters()}, decoder_io)
    _name_nodes(onnx_model.graph)
    _outputs_not_consumed(onnx_model.graph)
    _slice_positions_from_the_end(onnx_model.graph, decoder_io)
    if target == "onnxruntime":
        finish_ort_graph(onnx_model.graph)
        _keep_logits(onnx_model.graph)
    onnx_model.graph.sort()
    # none in a dense model, unless QMatMul; a conventional MoE's MoE / QMoE have functions too
    op_types = custom_op_types(onnx_model.graph) | moe_op_types(onnx_model.graph)
    has_function = function and bool(op_types)
    if has_function:
        for fn in ir_functions(opset, op_types, kv_cache):
            onnx_model.functions[fn.identifier()] = fn
    metadata = decoder_io.metadata(opset, has_function)
    onnx_model.metadata_props.update(metadata)
    onnx_model.producer_name = "infmoe-export"

    save_model(onnx_model, path)
    return ExportedModel(path, decoder_io, metadata)


def model_filename(k: int, noise: str, dtype: str = "fp32", quantize_other: str = "none",
                   kv_cache: str = "float32") -> str:
    """model_k{K}_{noise}_{dtype}.onnx, with _other-{quantize_other} when other matrices are
    quantized and _kv16 for a float16 KV cache: precisions exported into one folder do not collide."""
    other = "" if quantize_other == "none" else f"_other-{quantize_other}"
    kv = "_kv16" if kv_cache == "float16" else ""
    return f"model_k{k}_{noise}_{dtype}{other}{kv}.onnx"


def export_many(model: InfMoEGPT, folder: Union[str, os.PathLike], ks: Sequence[int],
                noises: Sequence[str] = ("quantile",), *, progress=None, **options) -> List[ExportedModel]:
    """One model per (noise, K) into folder as model_filename(K, noise, precision), in that
    order; options go to export_onnx. progress(description) is called before each export. Every
    command that exports more than one model (pipeline, bench, trt) comes through here."""
    folder = Path(folder)
    precision = dict(dtype=options.get("dtype", "fp32"), quantize_other=options.get("quantize_other", "none"),
                     kv_cache=options.get("kv_cache", "float32"))
    exported = []
    for noise in noises:
        for k in ks:
            if progress:
                progress(f"K={k} {noise}")
            exported.append(export_onnx(model, folder / model_filename(k, noise, **precision), k=k, noise=noise,
                                        **options))
    return exported
