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

from ..errors import InfMoEError
from ..export.io import DecoderIO, read_metadata

# Preferred first; onnxruntime falls back down the list node by node.
PROVIDER_ORDER = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


def default_providers() -> list:
    available = ort.get_available_providers()
    return [p for p in PROVIDER_ORDER if p in available] or ["CPUExecutionProvider"]


def register_kernel(options: ort.SessionOptions) -> bool:
    """Register the compiled kernel on options; False when the library is not there."""
    try:
        from . import ort_kernel
    except ImportError:  # the kernel's Python side is not installed: run on the fallback
        return False
    return ort_kernel.register(options)


def create_session(path: Union[str, os.PathLike], kernel: bool = True, providers: Optional[Sequence] = None,
                   intra_op_threads: Optional[int] = None, options: Optional[ort.SessionOptions] = None
                   ) -> ort.InferenceSession:
    """An InferenceSession for an exported model: the kernel when asked for and built, the
    fallback function otherwise; providers default to the best installed ones."""
    metadata = read_metadata(path)
    options = options or ort.SessionOptions()
    if intra_op_threads is not None:
        options.intra_op_num_threads = intra_op_threads
    registered = kernel and register_kernel(options)
    if not registered and metadata.get("infmoe.has_function") == "0" and _has_custom_op(metadata):
        raise InfMoEError(f"{path} was exported with --no-function and the onnxruntime kernel is not "
                          "available: build plugins/onnxruntime or re-export with the fallback function")
    try:
        return ort.InferenceSession(str(path), sess_options=options,
                                    providers=list(providers) if providers else default_providers())
    except Exception as error:  # onnxruntime raises its own exception types
        raise InfMoEError(f"onnxruntime cannot load {path}: {str(error).strip().splitlines()[0]}") from None


def _has_custom_op(metadata: dict) -> bool:
    """Only a dense model (slice_width == ffn_hidden) is exported without the custom op."""
    return not DecoderIO.from_metadata(metadata).config.is_dense


class OrtRunner(OnnxrtRunner):
    """Polygraphy's onnxruntime runner over create_session, knowing the model's I/O (io.py)."""

    def __init__(self, path: Union[str, os.PathLike], kernel: bool = True, providers: Optional[Sequence] = None,
                 intra_op_threads: Optional[int] = None, name: Optional[str] = None):
        super().__init__(lambda: create_session(path, kernel, providers, intra_op_threads), name=name)
        self.path = path
        self.io = DecoderIO.from_metadata(read_metadata(path))
