"""The onnxruntime sessions the benchmarks time: an exported model decoding on a shared KV cache,
onnxruntime's own MatMulNBits dense peer, and single-op models."""

import logging
from pathlib import Path
from typing import Optional

import numpy as np
import onnx
import onnxruntime as ort
import onnxruntime.capi._pybind_state as ort_state
from onnx import numpy_helper

from infmoe_export.contract import ExportedModel
from infmoe_export.export import export_onnx
from infmoe_export.model import InfMoEGPT
from infmoe_export.report.bench import text_tokens
from infmoe_export.report.timing import median_ms, settle
from infmoe_export.runtimes.ort import MATMULNBITS_ACCURACY, SharedCache, create_session
from infmoe_export.runtimes.ort_kernel import register

from .shapes import BLOCK, MEDIUM_DENSE


class Decoder:
    """One exported model in one session: steps[past]() is one decode token at that past."""

    def __init__(self, exported: ExportedModel, threads: int, options: ort.SessionOptions = None):
        self.io = exported.io
        self.session = create_session(exported, kernel=True, providers=["CPUExecutionProvider"],
                                      intra_op_threads=threads, options=options)
        self.steps = {}

    def prepare(self, past: int):
        self.steps[past] = self.step_at(past)

    def step_at(self, past: int, batch: int = 1):
        """A step of `batch` sequences, one new token each, after `past` cached tokens of real
        text; every call at exactly that past (the shared cache's length is set back)."""
        tokens = np.tile(text_tokens(past + 1)[None], (batch, 1))
        if self.io.shares_cache:
            cache = SharedCache(self.session, self.io, batch)
            cache.step(tokens[:, :past])

            def step():
                cache.length = past
                return cache.step(tokens[:, past:])
            return step
        present = self.session.run(None, self.io.feed(tokens[:, :past], np.ones((batch, past), np.int64)))
        cache = dict(zip([o.name for o in self.session.get_outputs()], present))
        feed = self.io.feed(tokens[:, past:], np.ones((batch, past + 1), np.int64),
                            [cache[n.replace("past_key_values", "present")] for n in self.io.past_names])
        return lambda: self.session.run(None, feed)

    def prefill_at(self, tokens: int):
        """One prefill of `tokens` tokens of real text from position 0 of a shared cache, the
        logits of the last position only (what a generation's next token needs)."""
        ids = text_tokens(tokens)[None]
        cache = SharedCache(self.session, self.io)

        def step():
            cache.length = 0
            return cache.step(ids, last_only=True)
        return step

    def sample(self, past: int, steps: int) -> float:
        """Median ms of `steps` decode steps (after one untimed)."""
        settle()
        return median_ms(self.steps[past], steps)


def dense_matmulnbits(scratch: Path) -> ExportedModel:
    """The dense GPT-2-Medium-size model (random weights) exported at fp32 with the onnxruntime
    target, every MatMul with a constant weight (attention, FFN, the LM head) then quantized by
    onnxruntime's own MatMulNBitsQuantizer (int4, symmetric, block 32, float activations)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger().setLevel(logging.WARNING)  # the quantizer's module sets INFO on import
    fp32 = export_onnx(InfMoEGPT(MEDIUM_DENSE).eval(), scratch / "medium_fp32.onnx", k=1, target="onnxruntime")
    model = onnx.load(str(fp32.path))
    fp32.path.unlink()
    # The quantizer takes MatMuls whose weight is an initializer; the LM head reads Transpose(wte).
    weights = {t.name: t for t in model.graph.initializer}
    head = next(n for n in model.graph.node if n.op_type == "Transpose" and n.input[0] in weights)
    transposed = numpy_helper.to_array(weights[head.input[0]]).T.copy()
    model.graph.initializer.append(numpy_helper.from_array(transposed, head.output[0]))
    model.graph.node.remove(head)
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=BLOCK, is_symmetric=True)
    quantizer.process()
    path = scratch / "medium_int4.onnx"
    quantizer.model.save_model_to_file(str(path))
    fused = sum(n.op_type == "MatMulNBits" for n in quantizer.model.model.graph.node)
    print(f"dense Medium MatMulNBits model: {fused} MatMulNBits, file {path.stat().st_size / 2**20:.0f} MiB",
          flush=True)
    return ExportedModel.read(path)


def through_matmulnbits(path: Path, accuracy_level: int) -> Path:
    """A copy of an export whose QMatMul nodes (attention, LM head) are onnxruntime's MatMulNBits,
    as their function inlines them, at an accuracy level: 1 float activations, 4 int8 ones
    (onnxruntime-genai's CPU default; off the level-1 reference by more than the float
    tolerances, so a deployment judges it at level 2)."""
    model = onnx.load(str(path))
    for node in model.graph.node:
        if node.op_type == "QMatMul":
            node.op_type, node.domain = "MatMulNBits", "com.microsoft"
            node.attribute.append(onnx.helper.make_attribute("accuracy_level", accuracy_level))
    out = path.with_name(f"{path.stem}_nbits{accuracy_level}.onnx")
    onnx.save(model, str(out))
    return out


def int8_activations() -> ort.SessionOptions:
    """Session options under which MatMulNBits takes int8 activations (accuracy level 4)."""
    options = ort.SessionOptions()
    options.add_session_config_entry(MATMULNBITS_ACCURACY, "4")
    return options


_shared_pool_threads = None  # set by use_shared_pool


def use_shared_pool(threads: int):
    """From here on, op sessions run on onnxruntime's global pool of `threads` threads (spinning
    between calls, as by default). Once per process, before the first session."""
    global _shared_pool_threads
    ort_state.set_global_thread_pool_sizes(threads, 1)
    _shared_pool_threads = threads


def op_session(model: onnx.ModelProto, threads: int, kernel: bool = True,
               activations: Optional[str] = None) -> ort.InferenceSession:
    """A session of a single-op model: on the shared pool (use_shared_pool), or on a pool of its
    own that never spins (a spinning pool would steal the cores from the next session's call);
    with the kernel, its quantized ops on these activations ("float", the default, or "int8")."""
    options = ort.SessionOptions()
    if _shared_pool_threads is None:
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    else:
        options.use_per_session_threads = False
    if kernel and not register(options, activations=activations):
        raise SystemExit("benchmarks: the kernel library is not built")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
