"""Export an InfMoEGPT to ONNX with one `infmoe::ContinuousSliceFFN` node per layer (SPEC §4).

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
import tempfile
import warnings
from pathlib import Path
from typing import List, Optional, Sequence, Union

import onnx
import onnx_ir as ir
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

from ..contract import BATCH, DOMAIN, OP_TYPE, OP_VERSION, PAST, SEQUENCE, DecoderIO, ExportedModel
from ..errors import InfMoEError
from ..model import InfMoEGPT, gelu_tanh, quantile_noise, window_starts
from .function import ir_function

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
    GPT-2 Small size), and fp16 activations upstream move it by whole windows (docs/export.md)."""

    def __init__(self, moe: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.moe, self.dtype = moe, dtype
        for name in ("w_in", "b_in", "w_out", "b_out"):
            getattr(moe, name).data = getattr(moe, name).data.to(dtype)

    def forward(self, x, eps):
        m = self.moe
        starts = window_starts(m.router(x, eps), m.ffn_hidden, m.slice_width)
        h = x.to(self.dtype)
        if m.slice_width == m.ffn_hidden:  # every window is the whole FFN: an ordinary MLP
            y = gelu_tanh(F.linear(h, m.w_in, m.b_in)) @ m.w_out + m.b_out
        else:
            y = torch.onnx.ops.symbolic(
                f"{DOMAIN}::{OP_TYPE}", (h, starts, m.w_in, m.b_in, m.w_out, m.b_out),
                dict(slice_width=m.slice_width, activation="gelu_tanh", plugin_namespace=DOMAIN,
                     plugin_version=str(OP_VERSION)),
                dtype=h.dtype, shape=h.shape, version=OP_VERSION)
        return y.to(x.dtype), starts


class _ExportModule(nn.Module):
    """The reference model with flat, ONNX-named inputs and outputs (see decoder_io.py)."""

    def __init__(self, model: InfMoEGPT, decoder_io: DecoderIO):
        super().__init__()
        self.io = decoder_io
        self.model = copy.deepcopy(model).eval()
        dtype = torch.float16 if decoder_io.dtype == "fp16" else torch.float32
        for block in self.model.h:
            block.moe = _ExportMoE(block.moe, dtype)
        if decoder_io.noise == "quantile":  # baked in as a constant
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
        if eps is None:
            eps = self.quantile_eps.expand(batch, sequence, self.io.k)
        output = self.model(input_ids, named["attention_mask"], past, k=self.io.k, expert_noise=eps,
                            return_starts=self.io.with_starts)
        return tuple(self.io.flatten(output).values())


def check_opset(opset) -> int:
    if not isinstance(opset, int) or isinstance(opset, bool) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise InfMoEError(f"opset {opset} is not supported: ContinuousSliceFFN and its fallback function "
                          f"are exported for opsets {MIN_OPSET}..{MAX_OPSET}")
    return opset


def check_output_path(path: Union[str, os.PathLike]) -> Path:
    """Refuse a directory or an unwritable location before any work is done."""
    path = Path(path)
    if path.is_dir():
        raise InfMoEError(f"output path {path} is a directory; give a file name such as {path / 'model.onnx'}")
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise InfMoEError(f"cannot write {path}: {parent} is not a directory")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise InfMoEError(f"cannot write {path}: {error.strerror or error}") from None
    return path


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


def _rename_dims(graph: ir.Graph, decoder_io: DecoderIO):
    """Give every dynamic dim its Optimum-style name: torch.export calls some 's53', and
    writes sums in either order ('sequence + past_sequence')."""
    wanted = decoder_io.shapes()
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


def _save_atomic(model: ir.Model, path: Path, external: bool):
    """Write into a temporary directory beside path, then rename: no partial file on failure."""
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    data_name = f"{path.name}.data"
    try:
        ir.save(model, staging / path.name, external_data=data_name if external else None)
        if external:
            os.replace(staging / data_name, path.parent / data_name)
        os.replace(staging / path.name, path)
    except OSError as error:
        raise InfMoEError(f"cannot write {path}: {error.strerror or error}") from None
    finally:
        for leftover in staging.iterdir():
            leftover.unlink()
        staging.rmdir()


def export_onnx(model: InfMoEGPT, path: Union[str, os.PathLike], *, k: Optional[int] = None,
                noise: str = "quantile", past: bool = True, opset: int = DEFAULT_OPSET, dtype: str = "fp32",
                function: bool = True, with_starts: bool = False) -> ExportedModel:
    """Export model for expert budget k (default: its num_samples) to path."""
    decoder_io = DecoderIO(model.config, model.config.num_samples if k is None else k, noise, past, with_starts, dtype)
    check_opset(opset)
    path = check_output_path(path)

    module = _ExportModule(model, decoder_io)
    config = model.config
    batch, sequence = Dim(BATCH), Dim(SEQUENCE, max=config.n_positions)
    axes = {"input_ids": {0: batch, 1: sequence}, "attention_mask": {0: batch, 1: Dim.AUTO},
            "expert_noise": {0: batch, 1: sequence}}
    axes.update({name: {0: batch, 2: Dim(PAST, max=config.n_positions)} for name in decoder_io.past_names})
    example = decoder_io.dummy_inputs()
    args = tuple(torch.from_numpy(array) for array in example.values())
    try:
        with _quiet(), torch.no_grad():
            program = torch.onnx.export(
                module, args, dynamo=True, input_names=decoder_io.input_names, output_names=decoder_io.output_names,
                dynamic_shapes=(tuple(axes[name] for name in decoder_io.input_names),), opset_version=opset,
                optimize=True, verbose=False)
    except Exception as error:  # torch.onnx wraps everything in its own error types
        summary = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise InfMoEError(f"torch.onnx export failed: {summary}") from error

    onnx_model = program.model
    _rename_dims(onnx_model.graph, decoder_io)
    has_function = function and not config.is_dense  # a dense model has no custom op to fall back from
    if has_function:
        fn = ir_function(opset)
        onnx_model.functions[fn.identifier()] = fn
    metadata = decoder_io.metadata(opset, has_function)
    onnx_model.metadata_props.update(metadata)
    onnx_model.producer_name = "infmoe-export"

    weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    _save_atomic(onnx_model, path, external=weight_bytes > EXTERNAL_DATA_BYTES)
    return ExportedModel(path, decoder_io, metadata)


def model_filename(k: int, noise: str) -> str:
    return f"model_k{k}_{noise}.onnx"


def export_many(model: InfMoEGPT, folder: Union[str, os.PathLike], ks: Sequence[int],
                noises: Sequence[str] = ("quantile",), *, progress=None, **options) -> List[ExportedModel]:
    """One model per (noise, K) into folder as model_k{K}_{noise}.onnx, in that order; options go
    to export_onnx. progress(description) is called before each export. Every command that
    exports more than one model (pipeline, bench, trt) comes through here."""
    folder = Path(folder)
    exported = []
    for noise in noises:
        for k in ks:
            if progress:
                progress(f"K={k} {noise}")
            exported.append(export_onnx(model, folder / model_filename(k, noise), k=k, noise=noise, **options))
    return exported
