"""A Polygraphy TrtRunner on one engine, with the exported model's DecoderIO."""

import math
from typing import Optional

import numpy as np
from polygraphy.backend.common import BytesFromPath
from polygraphy.backend.trt import EngineFromBytes
from polygraphy.backend.trt import TrtRunner as PolygraphyTrtRunner  # TensorRT itself is imported lazily
from polygraphy.datatype import DataType

from ...contract import DecoderIO
from ...errors import InfMoEError
from .availability import register_plugin, require_cuda_torch, require_tensorrt
from .manifest import read_manifest, select_engine
from .network import pick_profile


def host_feed(feed_dict) -> dict:
    """The feed with every empty device array (a CUDA torch tensor, a Polygraphy DeviceView)
    replaced by an empty numpy array. Polygraphy copies a host array into a buffer of its own
    that is never null, even for zero bytes (backend/trt/util.py, _get_array_on_gpu), while an
    empty device array may have address 0, which TensorRT refuses for an input. The prefill
    profile's past_key_values are empty."""
    def on_host(array):
        if isinstance(array, np.ndarray) or math.prod(array.shape) != 0:
            return array
        return np.empty(tuple(array.shape), DataType.to_dtype(DataType.from_dtype(array.dtype), "numpy"))

    return {name: on_host(array) for name, array in feed_dict.items()}


class TrtRunner(PolygraphyTrtRunner):
    """Polygraphy's TrtRunner on one engine, with the exported model's DecoderIO.

    Feeds and outputs use the ONNX model's names, like every other runner; the optimization
    profile (prefill or decode) is picked from each feed's shapes.
    """

    def __init__(self, decoder_io: DecoderIO, entry: dict, *, name: Optional[str] = None):
        """entry: the engine's manifest entry (select_engine), which records its profiles."""
        require_tensorrt()
        if DecoderIO.from_metadata(entry["metadata"]) != decoder_io:
            raise InfMoEError(f"engine {entry['path']} was built for other inputs and outputs than the ones given")
        self.io, self.manifest_entry = decoder_io, entry
        if entry["plugin"] == "jit":  # the engine calls back into the Python plugin; an AOT one holds its kernel
            require_cuda_torch()
            register_plugin()
        super().__init__(EngineFromBytes(BytesFromPath(entry["path"])), name=name or f"tensorrt-k{decoder_io.k}")

    @classmethod
    def from_engines(cls, engines, k: int, precision: Optional[str] = None, *,
                     name: Optional[str] = None) -> "TrtRunner":
        """The runner of the engine for expert budget k and precision (None: the only one for k)
        in an engine folder (or its manifest)."""
        entry = select_engine(read_manifest(engines), k, precision)
        return cls(DecoderIO.from_metadata(entry["metadata"]), entry, name=name)

    def infer_impl(self, feed_dict, *args, **kwargs):
        index = pick_profile(self.manifest_entry["profiles"], {n: np.shape(a) for n, a in feed_dict.items()})
        if index != self.context.active_optimization_profile:
            self.set_profile(index)
        return super().infer_impl(host_feed(feed_dict), *args, **kwargs)
