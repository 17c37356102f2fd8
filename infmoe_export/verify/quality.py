"""Level 2 of a quantized model's parity (SPEC §6): how far quantization moves a model from the
float32 reference, as opposed to level 1 (does a kernel compute w' right, validate.py).

`quality_vs_float` scores an export (or any runner with `.io` and `infer`) and the float32
PyTorch model on the same text: perplexity of both and its increase, top-1 agreement, the
share of window starts that agree and per-token logit error percentiles. `Agreement` is the
accumulator it and validate.py share.
"""

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence, Union

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..contract import DOMAIN, DecoderIO, ExportedModel, custom_op_type
from ..data import corpus_bytes, read_texts, windows
from ..errors import InfMoEError
from ..evaluate import perplexity_of_logits, sampled_noise
from ..export.moe import experts_outputs
from ..model import InfMoEGPT
from ..runtimes.ort import create_session
from ..runtimes.torch_runner import TorchRunner

BATCH_SIZE = 4


@dataclasses.dataclass
class Agreement:
    """Per-token figures of a test backend against the float32 reference, over many batches."""
    errors: List[np.ndarray] = dataclasses.field(default_factory=list)   # per token max |logit difference|
    top1: List[np.ndarray] = dataclasses.field(default_factory=list)     # per token: same argmax
    same_starts: int = 0
    starts: int = 0

    def add(self, reference_logits, test_logits, reference_starts=None, test_starts=None, real=None):
        """logits [B, T, V]; starts: per layer [B, T, K] (or None); real [B, T]: tokens to count
        (None: all; padded positions are garbage in every backend)."""
        real = np.ones(reference_logits.shape[:2], bool) if real is None else real.astype(bool)
        diff = np.abs(test_logits.astype(np.float64) - reference_logits.astype(np.float64)).max(axis=-1)
        self.errors.append(diff[real])
        self.top1.append((reference_logits.argmax(-1) == test_logits.argmax(-1))[real])
        for ref, test in zip(reference_starts or (), test_starts or ()):
            self.same_starts += int((ref == test)[real].sum())
            self.starts += int(ref[real].size)

    def summary(self) -> dict:
        errors = np.concatenate(self.errors)
        return {"tokens": int(errors.size), "top1_agreement": float(np.concatenate(self.top1).mean()),
                "start_agreement": self.same_starts / self.starts if self.starts else None,
                "logit_error": {"max": float(errors.max()),
                                **{f"p{p}": float(np.percentile(errors, p)) for p in (50, 90, 99)}}}


def float_reference(model: InfMoEGPT, decoder_io: DecoderIO) -> TorchRunner:
    """The float32 PyTorch model with decoder_io's inputs, outputs and starts."""
    return TorchRunner(dataclasses.replace(decoder_io, dtype="fp32", quantize_other="none", activations="float",
                                           with_starts=True), model)


def starts_session(exported: ExportedModel, kernel: bool = True, providers=None, activations: str = "float"):
    """(session, output names): onnxruntime on exported, with every layer's starts (a
    conventional MoE: its experts) as the last outputs when the file does not output them (a
    sibling copy, removed once loaded)."""
    copy = _with_starts_outputs(exported.path, exported.io)
    try:
        session = create_session(copy or exported, kernel=kernel, providers=providers, activations=activations)
    finally:
        if copy is not None:
            copy.unlink()
    return session, [o.name for o in session.get_outputs()]


def _with_starts_outputs(path: Path, decoder_io: DecoderIO) -> Optional[Path]:
    """A sibling copy of the model whose outputs include every layer's starts, or a conventional
    MoE's experts (None if it already has them). Beside the original so that external data
    still resolves."""
    if decoder_io.with_starts:
        return None
    model = onnx.load(str(path), load_external_data=False)
    if decoder_io.is_moe:
        if not experts_outputs(model):
            return None
    else:
        op_type = custom_op_type(model.graph.node)
        nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == op_type]
        if not nodes:
            return None
        for node in nodes:  # the exporter emits them in layer order
            model.graph.output.append(helper.make_tensor_value_info(node.input[1], TensorProto.INT64, None))
    fd, copy = tempfile.mkstemp(prefix=f".{path.name}.validate.", suffix=".onnx", dir=path.parent)
    os.close(fd)
    onnx.save(model, copy)
    return Path(copy)


def _test_outputs(exported, kernel: bool, activations: str = "float"):
    """(decoder_io, run(feed) -> (logits, starts per layer or None), cleanup) of what is scored."""
    if isinstance(exported, (str, os.PathLike)):
        exported = ExportedModel.read(exported)
    if isinstance(exported, ExportedModel):
        session, names = starts_session(exported, kernel=kernel, activations=activations)
        io = exported.io

        def run(feed):
            outputs = dict(zip(names, session.run(None, dict(feed))))
            starts = [outputs[name] for name in names[len(io.output_names):]] or None
            if io.with_starts:
                starts = [outputs[f"expert_starts.{i}"] for i in range(io.config.n_layer)]
            return outputs["logits"], starts
        return io, run, lambda: None
    runner = exported  # a Polygraphy-style runner
    runner.activate()

    def run(feed):
        outputs = runner.infer(feed)
        starts = [outputs[f"expert_starts.{i}"] for i in range(runner.io.config.n_layer)] \
            if runner.io.with_starts else None
        return outputs["logits"], starts
    return runner.io, run, runner.deactivate


def quality_vs_float(model: InfMoEGPT, exported: Union[ExportedModel, str, os.PathLike, object],
                     texts: Sequence = (), *, max_windows: int = 8, seed: int = 0, kernel: bool = True,
                     activations: str = "float") -> dict:
    """Level 2 of exported (an export, its path, or a runner with .io and infer()) against the
    float32 model on full windows of texts (default: the stdlib validation split): perplexity of
    both and the increase in %, top-1 and start agreement, logit error percentiles (per token
    max |difference|). Sampled-noise models get evaluate's seeded noise, as parity does.
    activations: the kernel's for an export ("float" or "int8", create_session)."""
    decoder_io, run, cleanup = _test_outputs(exported, kernel, activations)
    if decoder_io.config != model.config:
        raise InfMoEError("the model to score was exported from a different config than the float model given")
    data = read_texts(texts) if texts else corpus_bytes("validation")
    n = decoder_io.config.n_positions
    chunks = [w for w in windows(data, n) if len(w) == n][:max_windows]
    if not chunks:
        raise InfMoEError(f"text too short: need at least {n} tokens (one full window)")
    noise = sampled_noise(chunks, decoder_io.k, seed) if decoder_io.noise == "sampled" else None
    reference = float_reference(model, decoder_io)
    agreement, ids, float_logits, test_logits = Agreement(), [], [], []
    try:
        with reference:
            for start in range(0, len(chunks), BATCH_SIZE):
                batch = np.stack([c.numpy() for c in chunks[start:start + BATCH_SIZE]])
                eps = None if noise is None else np.stack([e.numpy() for e in noise[start:start + BATCH_SIZE]])
                feed = decoder_io.feed(batch, np.ones_like(batch), None, eps)
                expected = reference.infer(feed)
                logits, starts = run(feed)
                ref_starts = [expected[f"expert_starts.{i}"] for i in range(decoder_io.config.n_layer)]
                agreement.add(expected["logits"], logits, ref_starts if starts else None, starts)
                ids.append(batch), float_logits.append(expected["logits"]), test_logits.append(logits)
    finally:
        cleanup()
    ppl_float, ppl = perplexity_of_logits(float_logits, ids), perplexity_of_logits(test_logits, ids)
    return {"precision": decoder_io.dtype, "quantize_other": decoder_io.quantize_other, "activations": activations,
            "block_size": decoder_io.block_size, "k": decoder_io.k, "noise": decoder_io.noise,
            "perplexity_float": ppl_float, "perplexity": ppl, "perplexity_increase_pct": 100 * (ppl / ppl_float - 1),
            **agreement.summary()}
