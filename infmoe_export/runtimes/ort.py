"""onnxruntime sessions for exported ∞-MoE models, and a Polygraphy runner on top.

The compiled ContinuousSliceFFN kernel (plugins/onnxruntime) is registered when it is built.
A registered kernel takes precedence over the model's local function: onnxruntime inlines a
local function only for a node that no registered kernel claims (tests/test_runtimes.py checks
this by profiling). Without the kernel, or with kernel=False, the node runs as the fallback
function made of standard ops.
"""

import os
from typing import Optional, Sequence, Union

import onnxruntime as ort
from polygraphy.backend.onnxrt import OnnxrtRunner

from ..contract import DecoderIO, ExportedModel
from ..errors import InfMoEError
from . import ort_kernel

# Preferred first; onnxruntime falls back down the list node by node.
PROVIDER_ORDER = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


def default_providers() -> list:
    available = ort.get_available_providers()
    return [p for p in PROVIDER_ORDER if p in available] or ["CPUExecutionProvider"]


def create_session(model: Union[ExportedModel, str, os.PathLike], kernel: bool = True,
                   providers: Optional[Sequence] = None, intra_op_threads: Optional[int] = None,
                   options: Optional[ort.SessionOptions] = None) -> ort.InferenceSession:
    """An InferenceSession for an exported model: the kernel when asked for and installed, the
    fallback function otherwise; providers default to the best installed ones."""
    if not isinstance(model, ExportedModel):
        model = ExportedModel.read(model)
    options = options or ort.SessionOptions()
    if intra_op_threads is not None:
        options.intra_op_num_threads = intra_op_threads
    registered = kernel and ort_kernel.register(options)
    # Only a dense model (slice_width == ffn_hidden) is exported without the custom op.
    if not registered and not model.has_function and not model.io.config.is_dense:
        raise InfMoEError(f"{model.path} was exported with --no-function and the onnxruntime kernel is not "
                          "available: install it (docs/onnxruntime-kernel.md) or re-export with the fallback function")
    try:
        return ort.InferenceSession(str(model.path), sess_options=options,
                                    providers=list(providers) if providers else default_providers())
    except Exception as error:  # onnxruntime raises its own exception types
        raise InfMoEError(f"onnxruntime cannot load {model.path}: {str(error).strip().splitlines()[0]}") from None


class OrtRunner(OnnxrtRunner):
    """Polygraphy's onnxruntime runner over create_session, with the model's DecoderIO."""

    def __init__(self, decoder_io: DecoderIO, model: Union[ExportedModel, str, os.PathLike], *, kernel: bool = True,
                 providers: Optional[Sequence] = None, intra_op_threads: Optional[int] = None,
                 name: Optional[str] = None):
        if not isinstance(model, ExportedModel):
            model = ExportedModel.read(model)
        if model.io != decoder_io:
            raise InfMoEError(f"{model.path} was exported with other inputs and outputs than the ones given")
        super().__init__(lambda: create_session(model, kernel, providers, intra_op_threads), name=name)
        self.path = model.path
        self.io = decoder_io
