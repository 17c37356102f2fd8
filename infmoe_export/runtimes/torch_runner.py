"""The PyTorch reference as a Polygraphy runner, with exactly the exported model's I/O names.

So Polygraphy's Comparator and data loaders treat the reference like any other backend:
infer() takes the ONNX inputs (numpy) and returns the ONNX outputs (numpy, fp32).

For an int8 / int4 model it runs the model with the dequantized weights w' (SPEC §6): the
level-1 reference that every quantized backend must match with the float tolerances. For a model
with a float16 KV cache it rounds the keys and values to float16 as that cache stores them, so
level 1 binds such a model too.
"""

import time
from collections import OrderedDict
from typing import Optional

import numpy as np
import torch
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata
from polygraphy.datatype import DataType

from ..contract import DecoderIO
from ..errors import InfMoEError
from ..model import InfMoEGPT
from ..quant import dequantized_model


class TorchRunner(BaseRunner):
    """Runs model with the inputs and outputs of decoder_io (expert budget, noise, cache, starts)."""

    def __init__(self, decoder_io: DecoderIO, model: InfMoEGPT, *, name: Optional[str] = None):
        super().__init__(name=name, prefix="torch-runner")
        if decoder_io.config != model.config:
            raise InfMoEError("the PyTorch model's config differs from the exported model's")
        if decoder_io.quantized:
            model = dequantized_model(model, decoder_io.bits, decoder_io.block_size, decoder_io.other_bits)
        self.model = model.eval()
        self.io = decoder_io

    def activate_impl(self):
        pass

    def get_input_metadata_impl(self):
        meta = TensorMetadata()
        dtypes = self.io.dtypes()
        for name, shape in self.io.shapes().items():
            if name in self.io.input_names:
                meta.add(name, dtype=DataType.from_dtype(np.dtype(dtypes[name])), shape=shape)
        return meta

    def infer_impl(self, feed_dict):
        missing = [name for name in self.io.input_names if name not in feed_dict]
        if missing:
            raise InfMoEError(f"input {missing[0]!r} is missing from the feed")
        device = self.model.wte.weight.device
        tensors = {name: torch.as_tensor(np.ascontiguousarray(feed_dict[name]), device=device)
                   for name in self.io.input_names}
        past = None
        if self.io.past:
            flat = [tensors[name].float() for name in self.io.past_names]
            past = tuple(zip(flat[0::2], flat[1::2]))
        start = time.perf_counter()
        with torch.no_grad():
            output = self.model(tensors["input_ids"], tensors["attention_mask"], past, k=self.io.k,
                                expert_noise=tensors.get("expert_noise"), return_starts=self.io.with_starts,
                                cache_dtype=torch.float16 if self.io.kv_cache == "float16" else None)
        self.inference_time = time.perf_counter() - start
        dtypes = self.io.dtypes()
        return OrderedDict((name, t.cpu().numpy().astype(dtypes[name], copy=False))
                           for name, t in self.io.flatten(output).items())

    def deactivate_impl(self):
        pass
