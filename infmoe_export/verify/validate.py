"""Validate an exported model against the PyTorch reference, like Optimum's validate_model_outputs.

Run onnxruntime and the reference on the same generated inputs — a left-padded batch-2
prefill (past_sequence = 0), then one decode step on the reference's cache — and check output
names, dim names, shapes, then values: max abs / rel difference per output over all tokens,
and max abs over the tokens whose output cannot depend on a differing window (SPEC §5's
"tokens whose starts agree", made causal because attention mixes a row): real (unpadded)
tokens whose starts, and those of every earlier token in their row, agree in every layer
before the output. Starts are read from the graph itself: a copy of the model lists each
ContinuousSliceFFN node's `starts` input as an extra output.

Starts are a floor, so two correct backends disagree where the continuous position
sigmoid(z) (H - r + 1) lies within rounding of an integer, and once a row's windows differ in
one layer, its later layers see different inputs and may differ anywhere. So the share of
agreeing starts is reported, not judged (one boundary token in a 12-layer model already costs
several percent of a short test); what fails is a disagreement at a row's *first* diverging
layer that rounding cannot explain: the reference's position more than BOUNDARY_TOLERANCE x
(H - r + 1) units outside the window onnxruntime chose.

A conventional MoE's export (export/moe.py) is checked the same way with its experts in place of
the starts (read from the graph: the experts its router logits pick, spec §7's rule): a
disagreement at a row's first diverging layer passes as a boundary case where the reference's
logits of two experts next in order (among the top_k + 1) lie within TIE_TOLERANCE of each other,
relative to the largest |logit|, and fails otherwise.

An int8 / int4 export (SPEC §6) is checked the same way against the reference on the
dequantized weights w' (level 1, the float tolerances), and its distance from the float32
reference on the same inputs is reported beside it (level 2: logit error, top-1 and start
agreement; quality.py scores it on text).

On failure the exported file is kept (as Optimum does): it is a complete model, useful to
inspect, and the error names it.
"""

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Union

import numpy as np
import torch

from ..checkpoint import require_arch
from ..contract import DecoderIO, ExportedModel
from ..errors import InfMoEError
from ..model import InfMoEGPT
from ..runtimes.torch_runner import TorchRunner
from .parity import DEFAULT_ATOL as PARITY_ATOL
from .quality import Agreement, float_reference, starts_session

# fp32: float32 rounding through the layers is ~1e-6; 1e-4 is the project's bound. fp16 (the
# expert part, docs/guide/export.md): 11-bit products reach ~1e-2 on logits of order 1-10.
# int8 / int4: activations are float32 and the reference has the same w', so fp32's bound.
DEFAULT_ATOL = {"fp32": 1e-4, "fp16": 5e-2, "int8": 1e-4, "int4": 1e-4}
# The default atol of an export with a float16 KV cache (where its dtype's is lower): the cache
# rounds every key and value to 11 bits, so where two correct backends' sums of a value differ in
# the last float32 bits their caches may hold neighbouring float16s, and every later logit of the
# row carries that step (the present outputs allow it by one float16 step each, below): parity's
# own default.
KV16_ATOL = PARITY_ATOL
# How far sigmoid(z) may move between backends: ~100 float32 ulps at 0.5; for fp16 exports
# the router's input carries the earlier layers' fp16 FFN outputs.
BOUNDARY_TOLERANCE = {"fp32": 1e-5, "fp16": 2e-3, "int8": 1e-5, "int4": 1e-5}
# The same with a float16 KV cache (where its dtype's is lower): where two correct backends' sums
# of a key or value differ in the last float32 bits, their caches may hold neighbouring float16s
# (one part in 2048), which reach the router's input through every later attention; ten times
# float32's, as KV16_ATOL is ten times fp32's atol.
KV16_BOUNDARY_TOLERANCE = 1e-4
# How far a conventional MoE's router logits may move between backends, relative to max(1, |l|):
# float32 dot products of D terms in another order, through the layers before.
TIE_TOLERANCE = 1e-4


@dataclass
class OutputCheck:
    step: str
    name: str
    shape: tuple
    max_abs: float            # over all tokens
    max_rel: float
    max_abs_agreeing: float   # over tokens whose starts agree in the layers it depends on (nan: none)
    ok: bool


@dataclass
class ValidationReport:
    path: Path
    atol: float
    outputs: List[OutputCheck] = field(default_factory=list)
    start_agreement: Optional[float] = None   # None: a dense model has no starts to compare
    boundary_cases: int = 0                   # first-layer disagreements explained by rounding
    problems: List[str] = field(default_factory=list)
    level2: Optional[dict] = None             # quantized exports: against the float32 reference, not judged
    routing: str = "starts"                   # what the routers choose: "starts", or a conventional MoE's "experts"

    @property
    def passed(self) -> bool:
        return not self.problems

    def table(self):
        from rich.table import Table

        boundaries = "window boundaries" if self.routing == "starts" else "near-ties"
        agreement = "n/a (dense)" if self.start_agreement is None else (
            f"{100 * self.start_agreement:.3f}% ({self.boundary_cases} at {boundaries})")
        table = Table(title=f"validation of {self.path.name}: atol {self.atol:g}, {self.routing} agree {agreement}")
        for column in ("step", "output", "shape", "max abs", "max rel", f"max abs ({self.routing} agree)", ""):
            table.add_column(column, justify="right" if column.startswith("max") else "left")
        for c in self.outputs:
            table.add_row(c.step, c.name, "x".join(map(str, c.shape)), f"{c.max_abs:.3g}", f"{c.max_rel:.3g}",
                          "n/a" if np.isnan(c.max_abs_agreeing) else f"{c.max_abs_agreeing:.3g}",
                          "ok" if c.ok else "[red]FAIL[/red]")
        if self.level2:
            starts = self.level2["start_agreement"]
            table.caption = (f"level 1 above (vs the dequantized reference); level 2, vs float32, not judged: "
                             f"logits max abs {self.level2['logit_error']['max']:.3g}, top-1 agreement "
                             f"{100 * self.level2['top1_agreement']:.1f}%"
                             + ("" if starts is None else f", {self.routing} agree {100 * starts:.2f}%"))
        return table


def _compare(report: ValidationReport, step: str, decoder_io: DecoderIO, expected: Dict[str, np.ndarray],
             actual: Dict[str, np.ndarray], starts_actual: List[np.ndarray], attention_mask: np.ndarray):
    """Append one row per output to the report."""
    if list(actual) != decoder_io.output_names:
        report.problems.append(f"{step}: output names {list(actual)} differ from {decoder_io.output_names}")
        return
    sequence = expected["logits"].shape[1]
    real = attention_mask[:, -sequence:].astype(bool)  # padded positions are garbage, never compared
    # agree[l]: real tokens whose own starts and those of every earlier token of their row (which
    # they attend to) agree in layers 0..l-1: everything an output of layer l depends on.
    agree, same = [real], np.ones_like(real)
    for layer in range(decoder_io.config.n_layer):
        if starts_actual:
            same &= (expected[f"expert_starts.{layer}"] == starts_actual[layer]).all(axis=-1) | ~real
        agree.append(np.logical_and.accumulate(same, axis=1) & real)
    for name in decoder_io.output_names:
        e, a = expected[name], actual[name]
        if e.shape != a.shape:
            report.problems.append(f"{step}: {name} has shape {list(a.shape)}, expected {list(e.shape)}")
            continue
        if name.startswith("expert_starts."):
            continue  # judged by _check_starts
        diff = np.abs(a.astype(np.float64) - e.astype(np.float64))
        rel = diff / np.maximum(np.abs(e.astype(np.float64)), 1e-6)
        if e.dtype == np.float16:
            # A float16 cache holds the nearest float16 of a value each backend sums in its own
            # order: the two may round to neighbours, one float16 step apart beyond atol.
            diff = np.maximum(diff - np.spacing(np.abs(e)).astype(np.float64), 0.0)
        if name == "logits":
            tokens, mask = diff, agree[-1]
        else:  # present.{l}.key/value: the token axis is 2, its last `sequence` positions are new
            tokens, mask = diff[:, :, -sequence:].transpose(0, 2, 1, 3), agree[int(name.split(".")[1])]
        agreeing = tokens[mask]
        max_agreeing = float(agreeing.max()) if agreeing.size else float("nan")
        ok = not max_agreeing > report.atol and bool(np.isfinite(a).all())
        report.outputs.append(OutputCheck(step, name, a.shape, float(diff.max()), float(rel.max()),
                                          max_agreeing, ok))
        if not ok:
            report.problems.append(f"{step}: {name} differs by {max_agreeing:.3g} > atol {report.atol:g} "
                                   f"over tokens whose {report.routing} agree")


def _check_dims(report: ValidationReport, session, decoder_io: DecoderIO):
    wanted = decoder_io.shapes()
    for arg in list(session.get_inputs()) + list(session.get_outputs())[:len(decoder_io.output_names)]:
        if arg.name in wanted and list(arg.shape) != wanted[arg.name]:
            report.problems.append(f"{arg.name} has dims {arg.shape}, expected {wanted[arg.name]}")


def validate_onnx(model: InfMoEGPT, exported: Union[ExportedModel, str, os.PathLike], *, atol: Optional[float] = None,
                  kernel: bool = True, providers=None, sequence: int = 7, seed: int = 0,
                  raise_on_failure: bool = True) -> ValidationReport:
    """Check path against model (see module doc). Raises InfMoEError on failure unless
    raise_on_failure is False; the report's table() renders the numbers either way."""
    if not isinstance(exported, ExportedModel):
        exported = ExportedModel.read(exported)
    path, decoder_io = exported.path, exported.io
    require_arch(model, decoder_io.config.model_type, f"validating {path}")
    if decoder_io.config != model.config:
        raise InfMoEError(f"{path} was exported from a different model config than the one given")
    if atol is None:
        atol = DEFAULT_ATOL[decoder_io.dtype]
        atol = max(atol, KV16_ATOL) if decoder_io.kv_cache == "float16" else atol
    report = ValidationReport(path, atol,
                              routing="experts" if decoder_io.is_moe else "starts")
    # The level-1 reference: for a quantized export, the model on w' (TorchRunner dequantizes).
    reference = TorchRunner(dataclasses.replace(decoder_io, with_starts=True), model)
    positions = {}  # layer -> the reference's router outputs (z, or an MoE's logits), from a hook
    hooks = [block.moe.router.register_forward_hook(
        lambda module, args, z, layer=layer: positions.__setitem__(layer, z.detach().double()))
        for layer, block in enumerate(reference.model.h)]
    counts = []
    level2 = Agreement() if decoder_io.quantized else None
    try:
        session, names = starts_session(exported, kernel=kernel, providers=providers)
        _check_dims(report, session, decoder_io)
        float32 = float_reference(model, decoder_io) if level2 else None

        def check(step, feed):
            actual = dict(zip(names, session.run(None, dict(feed))))
            starts = [actual.pop(n) for n in names[len(decoder_io.output_names):]]
            if decoder_io.with_starts:
                starts = [actual[f"expert_starts.{i}"] for i in range(decoder_io.config.n_layer)]
            expected = reference.infer(feed, check_inputs=False)
            _compare(report, step, decoder_io, expected, actual, starts, feed["attention_mask"])
            if starts:
                counts.append(_check_starts(report, step, decoder_io, expected, starts, positions,
                                            feed["attention_mask"]))
            if level2:
                unquantized = float32.infer(feed, check_inputs=False)
                layers = range(decoder_io.config.n_layer)
                level2.add(unquantized["logits"], actual["logits"], [unquantized[f"expert_starts.{i}"] for i in layers],
                           starts, feed["attention_mask"][:, -feed["input_ids"].shape[1]:])
            return expected

        with reference, float32 or contextlib.nullcontext():
            prefill = decoder_io.dummy_inputs(batch=2, sequence=sequence, past_sequence=0, left_pad=2, seed=seed)
            expected = check("prefill", prefill)
            # The second step: one decode token on the reference's cache, or (no past) a new
            # batch and length, so that every dynamic dim takes a second value.
            rng = np.random.default_rng(seed + 1)
            if decoder_io.past:
                mask = np.concatenate([prefill["attention_mask"], np.ones((2, 1), np.int64)], axis=1)
                past = [expected[n.replace("past_key_values", "present")] for n in decoder_io.past_names]
                noise = rng.standard_normal((2, 1, decoder_io.k)) if decoder_io.noise == "sampled" else None
                check("decode", decoder_io.feed(rng.integers(0, 256, (2, 1)), mask, past, noise))
            else:
                check("batch 3", decoder_io.dummy_inputs(batch=3, sequence=sequence - 2, past_sequence=0, left_pad=1,
                                                 seed=seed + 1))
    finally:
        for hook in hooks:
            hook.remove()

    if counts:
        same, total = map(sum, zip(*counts))
        report.start_agreement = same / total
    if level2:
        report.level2 = level2.summary()
    if raise_on_failure and not report.passed:
        raise InfMoEError(f"validation of {path} failed (file kept): {report.problems[0]}")
    return report


def _check_starts(report: ValidationReport, step: str, decoder_io: DecoderIO, expected, starts, positions,
                  attention_mask: np.ndarray) -> tuple:
    """Count equal starts (a conventional MoE: experts) of real tokens; judge each row's first
    diverging layer (see module doc). A padded token is garbage by construction (its keys are all
    masked; the onnxruntime target's fused attention computes other garbage than the reference)
    and is not counted. Returns (equal starts, all starts)."""
    c = decoder_io.config
    if not decoder_io.is_moe:
        windows = c.ffn_hidden - c.slice_width + 1
        tolerance = BOUNDARY_TOLERANCE[decoder_io.dtype]
        if decoder_io.kv_cache == "float16":
            tolerance = max(tolerance, KV16_BOUNDARY_TOLERANCE)
        margin = tolerance * windows
    diverged = np.zeros(starts[0].shape[0], dtype=bool)  # per batch row
    real = np.broadcast_to(attention_mask[:, -starts[0].shape[1]:, None].astype(bool), starts[0].shape)
    same = total = 0
    for layer, actual in enumerate(starts):
        differ = (expected[f"expert_starts.{layer}"] != actual) & real
        same, total = same + int((~differ & real).sum()), total + int(real.sum())
        first = differ & ~diverged[:, None, None]
        if first.any() and decoder_io.is_moe:
            _judge_experts(report, step, layer, positions[layer].numpy()[first.any(axis=-1)], c.top_k)
        elif first.any():
            chosen = actual[first].astype(np.float64)
            position = (torch.sigmoid(positions[layer]) * windows).numpy()[first]
            outside = np.maximum(np.maximum(chosen - position, position - (chosen + 1)), 0)
            report.boundary_cases += int((outside <= margin).sum())
            if (outside > margin).any():
                report.problems.append(
                    f"{step}: layer {layer}: {int((outside > margin).sum())} window starts differ by more than "
                    f"rounding (reference position {outside.max():.3g} units outside onnxruntime's window)")
        diverged |= differ.any(axis=(1, 2))
    return same, total


def _judge_experts(report: ValidationReport, step: str, layer: int, logits: np.ndarray, top_k: int):
    """Tokens whose experts differ at their row's first diverging layer, by the reference's
    logits [tokens, E]: a boundary case where two experts next in order among the top_k + 1 lie
    within TIE_TOLERANCE of each other (relative to max(1, |logit|)), a problem otherwise."""
    ordered = -np.sort(-logits, axis=-1)[:, :top_k + 1]
    gaps = -np.diff(ordered, axis=-1).min(axis=-1) / np.maximum(1.0, np.abs(ordered).max(axis=-1))
    tied = gaps <= TIE_TOLERANCE
    report.boundary_cases += int(tied.sum())
    if not tied.all():
        report.problems.append(f"{step}: layer {layer}: {int((~tied).sum())} tokens' experts differ although no "
                               f"two of their reference logits are within {TIE_TOLERANCE:g} (closest "
                               f"{gaps[~tied].min():.3g} apart)")
